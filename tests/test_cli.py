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


def test_tiny_demo_is_the_labs_quick_sweep(tmp_path):
    args = ["demo", "--out", str(tmp_path), "--steps", "2", "--seeds", "1", "--presets", "naive,mis", "--mismatch",
            "bf16", "--jobs", "1", *SMALL]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "offpolicy demo" in res.output and "overview.png" in res.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["setting"] == "quick"
    # the quick setting runs only naive on the fp32 control (there the IS weights are 1: mis would repeat naive)
    assert sorted((r["preset"], r["mismatch"]) for r in summary["runs"]) == [
        ("mis", "bf16"), ("naive", "bf16"), ("naive", "none")]
    for run in summary["runs"]:
        rows = [json.loads(x) for x in (tmp_path / run["dir"] / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
    assert (tmp_path / "plots" / "overview.png").stat().st_size > 1000 and (tmp_path / "report.html").is_file()
    # a second call keeps the finished runs (resumable sweep) and renders the report again
    before = {r["dir"]: (tmp_path / r["dir"] / "metrics.jsonl").stat().st_mtime_ns for r in summary["runs"]}
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert all((tmp_path / d / "metrics.jsonl").stat().st_mtime_ns == t for d, t in before.items())


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
        (["demo", "--presets", "bogus"], "--presets: 'bogus' is not a preset"),
        (["diagnose", "/no/such/metrics.jsonl"], "does not exist"),
        # were tracebacks (rc 1): yaml.YAMLError is no ValueError; torch raised on the device after loading the model
        (["train", "run.steps=[1"], "run.steps='[1' is not valid YAML"),
        (["train", "run.device=banana"], "run.device: 'banana'"),
        (["train", "optim.lr=inf"], "optim.lr"),
    ],
)
def test_errors_name_the_problem_and_exit_2(args, needle, tmp_path):
    res = runner.invoke(app, [*args] + ([f"run.out_dir={tmp_path}"] if args[0] == "train" else []))
    assert res.exit_code == 2, res.output
    assert needle in res.output
    assert not (tmp_path / "metrics.jsonl").exists()  # failed before any work


def _table_runs(output):
    """The first column of the summary table's body rows."""
    return [ln.split("│")[1].strip() for ln in output.splitlines() if ln.startswith("│")]


def test_a_yaml_syntax_error_in_the_config_file_exits_2_naming_it(tmp_path):
    # Expected: one error line naming the file; it was a rich ParserError traceback with exit code 1.
    cfg = tmp_path / "syntax.yaml"
    cfg.write_text("run: [1,\n")
    res = runner.invoke(app, ["train", "--config", str(cfg)])
    assert res.exit_code == 2 and "syntax.yaml" in res.output and "not valid YAML" in res.output
    assert "Traceback" not in res.output


def test_user_text_is_printed_literally_not_as_rich_markup(tmp_path):
    # Expected: values appear as typed. rich read them as markup: task.name=a:b:c printed "a🅱c" (an emoji code),
    # run.out_dir=runs/[exp1] printed "runs/" in the header, task.name=/data/[bold]v2.jsonl lost "[bold]".
    res = runner.invoke(app, ["train", *SMALL, "task.name=a:b:c", f"run.out_dir={tmp_path}/[exp1]"])
    assert res.exit_code == 2 and "'a:b:c'" in res.output and f"{tmp_path}/[exp1]" in res.output
    res = runner.invoke(app, ["train", *SMALL, "task.name=/data/[bold]v2.jsonl", f"run.out_dir={tmp_path}/x"])
    assert res.exit_code == 2 and "/data/[bold]v2.jsonl" in res.output


def test_string_overrides_keep_their_text(tmp_path):
    # Expected: "run.out_dir=… #1" writes into the folder named with " #1" (YAML cut it at the comment).
    out = tmp_path / "exp #1"
    res = runner.invoke(app, ["train", *SMALL, "run.steps=1", "run.tensorboard=false", f"run.out_dir={out}"])
    assert res.exit_code == 0, res.output
    assert (out / "metrics.jsonl").is_file() and not (tmp_path / "exp").exists()


def test_outputs_that_cannot_be_created_exit_2_naming_the_path(tmp_path):
    # Expected: one line naming the option and the path; NotADirectoryError tracebacks before.
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    res = runner.invoke(app, ["train", *SMALL, f"run.out_dir={blocker}/run"])
    assert res.exit_code == 2 and "run.out_dir" in res.output and "a_file/run" in res.output
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    res = runner.invoke(app, ["diagnose", str(run), "--out", f"{blocker}/plots"])
    assert res.exit_code == 2 and "--out" in res.output and "a_file/plots" in res.output


def test_reusing_an_out_dir_needs_overwrite_and_resume_checks_the_run(tmp_path):
    # Expected: a fresh run into a folder holding a finished run exits 2 with one line naming the folder and what it
    # holds, leaving every file as it was; with --overwrite it replaces the run with one warning line naming it;
    # --resume of another preset exits 2 naming algorithm.preset; --resume at run.steps says there is nothing to do.
    out = tmp_path / "run"
    args = ["train", *SMALL, "run.tensorboard=false", f"run.out_dir={out}", "run.steps=1"]
    assert runner.invoke(app, [*args, "algorithm.preset=mis"]).exit_code == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".run.lock"}
    res = runner.invoke(app, [*args, "algorithm.preset=tis"])
    assert res.exit_code == 2, res.output
    line = " ".join(res.output.split())  # rich wraps long lines at the terminal's width
    assert (f"run.out_dir '{out}' holds a finished run (preset 'mis', seed 0, step 1 of 1; 1 checkpoint, "
            "1 metrics row): pass --overwrite to replace it, --resume to continue it") in line
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".run.lock"} == before
    res = runner.invoke(app, [*args, "algorithm.preset=tis", "--overwrite", "--resume"])
    assert res.exit_code == 2 and "pass one of them" in res.output
    res = runner.invoke(app, [*args, "algorithm.preset=tis", "--overwrite"])
    assert res.exit_code == 0 and f"warning: run.out_dir '{out}' holds an earlier run" in res.output
    res = runner.invoke(app, [*args, "algorithm.preset=mis", "run.steps=2", "--resume"])
    assert res.exit_code == 2 and ("algorithm.preset is 'mis' here but 'tis' in the checkpoint (step 1); pass "
                                   "--allow-changed algorithm.preset") in " ".join(res.output.split())
    res = runner.invoke(app, [*args, "algorithm.preset=tis", "--resume"])
    assert res.exit_code == 0 and "nothing to do" in res.output


def test_diagnose_distinct_labels_for_runs_of_the_same_name(tmp_path):
    # Expected: a/run and b/run are two rows ("a/run", "b/run"); keyed by folder name they collapsed into one row
    # that held only the second file.
    for parent, reward in (("a", 0.25), ("b", 0.75)):
        (tmp_path / parent / "run").mkdir(parents=True)
        (tmp_path / parent / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": reward}) + "\n")
    res = runner.invoke(app, ["diagnose", str(tmp_path / "a" / "run"), str(tmp_path / "b" / "run" / "metrics.jsonl"),
                              "--out", str(tmp_path / "plots")])
    assert res.exit_code == 0, res.output
    assert _table_runs(res.output) == ["a/run", "b/run"]
    assert "0.250→0.250" in res.output and "0.750→0.750" in res.output


def test_diagnose_empty_and_half_written_metrics(tmp_path):
    # Expected: an empty metrics.jsonl gives a warning naming it and no plots (it gave a row of dashes and five
    # blank PNGs); a half-written last line gives a warning naming the file (it gave a bare JSON error, exit 2).
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    res = runner.invoke(app, ["diagnose", str(empty)])
    assert res.exit_code == 0 and "has no logged steps" in res.output and str(empty) in res.output
    assert not (empty / "plots").exists()
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": 0.')
    res = runner.invoke(app, ["diagnose", str(cut), str(empty)])
    assert res.exit_code == 0, res.output
    assert f"warning: metrics file '{cut}/metrics.jsonl': ignoring its last line 2" in res.output
    assert _table_runs(res.output) == ["cut"] and (cut / "plots" / "overview.png").is_file()
