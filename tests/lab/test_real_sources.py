"""The lab's real-engine sources (``gguf-*``): each is a complete llama.cpp engine whatever the base says, none
combines with another source, and the ``real`` setting plans valid runs."""

from __future__ import annotations

import pytest

from offpolicy.lab.mismatch import (
    REAL_ENGINES,
    SOURCES,
    describe_mismatch,
    mismatch_overrides,
    mismatch_settings,
)
from offpolicy.lab.settings import get_setting
from offpolicy.train.config import load_config


@pytest.mark.parametrize(("name", "weights", "kv"), [
    ("gguf-f32", "f32", "f32"), ("gguf-f16", "f16", "f16"), ("gguf-q8_0", "q8_0", "f16"),
    ("gguf-q4_0", "q4_0", "f16"), ("gguf-q8_0-kv8", "q8_0", "q8_0"), ("gguf-q4_0-kv4", "q4_0", "q4_0"),
])
def test_each_gguf_source_is_a_complete_llamacpp_engine(name, weights, kv):
    # a base that says another engine must not leak in: the source sets the engine, its weights and its KV cache
    base = ["rollout.llamacpp.weights=bf16", "rollout.llamacpp.kv_cache_type=q4_0", "rollout.llamacpp.threads=1"]
    r = load_config(None, [*base, *mismatch_overrides(name)]).rollout
    assert (r.engine, r.llamacpp.weights, r.llamacpp.kv_cache_type) == ("llamacpp", weights, kv)
    assert r.llamacpp.threads == 1  # not a numerics field: the base's choice stays
    # the simulation fields stay at their control values (the llama.cpp engine refuses anything else)
    assert (r.weight_bits, r.kv_cache_bits, r.logit_noise, r.sync_every) == (None, None, 0.0, 1)
    assert "llama.cpp" in describe_mismatch(name)


def test_simulated_sources_stay_on_the_transformers_engine():
    base = ["rollout.engine=llamacpp"]  # a base naming the real engine cannot leak into a simulated source
    for name in ("none", "int4+kv4", "lag8"):
        assert load_config(None, [*base, *mismatch_overrides(name)]).rollout.engine == "hf"
    assert set(REAL_ENGINES) == {n for n in SOURCES if n.startswith(("gguf-", "vllm-", "moe-vllm-"))}
    assert len(REAL_ENGINES) == 9


@pytest.mark.parametrize("bad", ["gguf-q4_0+kv4", "bf16+gguf-q8_0", "gguf-q8_0+lag8"])
def test_a_real_engine_combines_with_nothing(bad):
    with pytest.raises(ValueError, match="whole llama.cpp engine and cannot be combined"):
        mismatch_settings(bad)


def test_real_setting_plans_valid_runs(tmp_path):
    from offpolicy.lab.plan import plan_sweep

    s = get_setting("real")
    assert s["seeds"] >= 3 and "none" in s["mismatches"] and {"naive", "tis"} <= set(s["presets"])
    assert {"gguf-q8_0", "gguf-q4_0"} <= set(s["mismatches"])
    plan = plan_sweep(tmp_path, "real")
    engines = {run.mismatch: load_config(None, list(run.overrides)).rollout.engine for run in plan.runs}
    assert engines["none"] == "hf" and all(engines[m] == "llamacpp" for m in engines if m.startswith("gguf-"))


def test_real_free_setting_runs_the_stochastic_task(tmp_path):
    from offpolicy.lab.plan import plan_sweep

    plan = plan_sweep(tmp_path, "real_free")
    cfgs = [load_config(None, list(run.overrides)) for run in plan.runs]
    assert {c.task.name for c in cfgs} == {"free_digits"} and {c.task.options["length"] for c in cfgs} == {32}
    assert {c.rollout.engine for c in cfgs} == {"hf", "llamacpp"}
