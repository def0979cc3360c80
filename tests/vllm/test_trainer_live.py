"""The reference trainer on live vLLM (rollout.engine=vllm): every sync checked and logged; a sync that leaves the
tied output head (and its embedding) behind stops the run at the step it happened, with the previous checkpoint intact."""

from __future__ import annotations

import json
from pathlib import Path

SCRIPT = Path(__file__).parent / "scripts" / "trainer_vllm.py"


def _run(run_vllm_script, tmp_path, mode):
    proc = run_vllm_script(SCRIPT, str(tmp_path / mode), mode)
    return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])


def test_train_on_vllm_logs_every_sync_check(run_vllm_script, tmp_path):
    result = _run(run_vllm_script, tmp_path, "ok")
    assert "error" not in result, result  # a healthy run: no sync may fail (the message names the test that did)
    assert result["steps_done"] == 3 and len(result["sync"]) == 3
    assert all(s["sync/ok"] == 1.0 for s in result["sync"])
    first, later = result["sync"][0], result["sync"][1:]
    assert 1e-4 < first["sync/baseline"] < 0.05  # vLLM bf16 against the fp32 trainer: a real, small gap
    assert all("sync/stale_fraction" in s and s["sync/gap"] < 4 * first["sync/baseline"] for s in later)
    # the parameter layer ran on the in-process engine and found nothing left behind
    assert all(s["sync/params_checked"] > 0 and s["sync/params_left"] == 0.0 for s in later)
    assert result["checkpoints"][-1] == "step_00000003.safetensors"


def test_a_bf16_policy_on_vllm_checks_every_sync_in_its_own_dtype(run_vllm_script, tmp_path):
    result = _run(run_vllm_script, tmp_path, "bf16")
    assert "error" not in result, result
    assert result["steps_done"] == 3 and len(result["sync"]) == 3
    assert all(s["sync/ok"] == 1.0 and s["sync/gap"] <= s["sync/threshold"] for s in result["sync"])
    assert result["sync"][0]["sync/baseline"] < 0.05  # two bf16 forwards of the same weights
    assert all(s["sync/params_left"] == 0.0 for s in result["sync"][1:])
    assert any(s["sync/step_rms"] > 0 for s in result["sync"][1:])  # the bf16 weights moved, the engine with them


def test_a_head_left_behind_stops_the_run(run_vllm_script, tmp_path):
    result = _run(run_vllm_script, tmp_path, "broken")
    assert "error" in result, result
    assert result["error"].startswith("step 2's weight sync:")
    assert result["checkpoints"] == ["step_00000001.safetensors"]  # the step before is saved, nothing after


def test_lab_moe_on_vllm_checks_its_experts_at_every_sync(run_vllm_script, tmp_path):
    """The mixture-of-experts lab model on vLLM's fused-MoE kernels: every sync is checked, the parameter layer
    covering the stacked expert tensors: 26 tensors where the CPU backend repacks its linear weights for oneDNN (the
    18 dense tensors it stores, 8 expert stacks), 38 where it falls back to torch's linear and keeps them (oneDNN
    cannot build a bf16 matmul on some CPUs: then the 12 attention and router weights are readable too); the sync
    of step 3, which leaves the experts' down projections behind, stops the run there. vLLM
    records no routes here: the run says routing/flip_rate is not logged and logs none (not a 0)."""
    result = _run(run_vllm_script, tmp_path, "moe")
    assert result["error"].startswith("step 3's weight sync:"), result
    assert result["checkpoints"] == ["step_00000001.safetensors", "step_00000002.safetensors"]
    assert len(result["sync"]) == 2 and all(s["sync/ok"] == 1.0 for s in result["sync"])
    # the engine's first load against the trainer: the bf16 gap of the model, not of experts left unpacked (0.19)
    assert 1e-4 < result["sync"][0]["sync/baseline"] < 0.05
    later = result["sync"][1]
    assert later["sync/params_checked"] in (26, 38) and later["sync/params_left"] == 0.0
    assert later["sync/gap"] < 4 * result["sync"][0]["sync/baseline"]  # the reload repacked the experts
    assert all(r == {} for r in result["routing"])
    assert any(w.startswith("routing/flip_rate is not logged") and "rollout.engine=vllm" in w
               for w in result["warnings"])
