"""VLLMRolloutEngine against live vLLM (CPU build): generation, μ, weight sync through reload_weights, and the sync
check catching a sync that leaves the tied output head (and its embedding) behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "engine_sync.py"


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine_result(request, run_vllm_script):
    proc = run_vllm_script(SCRIPT, request.param)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_generation_is_reproducible_and_mu_is_the_engines_own(engine_result):
    assert engine_result["tokens"] > 0
    assert engine_result["same_tokens_on_rerun"]
    assert engine_result["topk_sorted"]
    # μ (sampled log-prob, T = 1, no truncation) and vLLM's prompt log-prob of the same token: one model, one dtype;
    # the decode (one token) and the prefill (whole sequence) paths may round differently in bf16
    assert engine_result["mu_vs_engine_score"] < (1e-4 if engine_result["dtype"] == "float32" else 0.05)


def test_the_mismatch_is_the_dtypes(engine_result):
    gap = engine_result["mu_vs_trainer_mean_abs"]
    if engine_result["dtype"] == "float32":
        assert gap < 1e-4  # fp32 kernels against fp32 transformers: round-off only
    else:
        assert 1e-4 < gap < 0.2  # bf16: a real, small mismatch


def test_a_sync_reaches_the_engine_and_the_check_passes(engine_result):
    base = engine_result["calibrate"]["sync/baseline"]
    # the update is visible before the sync: the check's own limit (baseline + its noise) would flag the stale engine
    assert engine_result["stale_gap"] > engine_result["threshold"]
    after = engine_result["after_sync"]
    assert after["sync/ok"] == 1.0 and after["sync/params_left"] == 0.0  # every readable engine tensor moved
    assert after["sync/gap"] <= max(4 * base, 1e-3)


def test_the_check_catches_a_head_left_behind(engine_result):
    assert engine_result["caught"] is not None
    assert "sync 2 (output head left behind)" in engine_result["caught"]


def test_the_parameter_layer_names_a_layer_left_behind_below_the_noise(engine_result):
    # lr 1e-6: the probe moves far less than the engine's own noise, yet the last layer's readable tensors (its
    # biases; its norms too on fp32) stayed as they were while the trainer's casts changed
    left = engine_result["layer_left"]
    assert engine_result["layer_left_checked"] > 0
    assert left["sync/ok"] == 0.0 and left["sync/params_left"] >= 1


def test_vllms_cpu_build_cannot_return_routed_experts_and_r3_is_refused(run_vllm_script):
    """R3 needs the engine's routes. vLLM 0.32's CPU build cannot give them: vLLM itself refuses
    enable_return_routed_experts (only Model Runner V2 returns them, and it needs Triton, which the CPU build lacks),
    so the engine refuses record_routes first, in one line with that reason (the trainer: rollout.routing_replay=r3
    with rollout.engine=vllm, in its config). A vLLM CPU build that can return them fails this test: wire R3 then."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("vLLM's CPU build only")
    proc = run_vllm_script(Path(__file__).parent / "scripts" / "vllm_routes.py", timeout=300)
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    assert result["reason"] is not None and "needs Triton" in result["reason"]
    assert result["engine"] is not None and "\n" not in result["engine"]
    assert result["engine"].startswith("record_routes (R3's engine routes) is not available on this vLLM")
    # the installed vLLM's own answer: the reason the refusal gives is vLLM's
    assert result["vllm"] is not None and ("Model Runner V2" in result["vllm"] or "Triton" in result["vllm"])
