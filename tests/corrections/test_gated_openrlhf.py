"""``gated_is`` against OpenRLHF 0.11.2's own gate (``openrlhf.models.loss.PolicyLoss``, ``is_correction_*``).

Two sources of OpenRLHF's numbers:

* **recorded** (always runs): ``data/openrlhf_gate.json``, written by ``data/openrlhf_gate.py`` with
  ``openrlhf==0.11.2`` (installed ``--no-deps``) and torch 2.13 — the command is in that script's docstring. The
  inputs are stored with the outputs, so the comparison is on the very same batch; the record also keeps the sha256
  of the two OpenRLHF files the script loaded and the package versions.
* **live** (skipped, with the reason, when OpenRLHF 0.11.2 is not installed; CI installs it, and there the skip is a
  failure): the same script run now by ``$OFFPOLICY_OPENRLHF_PYTHON`` (default: this Python), compared the same way,
  and the files it loaded must hash to the record's sha256 and to the wheel's own ``RECORD`` entries.

Where the definitions coincide (every "moderate" case: ratio / binary-KL / TV gates, token and sequence level, mask
and clip) the per-token coefficient w_t·keep_t, ``is_filter_ratio``, ``vllm_kl`` and the PPO loss are equal to float32
rounding. Where they differ by design ("nearby": |log π_old − log μ| ≤ 1e-6), OpenRLHF's float32 binary KL comes out
negative and its ``[0, δ]`` test rejects tokens and sequences that the exact KL keeps: the test pins that difference.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offpolicy import LogProbBatch, gated_is, offpolicy_metrics, policy_loss

DATA = Path(__file__).parent / "data"
RECORDED = DATA / "openrlhf_gate.json"
SCRIPT = DATA / "openrlhf_gate.py"
OPENRLHF_PYTHON = os.environ.get("OFFPOLICY_OPENRLHF_PYTHON", sys.executable)
LOADED_FILES = ("openrlhf/models/loss.py", "openrlhf/models/utils.py")  # what the script executes of OpenRLHF
# The installed OpenRLHF: its version and, per loaded file, the sha256 that pip recorded from the wheel (urlsafe base64
# in the RECORD file, as hex here), printed as JSON by the Python that runs the script.
# The files to report are the probe's arguments.
PROBE = """import importlib.metadata as m, json, base64, sys
files = {str(f): base64.urlsafe_b64decode(f.hash.value + "==").hex() for f in m.files("openrlhf") if f.hash}
print(json.dumps({"version": m.version("openrlhf"), "record": {k: files.get(k) for k in sys.argv[1:]}}))"""

LEVELS = {"token": "token", "seq": "geometric"}  # OpenRLHF's seq: the per-sequence mean (geometric for the ratio)
MODES = {"mask": "mask", "clip": "truncate"}


def _tensors(inputs: dict) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in inputs.items()}


def _ours(case: dict, x: dict[str, torch.Tensor]):
    low, high = case["threshold"]
    correction = gated_is(level=LEVELS[case["level"]], mode=MODES[case["mode"]], gating=case["gating"],
                          lower=low, upper=high)
    mask = x["mask"].bool()
    at_old = LogProbBatch(logp=x["old_logp"], old_logp=x["old_logp"], rollout_logp=x["rollout_logp"], mask=mask,
                          advantages=-torch.ones(mask.shape[0]))
    result = correction(at_old)
    batch = LogProbBatch(logp=x["logp"], old_logp=x["old_logp"], rollout_logp=x["rollout_logp"], mask=mask,
                         advantages=x["advantages"])
    loss, _ = policy_loss(batch, correction=correction, objective={"name": "ppo", "clip_low": 0.2, "clip_high": 0.2},
                          aggregation="token_mean")
    kl = offpolicy_metrics(x["old_logp"], x["rollout_logp"], mask, naming="openrlhf")["train/vllm_kl"]
    return result, loss, kl



def is_filter_ratio(metrics: dict, level: str) -> float:
    """OpenRLHF's ``is_filter_ratio`` in offpolicy's names: the share of units masked or capped — valid tokens
    (``masked_frac + capped_frac``; only clip mode caps) or, at OpenRLHF's ``seq`` level, sequences."""
    if level == "seq":
        return metrics["gated_is/masked_seq_frac"].item()
    return metrics["gated_is/masked_frac"].item() + metrics["gated_is/capped_frac"].item()


def _compare(record: dict) -> list[str]:
    """Check every case of one OpenRLHF record; returns the case names checked."""
    inputs = {name: _tensors(batch) for name, batch in record["inputs"].items()}
    checked = []
    for case in record["cases"]:
        x = inputs[case["batch"]]
        mask = x["mask"].bool()
        coef = torch.tensor(case["coef"])
        result, loss, kl = _ours(case, x)
        name = f"{case['batch']}/{case['level']}/{case['mode']}/{case['gating']}"
        filter_frac = is_filter_ratio(result.metrics, case["level"])
        if case["batch"] == "moderate":  # the definitions coincide: the same numbers
            torch.testing.assert_close(result.coefficient[mask], coef[mask], rtol=1e-6, atol=1e-7, msg=name)
            assert filter_frac == pytest.approx(case["is_filter_ratio"], abs=1e-7), name
            assert loss.item() == pytest.approx(case["loss"], rel=1e-5, abs=1e-7), name
            assert kl.item() == pytest.approx(case["vllm_kl"], rel=1e-6, abs=1e-9), name
        else:  # nearby policies: OpenRLHF's negative float32 KL fails its `stat >= 0`; the exact KL never does
            assert case["gating"] == "binary_kl" and case["is_filter_ratio"] > 0, name
            assert filter_frac == 0.0 and bool(result.keep[mask].all()), name
            kept_there = coef[mask] != 0  # where OpenRLHF kept a token, the weight is the same ρ_t
            torch.testing.assert_close(result.coefficient[mask][kept_there], coef[mask][kept_there], rtol=1e-6,
                                       atol=0.0)
        checked.append(name)
    return checked


def test_equals_openrlhfs_recorded_numbers():
    record = json.loads(RECORDED.read_text())
    assert record["versions"]["openrlhf"] == "0.11.2"
    # provenance: a sha256 per loaded file (the live test below requires the installed files to match them)
    assert sorted(record["files"]) == sorted(LOADED_FILES)
    assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in record["files"].values()), record["files"]
    checked = _compare(record)
    # every gating at both levels, and the clip mode, were compared on one batch
    assert {c.split("/", 1)[1] for c in checked} >= {"token/mask/ratio", "seq/mask/ratio", "token/clip/ratio",
                                                     "token/mask/binary_kl", "seq/mask/binary_kl", "token/mask/tv",
                                                     "seq/mask/tv"}
    # the cases are not degenerate: OpenRLHF filtered some units, not all, in most of them
    fractions = [c["is_filter_ratio"] for c in record["cases"] if c["batch"] == "moderate"]
    assert sum(0 < f < 1 for f in fractions) >= 6


def test_equals_openrlhf_live(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT", "none")  # non-finite μ on purpose: the paths past the limit
    if not Path(OPENRLHF_PYTHON).is_file():
        pytest.skip(f"no Python at OFFPOLICY_OPENRLHF_PYTHON={OPENRLHF_PYTHON} to run openrlhf 0.11.2 "
                    "(the recorded comparison above ran)")
    probe = subprocess.run([OPENRLHF_PYTHON, "-c", PROBE, *LOADED_FILES], capture_output=True, text=True)
    installed = json.loads(probe.stdout) if probe.returncode == 0 else {}
    if installed.get("version") != "0.11.2":
        pytest.skip(f"{OPENRLHF_PYTHON} has no openrlhf 0.11.2 (pip install --no-deps openrlhf==0.11.2; "
                    f"{(probe.stdout or probe.stderr).strip()[-200:]})")
    out = subprocess.run([OPENRLHF_PYTHON, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    live = json.loads(out.stdout)
    assert len(_compare(live)) == len(live["cases"])
    # provenance: the files the script executed are the wheel's (pip's RECORD) and the ones the record was made from
    recorded = json.loads(RECORDED.read_text())
    assert live["files"] == installed["record"], "the installed OpenRLHF files differ from the wheel's RECORD"
    assert live["files"] == recorded["files"], "the record was made from other OpenRLHF files: regenerate it"
    assert live["versions"]["openrlhf"] == recorded["versions"]["openrlhf"]
    # and the recorded file is what the script writes today: the same inputs, outputs equal to float32 rounding
    # (another CPU's vectorised exp/log may differ in the last bit)
    assert live["inputs"] == recorded["inputs"]
    for a, b in zip(live["cases"], recorded["cases"]):
        torch.testing.assert_close(torch.tensor(a["coef"]), torch.tensor(b["coef"]), rtol=1e-6, atol=1e-7)
        assert [a[k] for k in ("loss", "is_filter_ratio", "vllm_kl")] == pytest.approx(
            [b[k] for k in ("loss", "is_filter_ratio", "vllm_kl")], rel=1e-6, abs=1e-9)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
