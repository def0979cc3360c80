"""The lab's asynchronous sources (queueK, partialK) and the async setting: what they set, the plan they make, and
a short run of each source through the trainer."""

from __future__ import annotations

from collections import Counter

import pytest

from offpolicy.lab.mismatch import describe_mismatch, mismatch_overrides, mismatch_settings
from offpolicy.lab.plan import plan_sweep, planned_config
from offpolicy.lab.settings import get_setting, resolve_preset

ARMS = ["naive", "tis", "icepop", "tis_decoupled", "tis_loglinear", "m2po", "ipo"]


def test_the_async_sources_set_a_mode_and_a_bound_and_combine_with_no_lag():
    q = mismatch_settings("queue4")
    assert (q["rollout.async_mode"], q["rollout.max_staleness"], q["rollout.sync_every"]) == ("queue", 4, 1)
    p = mismatch_settings("partial8")
    assert (p["rollout.async_mode"], p["rollout.max_staleness"], p["rollout.dtype"]) == ("partial", 8, "float32")
    assert mismatch_settings("none")["rollout.async_mode"] == "none"  # every engine field set: nothing leaks in
    assert "rollout.async_mode=queue" in mismatch_overrides("bf16+queue4")  # numerics combine with a queue
    with pytest.raises(ValueError, match="mismatch 'lag4\\+queue4': a lagging engine"):
        mismatch_settings("lag4+queue4")
    with pytest.raises(ValueError, match="'queue4' sets rollout.async_mode=queue but 'partial4' sets"):
        mismatch_settings("queue4+partial4")
    assert "TRL" in describe_mismatch("queue4") and "verl" in describe_mismatch("partial4")


def test_the_async_setting_parses_into_every_arm(tmp_path):
    setting = get_setting("async")
    assert setting["steps"] == get_setting("stale")["steps"] and setting["seeds"] == 3
    plan = plan_sweep(tmp_path, "async")
    arms = Counter((r.preset, r.mismatch) for r in plan.runs)
    for source in ("queue4", "partial4", "lag4"):
        assert {p for p, m in arms if m == source} == set(ARMS)
    assert {p for p, m in arms if m == "none"} == {"naive"}  # the fp32 on-policy control
    assert set(arms.values()) == {3} and len(plan.runs) == 3 * (3 * len(ARMS) + 1)
    for run in plan.runs:
        cfg = planned_config(run)
        assert cfg.rollout.async_mode == {"queue4": "queue", "partial4": "partial"}.get(run.mismatch, "none")
        assert cfg.rollout.max_staleness == (4 if run.mismatch in ("queue4", "partial4") else 0)
        assert cfg.rollout.sync_every == (4 if run.mismatch == "lag4" else 1)
        if run.preset in ("tis_decoupled", "tis_loglinear"):
            assert cfg.algorithm.objective == "decoupled" and cfg.algorithm.preset == "tis"
            assert cfg.algorithm.proximal == run.preset.removeprefix("tis_").replace("decoupled", "recompute")
    assert resolve_preset("tis_decoupled") == ("tis", ["algorithm.objective=decoupled", "algorithm.proximal=recompute"])


@pytest.mark.parametrize("source", ["queue4", "partial4"])
def test_each_async_source_trains_for_a_few_steps(tmp_path, tiny_run, source):
    from offpolicy.train.config import load_config
    from offpolicy.train.loop import train

    cfg = load_config(None, [*tiny_run, "task.name=pattern", *mismatch_overrides(source), f"run.out_dir={tmp_path}", "run.steps=3",
                             "run.progress=false", "run.tensorboard=false", "algorithm.objective=decoupled",
                             "algorithm.proximal=loglinear", "algorithm.preset=tis"])
    history = train(cfg).history
    assert len(history) == 3
    assert history[0]["staleness/max"] == 0.0 and history[-1]["staleness/max"] <= 4
    if source == "partial4":  # 4 new tokens over 4 versions: from step 2 an answer spans more than one
        assert history[-1]["staleness/versions_per_answer"] > 1.0
