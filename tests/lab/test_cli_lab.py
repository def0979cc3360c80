"""``offpolicy lab`` end to end on real tiny runs, ``--report-only``, failures and one-line errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import offpolicy.lab.sweep as sweep_module
from offpolicy.cli import app

runner = CliRunner()
CONTRACT = ("reward/mean", "rollout_correction/k3_kl", "loss/grad_norm", "correction/masked_frac")


@pytest.mark.slow
def test_lab_end_to_end_then_report_only(tmp_path, tiny_run):
    out = tmp_path / "lab"
    args = ["lab", "--presets", "naive,mis", "--mismatch", "none,bf16", "--seeds", "2", "--steps", "3",
            "--jobs", "2", "--out", str(out), *tiny_run]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["runs"]) == 8 and summary["complete"]
    assert {(r["preset"], r["mismatch"]) for r in summary["runs"]} == {
        (p, m) for p in ("naive", "mis") for m in ("none", "bf16")}
    for r in summary["runs"]:
        rows = [json.loads(x) for x in (out / r["dir"] / "metrics.jsonl").read_text().splitlines()]
        assert [x["step"] for x in rows] == [1, 2, 3]
        assert all(k in x for x in rows for k in CONTRACT)
        cfg = (out / r["dir"] / "config.yaml").read_text()
        assert f"preset: {r['preset']}" in cfg and "dtype: " + ("float32" if r["mismatch"] == "none" else "bfloat16")
    # the bf16 engine differs from the trainer, the fp32 one does not (k3 ≈ 1e-14 is fp32 rounding)
    stats = json.loads((out / "lab_stats.json").read_text())
    k3 = {(g["preset"], g["mismatch"]): g["k3_median"]["median"] for g in stats["groups"]}
    assert k3[("naive", "none")] < 1e-10 < k3[("naive", "bf16")]
    for name in ("report.html", "lab_table.md", "lab_stats.json", "plots/overview.png", "plots/k3_kl.png"):
        assert (out / name).is_file(), name
    assert "report: " in res.output and "plots: " in res.output and "naive" in res.output and "bf16" in res.output

    stamps = {r["dir"]: (out / r["dir"] / "metrics.jsonl").stat().st_mtime_ns for r in summary["runs"]}

    # the report alone, from the files
    (out / "report.html").unlink()
    (out / "plots" / "overview.png").unlink()
    res = runner.invoke(app, ["lab", "--report-only", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert (out / "report.html").is_file() and (out / "plots" / "overview.png").is_file()
    assert stamps == {d: (out / d / "metrics.jsonl").stat().st_mtime_ns for d in stamps}  # no run was touched


def test_failed_runs_make_the_command_fail_after_the_others(tmp_path, tiny_run, fake, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "mis")
    real = sweep_module.run_sweep
    monkeypatch.setattr(sweep_module, "run_sweep",
                        lambda plan, **kw: real(plan, **{**kw, "command": fake.command, "prepare": lambda p: None}))
    out = tmp_path / "lab"
    res = runner.invoke(app, ["lab", "--presets", "naive,mis", "--mismatch", "none", "--seeds", "2", "--steps", "3",
                              "--jobs", "2", "--out", str(out), *tiny_run])
    assert res.exit_code == 1, res.output
    assert f"failed: {out / 'runs' / 'mis__none__s0'}: error: the fake trainer fails on purpose" in res.output
    assert "2 planned runs missing" in res.output  # the report covers the finished runs and says what is missing
    assert json.loads((out / "lab_stats.json").read_text())["missing"][0]["status"] == "failed"


@pytest.mark.parametrize("args, message", [
    (["--presets", "naive,bogus"], "error: --presets: 'bogus' is not a preset"),
    (["--mismatch", "int8+int4"], "error: mismatch 'int8+int4': 'int8' sets rollout.weight_bits=8 but 'int4' sets"),
    (["--mismatch", "fp6"], "error: mismatch 'fp6': unknown source 'fp6'"),
    (["--seeds", "0"], "error: --seeds must be an int >= 1, got 0"),
    (["--jobs", "0"], "error: --jobs must be an int >= 1, got 0"),
    (["--setting", "huge"], "error: --setting 'huge' is unknown; choose one of ['quick', 'control', 'full', 'real', "
     "'real_free', 'vllm', 'stale', 'async', 'quant', 'recent', 'moe']"),
    (["run.seed=4"], "error: override 'run.seed=4': the sweep sets run.seed itself (use --seeds)"),
    (["rollout.dtype=float16"], "error: override 'rollout.dtype=float16': the sweep sets rollout.dtype itself "
                                "(use --mismatch)"),
    (["optim.lr=-1"], "error: run naive__none__s0: invalid config: optim.lr: Input should be greater than 0"),
])
def test_bad_options_fail_in_one_line_before_any_run(tmp_path, args, message):
    out = tmp_path / "lab"
    res = runner.invoke(app, ["lab", "--out", str(out), "--presets", "naive", *args]
                        if "--presets" not in args else ["lab", "--out", str(out), *args])
    assert res.exit_code == 2, res.output
    assert res.output.startswith(message) and res.output.count("\n") == 1
    assert not (out / "runs").exists()


def test_report_only_errors(tmp_path):
    res = runner.invoke(app, ["lab", "--report-only", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "summary.json' does not exist: no sweep in" in res.output
    run = tmp_path / "runs" / "naive__none__s0"
    run.mkdir(parents=True)
    (tmp_path / "summary.json").write_text(json.dumps({"runs": [
        {"preset": "naive", "mismatch": "none", "seed": 0, "dir": "runs/naive__none__s0", "steps": 3}]}))
    res = runner.invoke(app, ["lab", "--report-only", "--out", str(tmp_path)])
    assert res.exit_code == 2 and res.output.count("\n") == 1
    assert res.output.startswith(f"error: run folder {str(run)!r} has no metrics.jsonl")
