"""The reference trainer on live vLLM (rollout.engine=vllm): every sync checked and logged; a sync that leaves the
tied output head behind stops the run at the step it happened, with the previous checkpoint intact."""

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
