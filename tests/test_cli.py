"""The typer CLI: help, presets, a tiny demo-like run, train with overrides and resume, diagnose, errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from offpolicy.cli import app

TINY = ("model.tiny_config={num_hidden_layers: 2, hidden_size: 32, intermediate_size: 64, num_attention_heads: 2, "
        "num_key_value_heads: 1}")
SMALL = ["model.path=tiny-random", TINY, "task.prompts_per_step=2", "algorithm.group_size=2",
         "rollout.sampling.max_new_tokens=3", "run.progress=false"]

runner = CliRunner()


def test_help_lists_commands():
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0
    for cmd in ("demo", "train", "presets", "diagnose"):
        assert cmd in res.output


def test_presets_table():
    res = runner.invoke(app, ["presets"])
    assert res.exit_code == 0
    for name in ("naive", "tis", "mis", "geo_mask", "icepop", "opsm", "trm", "dvp", "dvp_mis", "alp"):
        assert name in res.output


def test_tiny_demo_writes_runs_plots_and_summary(tmp_path):
    res = runner.invoke(app, ["demo", "--out", str(tmp_path), "--steps", "2", "-p", "naive", "-p", "mis", *SMALL])
    assert res.exit_code == 0, res.output
    assert "naive" in res.output and "mis" in res.output and "reward" in res.output
    for name in ("naive", "mis"):
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert {"overview.png", "reward_mean.png", "rollout_correction_kl.png", "correction_masked_frac.png",
            "rollout_correction_log_ppl_abs_diff.png"} <= set(pngs)
    assert all((tmp_path / "plots" / p).stat().st_size > 1000 for p in pngs)


def test_train_yaml_overrides_resume_and_diagnose(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("algorithm:\n  preset: opsm\nrun:\n  steps: 1\n  tensorboard: false\n")
    out = tmp_path / "run"
    args = ["train", "--config", str(cfg), *SMALL, f"run.out_dir={out}"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert (out / "checkpoints" / "step_00000001.safetensors").is_file() and (out / "config.yaml").is_file()
    res = runner.invoke(app, [*args, "run.steps=2", "--resume"])
    assert res.exit_code == 0, res.output
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    res = runner.invoke(app, ["diagnose", str(out / "metrics.jsonl"), "--out", str(tmp_path / "plots")])
    assert res.exit_code == 0 and (tmp_path / "plots" / "overview.png").is_file()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["train", "algorithm.nope=1"], "algorithm.nope"),
        (["train", "model.path=/no/such/model"], "model.path"),
        (["train", "algorithm.preset=alp"], "alp.enabled"),
        (["demo", "-p", "bogus"], "algorithm.preset"),
        (["diagnose", "/no/such/metrics.jsonl"], "does not exist"),
    ],
)
def test_errors_name_the_problem_and_exit_2(args, needle, tmp_path):
    res = runner.invoke(app, [*args] + ([f"run.out_dir={tmp_path}"] if args[0] == "train" else []))
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert not (tmp_path / "metrics.jsonl").exists()  # failed before any work
