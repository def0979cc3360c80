"""A user's own log-prob transform in verl's policy loss: named in ``OFFPOLICY_VERL``'s ``plugin_transforms`` (or its recipe's ``transforms``), it runs on each
micro-batch through :func:`offpolicy.transforms.apply_transforms`, checked against the hand-computed PPO loss."""

from __future__ import annotations

import math

import pytest
import torch

from offpolicy.integrations.verl.loss import verl_policy_loss_fn
from offpolicy.integrations.verl.settings import ENV_VAR, parse_settings
from offpolicy.recipe.hosts import verl_block
from offpolicy.registry import TRANSFORMS, register_transform


@pytest.fixture
def tilt_old():
    @register_transform("tilt_old_verl", needs=("old_logp",), provides="old_logp")
    def tilt(batch, by: float = 0.0):
        return batch.replace(old_logp=batch.old_logp - by)

    yield "tilt_old_verl"
    TRANSFORMS.unregister("tilt_old_verl")


def test_the_block_and_a_recipe_name_a_plugin_transform(tilt_old):
    assert parse_settings({"plugin_transforms": [{"name": tilt_old, "by": 0.25}]}).plugin_transforms == (
        {"name": tilt_old, "by": 0.25},)
    block = verl_block({"recipe": {"transforms": {tilt_old: {"by": 0.25}}}})
    assert block["plugin_transforms"] == [{"name": tilt_old, "by": 0.25}]
    assert parse_settings(block).plugin_transforms == ({"name": tilt_old, "by": 0.25},)
    with pytest.raises(ValueError, match=r"^OFFPOLICY_VERL: plugin_transforms\[0\]: 'dvp' is a built-in transform; set it "):
        parse_settings({"plugin_transforms": ["dvp"]})
    with pytest.raises(ValueError, match=r"^OFFPOLICY_VERL: plugin_transforms\[0\]: transform 'tilt_old_verl' has no "
                                         r"parameter 'bye' \(did you mean 'by'\?\)"):
        parse_settings({"plugin_transforms": [{"name": tilt_old, "bye": 1}]})
    with pytest.raises(ValueError, match=r"^OFFPOLICY_VERL: plugin_transforms must be a list"):
        parse_settings({"plugin_transforms": tilt_old})


def test_a_plugin_that_needs_the_engines_topk_is_refused_in_one_line():
    register_transform("topk_reader_verl", needs=("engine_topk",), provides="nothing")(lambda batch, k=0: batch)
    try:
        with pytest.raises(ValueError, match=r"^OFFPOLICY_VERL: plugin_transforms\[0\]: 'topk_reader_verl' needs "
                                             r"engine_topk, which verl's policy loss does not receive"):
            parse_settings({"plugin_transforms": [{"name": "topk_reader_verl", "k": 4}]})
    finally:
        TRANSFORMS.unregister("topk_reader_verl")


def test_verls_policy_loss_runs_the_blocks_plugin_on_each_micro_batch(tilt_old, monkeypatch):
    # π_old − 0.25: r = e^0.25 = 1.284 on every token, clipped at 1 + 0.2 for A = 1: L = −1.2 (without: −1)
    old = torch.full((2, 3), -1.0)
    logp = old.clone().requires_grad_(True)
    args = (old, logp, torch.ones(2, 3), torch.ones(2, 3), "token-mean", {"clip_ratio": 0.2})
    monkeypatch.delenv(ENV_VAR, raising=False)
    plain, metrics = verl_policy_loss_fn()(*args)
    assert plain.item() == pytest.approx(-1.0) and metrics["loss/ratio_mean"] == pytest.approx(1.0)
    monkeypatch.setenv(ENV_VAR, f"{{plugin_transforms: [{{name: {tilt_old}, by: 0.25}}]}}")
    tilted, metrics = verl_policy_loss_fn()(*args)
    assert tilted.item() == pytest.approx(-1.2)
    assert metrics["loss/ratio_mean"] == pytest.approx(math.exp(0.25), rel=1e-6)
    assert torch.autograd.grad(tilted, logp)[0].abs().sum().item() == 0.0  # every token clipped: no gradient
    given, _ = verl_policy_loss_fn(transforms=[])(*args)  # an explicit list overrides the block's
    assert given.item() == pytest.approx(-1.0)
