"""scripts/gpu_check.sh, the one command a lent GPU runs: its CPU dry run (the same checks, device cpu, small sizes)
writes the JSON the docs quote; a check whose imports are missing is skipped, one that raises fails alone; without
CUDA the real run refuses in one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from offpolicy_testkit.script_module import load_script

ROOT = Path(__file__).resolve().parents[1]
CHECKS = {"kernels", "param_digest", "train", "inspect"}


def _script():
    return load_script("scripts/gpu_check.py")


@pytest.mark.slow  # a training subprocess and an inspection: 130 s at load average 13 on 2 cores
def test_the_dry_run_passes_every_check_and_writes_the_json(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu-dry-run"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["mode"] == "cpu-dry-run" and saved["passed"] is True and set(saved["checks"]) == CHECKS
    for name in CHECKS:
        assert f"PASS    {name}: " in proc.stdout
    kernels = saved["checks"]["kernels"]
    for dtype in ("bf16", "fp32"):
        row = kernels[dtype]
        assert 0 <= row["logp_max_abs_diff"] <= row["tolerance"]["logp"]
        assert 0 < row["grad_head_rel_err"] <= row["tolerance"]["grad"]
    digest = saved["checks"]["param_digest"]
    assert digest["device_equals_cpu"] and digest["left_named"] == ["b"] and digest["bytes_copied"] == 0
    train = saved["checks"]["train"]
    assert train["steps_logged"] == saved["sizes"]["steps"] and "model.dtype=bfloat16" in train["command"]
    assert saved["checks"]["inspect"]["kl_mean"] > 0


def test_a_check_without_transformers_is_skipped_and_one_that_raises_fails_alone(monkeypatch, capsys):
    gpu_check = _script()
    monkeypatch.setitem(sys.modules, "transformers", None)
    for check in (lambda: gpu_check.check_inspect(torch.device("cpu"), 1, 1),
                  lambda: gpu_check.check_train(torch.device("cpu"), 1, Path("unused"))):
        assert check() == {"status": "skipped", "detail": "skipped: transformers missing"}

    def broken():
        raise RuntimeError("CUDA error: an illegal memory access")

    result = gpu_check._guarded("kernels", broken)
    assert result["status"] == "fail" and result["detail"] == "RuntimeError: CUDA error: an illegal memory access"
    assert "FAIL    kernels: RuntimeError" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_the_real_run_refuses_without_cuda(tmp_path):
    with pytest.raises(SystemExit, match="no CUDA device here .* --cpu-dry-run"):
        _script().main(["--out", str(tmp_path / "x.json")])
