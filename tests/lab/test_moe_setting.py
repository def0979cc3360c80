"""The lab setting ``moe`` and the ``moe-`` mismatch sources: the mixture-of-experts lab model on a bf16 engine."""

from __future__ import annotations

from collections import Counter

from offpolicy.lab.mismatch import REAL_ENGINES, describe_mismatch, mismatch_settings
from offpolicy.lab.plan import plan_sweep, planned_config
from offpolicy.lab.settings import get_setting


def test_the_moe_sources_name_the_moe_model_and_its_engine():
    bf16 = mismatch_settings("moe-bf16")
    assert (bf16["model.path"], bf16["rollout.dtype"], bf16["rollout.engine"]) == ("lab-moe", "bfloat16", "hf")
    vllm = mismatch_settings("moe-vllm-bf16")
    assert (vllm["model.path"], vllm["rollout.engine"]) == ("lab-moe", "vllm")
    assert "moe-vllm-bf16" in REAL_ENGINES and "moe-bf16" not in REAL_ENGINES
    assert "mixture-of-experts" in describe_mismatch("moe-bf16")
    assert mismatch_settings("moe-bf16+kv8")["rollout.kv_cache_bits"] == 8  # a simulated source combines


def test_the_moe_setting_parses_into_every_arm_on_lab_moe(tmp_path):
    setting = get_setting("moe")
    assert setting["steps"] >= 100 and setting["seeds"] == 3
    plan = plan_sweep(tmp_path, "moe")
    arms = Counter((r.preset, r.mismatch) for r in plan.runs)
    presets = ["naive", "tis", "icepop", "trm", "r2", "r3", "dvp_mis", "score_centering"]
    assert {p for p, m in arms if m == "moe-bf16"} == set(presets)
    assert {p for p, m in arms if m == "none"} == {"naive"}  # the fp32 control
    assert set(arms.values()) == {3} and len(plan.runs) == 3 * (len(presets) + 1)
    for run in plan.runs:
        cfg = planned_config(run)
        assert cfg.model.path == "lab-moe"  # the control runs on the MoE model too
        assert cfg.run.steps == setting["steps"]
        assert cfg.rollout.dtype == ("float32" if run.mismatch == "none" else "bfloat16")
        assert cfg.rollout.routing_replay == {"r2": "r2", "r3": "r3"}.get(run.preset, "none")
