"""Plug-ins: a correction and an objective defined in a user's own module, trained by name from the config."""

from __future__ import annotations

import copy
import sys
import textwrap

import pytest

from offpolicy.registry import CORRECTIONS, OBJECTIVES
from offpolicy.train.config import load_config
from offpolicy.train.loop import train

USER_MODULE = '''
import torch
import offpolicy as op


@op.register_correction("half_weight")
def half_weight(factor: float = 0.5):
    """Every valid token's weight times ``factor``."""
    def apply(batch):
        kept = op.CorrectionResult.identity(batch)
        return op.CorrectionResult(kept.weights * factor, kept.keep, {"half_weight/factor": torch.tensor(factor)})
    return op.Correction("half_weight", apply, {"factor": factor})


@op.register_objective("scaled_reinforce", reads=())
def scaled_reinforce(x, *, scale: float = 1.0):
    """REINFORCE times ``scale``."""
    return op.TokenLoss(-scale * x.advantages * x.logp, x.log_ratio(x.old_logp).detach())
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """``my_methods`` importable from a temporary folder; its registrations are undone afterwards."""
    (tmp_path / "my_methods.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_methods"
    CORRECTIONS.unregister("half_weight")
    OBJECTIVES.unregister("scaled_reinforce")
    sys.modules.pop("my_methods", None)


def test_a_user_correction_and_objective_train_by_name(user_module, tmp_path, tiny_pair, make_overrides, varying_task):
    model, tok = tiny_pair

    def run(scale: float, steps: int, folder: str):
        overrides = make_overrides(tmp_path / folder, "naive", steps=steps) + [
            f"plugins=[{user_module}]",
            "algorithm.corrections=[{name: half_weight, factor: 0.25}, {name: icepop}]",
            f"algorithm.objective={{name: scaled_reinforce, scale: {scale}}}",
        ]
        return train(load_config(None, overrides), model=copy.deepcopy(model), tokenizer=tok, task=varying_task())

    res = run(2.0, 2, "two_steps")
    assert res.steps_done == 2 and not res.interrupted
    first = res.history[0]
    assert first["half_weight/factor"] == 0.25 and "icepop/kept_frac" in first and "chain/kept_frac" in first
    assert res.state.objective == "scaled_reinforce" and res.state.objective_params == {"scale": 2.0}
    # the objective is the user's: on the same first batch, scale 2 gives exactly twice scale 1's loss
    one = run(1.0, 1, "scale_one")
    assert first["loss/loss"] != 0 and first["loss/loss"] == pytest.approx(2.0 * one.history[0]["loss/loss"], rel=1e-6)


def test_unknown_names_fail_before_any_work_listing_the_registered_ones(user_module):
    with pytest.raises(ValueError, match=r"unknown correction 'halve_weight'; registered: .*half_weight"):
        load_config(None, [f"plugins=[{user_module}]", "algorithm.corrections=[halve_weight]"])
    with pytest.raises(ValueError, match=r"objective 'scaled_reinforce' has no parameter 'scal'; it takes: scale"):
        load_config(None, [f"plugins=[{user_module}]", "algorithm.objective={name: scaled_reinforce, scal: 2}"])
    with pytest.raises(ValueError, match=r"plugins: cannot import 'not_a_module'"):
        load_config(None, ["plugins=[not_a_module]"])


def test_a_plugin_given_as_a_file(tmp_path):
    path = tmp_path / "file_plugin.py"
    path.write_text(textwrap.dedent(USER_MODULE).replace("half_weight", "file_weight"))
    try:
        cfg = load_config(None, [f"plugins=[{path}]", "algorithm.corrections=[{name: file_weight, factor: 0.5}]"])
        assert cfg.algorithm.corrections == [{"name": "file_weight", "factor": 0.5}]
    finally:
        CORRECTIONS.unregister("file_weight")
        OBJECTIVES.unregister("scaled_reinforce")
        sys.modules.pop("file_plugin", None)
