"""--resume and the recipe's settings: a changed threshold is refused naming both values, unless --allow-changed
names it; then the change is recorded in the run folder (offpolicy.train.run_folder, offpolicy.resume_settings)."""

from __future__ import annotations

import copy
import json
import re

import pytest
from typer.testing import CliRunner

from offpolicy.cli import app
from offpolicy.resume_settings import CHANGES_FILE, read_changes
from offpolicy.train.checkpoint import latest_checkpoint, read_checkpoint_info
from offpolicy.train.config import load_config
from offpolicy.train.loop import train
from offpolicy.train.run_folder import recipe_settings


def _files(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".run.lock"}


@pytest.fixture
def run(tmp_path, tiny_pair, make_overrides, varying_task):
    model0, tok = tiny_pair

    def go(steps=2, resume=False, allow=(), **extra):
        cfg = load_config(None, make_overrides(tmp_path, "tis", steps=steps, **extra))
        return train(cfg, model=copy.deepcopy(model0), tokenizer=tok, task=varying_task(), resume=resume,
                     allow_changed=allow)

    return go


def test_a_checkpoint_holds_the_recipe_settings(run, tmp_path):
    run(2, algorithm__is_upper=2.0)
    stored = read_checkpoint_info(latest_checkpoint(tmp_path / "checkpoints"))["user"]["settings"]
    assert stored["algorithm.is_upper"] == 2.0 and stored["algorithm.preset"] == "tis"
    assert stored == recipe_settings(load_config(None, ["algorithm.preset=tis", "algorithm.is_upper=2.0",
                                                        "algorithm.group_size=2", "rollout.sampling.max_new_tokens=4"]))
    assert not any(k.startswith(("run.", "optim.", "model.")) for k in stored)  # not the run's length, paths, lr


@pytest.mark.parametrize("key, old, new", [
    ("algorithm.is_upper", "2.0", "3.0"),
    ("algorithm.corrections", "[{name: tis, upper: 2.0}]", "[{name: tis, upper: 3e0}]"),
    ("alp.init_std", "1e-4", "2e-4"),
    ("rollout.sampling.top_p", "1.0", "0.9"),
    ("control.is_max_masked", "null", "0.1"),
])
def test_a_changed_setting_is_refused_naming_both_values(key, old, new, run, tmp_path):
    # Expected: algorithm.is_upper used to change silently on --resume (only the preset was checked); now the run
    # stops before the model loads, naming the key, both values, the checkpoint's step and how to allow it
    run(2, **{key.replace(".", "__"): old})
    before = _files(tmp_path)
    with pytest.raises(ValueError) as err:
        run(4, resume=True, **{key.replace(".", "__"): new})
    message = str(err.value)
    assert message.startswith(f"--resume {tmp_path}: ") and "\n" not in message
    assert " here but " in message and "in the checkpoint (step 2); pass --allow-changed " in message
    shown = re.findall(r"([\w.\[\]]+) is (.+?) here but (.+?) in the checkpoint", message)
    assert shown and all(k.startswith(key) for k, _, _ in shown)
    assert _files(tmp_path) == before


def test_the_issue_s_example(run, tmp_path):
    run(2, algorithm__is_upper=2.0)
    with pytest.raises(ValueError, match=re.escape(
            f"--resume {tmp_path}: algorithm.is_upper is 3.0 here but 2.0 in the checkpoint (step 2); pass "
            "--allow-changed algorithm.is_upper to resume with the new value")):
        run(4, resume=True, algorithm__is_upper=3.0)


def test_an_allowed_change_resumes_and_is_recorded(run, tmp_path):
    run(2, algorithm__is_upper=2.0)
    res = run(3, resume=True, allow=("algorithm.is_upper",), algorithm__is_upper=3.0)
    assert res.steps_done == 3
    rows = read_changes(tmp_path / CHANGES_FILE)
    assert [(r["step"], r["key"], r["old"], r["new"]) for r in rows] == [(2, "algorithm.is_upper", 2.0, 3.0)]
    assert rows[0]["checkpoint"].endswith("step_00000002.safetensors")
    # the new checkpoint holds the new value: resuming again with it is no change, and nothing more is recorded
    assert read_checkpoint_info(res.checkpoint)["user"]["settings"]["algorithm.is_upper"] == 3.0
    run(4, resume=True, algorithm__is_upper=3.0)
    # a second allowed change is appended, the first line kept as it was
    first = (tmp_path / CHANGES_FILE).read_text().splitlines()[0]
    run(5, resume=True, allow=("algorithm",), algorithm__is_upper=4.0)
    lines = (tmp_path / CHANGES_FILE).read_text().splitlines()
    assert lines[0] == first and [json.loads(x)["new"] for x in lines] == [3.0, 4.0]
    assert json.loads(lines[1])["step"] == 4


def test_allow_changed_names_a_setting_and_needs_resume(run, tmp_path):
    run(2)
    with pytest.raises(ValueError, match=r"'algorithm\.is_uper' is not a setting a resume compares"):
        run(3, resume=True, allow=("algorithm.is_uper",))
    with pytest.raises(ValueError, match=r"--allow-changed algorithm\.is_upper applies to --resume only"):
        run(3, allow=("algorithm.is_upper",))


def test_a_checkpoint_without_settings_is_checked_on_its_preset(run, tmp_path, make_overrides):
    # a checkpoint written before checkpoints held their settings: its preset is compared, the rest cannot be
    from safetensors import safe_open
    from safetensors.torch import save_file

    from offpolicy.train.run_folder import RunFolder

    run(2)
    path = latest_checkpoint(tmp_path / "checkpoints")
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["offpolicy"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safetensors' handle
    del meta["user"]["settings"]
    save_file(tensors, str(path), metadata={"offpolicy": json.dumps(meta)})
    assert run(3, resume=path, algorithm__is_upper=5.0).steps_done == 3
    other = load_config(None, make_overrides(tmp_path, "mis", steps=4))
    with pytest.raises(ValueError, match="algorithm.preset is 'mis' here but 'tis' in the checkpoint"):
        RunFolder(other, resume=path).release()


def test_the_cli_refuses_and_allows(tmp_path, make_overrides):
    runner = CliRunner()
    out = tmp_path / "run"
    args = ["train", *(o for o in make_overrides(out, "tis") if not o.startswith("run.steps="))]
    assert runner.invoke(app, [*args, "run.steps=1", "algorithm.is_upper=2e0"]).exit_code == 0
    res = runner.invoke(app, [*args, "run.steps=2", "algorithm.is_upper=1e-4", "--resume"])
    line = " ".join(res.output.split())
    assert res.exit_code == 2 and ("algorithm.is_upper is 0.0001 here but 2.0 in the checkpoint (step 1); pass "
                                   "--allow-changed algorithm.is_upper") in line
    res = runner.invoke(app, [*args, "run.steps=2", "algorithm.is_upper=1e-4", "--resume",
                              "--allow-changed", "algorithm.is_upper"])
    assert res.exit_code == 0, res.output
    assert [(r["key"], r["old"], r["new"]) for r in read_changes(out / CHANGES_FILE)] == [
        ("algorithm.is_upper", 2.0, 1e-4)]
