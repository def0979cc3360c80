"""A user's own log-prob transform, named in a recipe, trains in ``OffPolicyGRPOTrainer`` (the tiny model, HF generate)
with no edit to offpolicy: the trainer runs every loss batch through :func:`offpolicy.transforms.apply_transforms`."""

from __future__ import annotations

import importlib
import math
import sys
import textwrap

import pytest
import torch

from offpolicy.models.tiny import build_tiny_model
from offpolicy.registry import TRANSFORMS

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
if not trl.__version__.startswith("1.16"):
    pytest.skip(f"overrides TRL 1.16's internal methods; installed {trl.__version__}", allow_module_level=True)

from offpolicy_testkit.trl_toy import logged, toy_dataset, varied_reward  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from offpolicy.integrations.trl import OffPolicyGRPOTrainer  # noqa: E402

PLUGIN = '''
import offpolicy as op


@op.register_transform("tilt_old", needs=("old_logp",), provides="old_logp",
                       description="π_old := π_old − by (π_θ detached where TRL skipped π_old's forward)")
def tilt_old(batch, by: float = 0.0):
    CALLS.append(tuple(batch.logp.shape))
    old = batch.old_logp if batch.old_logp is not None else batch.logp.detach()
    return batch.replace(old_logp=old - by)


@op.register_transform("mu_as_old", needs=("rollout_logp",), provides="old_logp")
def mu_as_old(batch):
    return batch.replace(old_logp=batch.rollout_logp)


CALLS = []
'''


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    (tmp_path / "my_trl_transforms.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("my_trl_transforms")  # what a user's `import my_trl_transforms` does
    for name in ("tilt_old", "mu_as_old"):
        TRANSFORMS.unregister(name)
    sys.modules.pop("my_trl_transforms", None)


def _trainer(tmp_path, **kw):
    model, tok = build_tiny_model(seed=0)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=6, max_steps=1, report_to=[], use_cpu=True, bf16=False, logging_steps=1,
                      save_strategy="no", beta=0.0, seed=0)
    return OffPolicyGRPOTrainer(model=model, reward_funcs=varied_reward, args=args, train_dataset=toy_dataset(),
                                processing_class=tok, **kw)


def test_a_plugin_transform_named_in_a_recipe_trains_in_trl(plugin_module, tmp_path):
    # π_old − 0.25 makes every token's ratio π_θ/π_old exactly e^0.25 = 1.2840 (TRL's π_old is π_θ detached here):
    # the objective's ratio metrics read the transformed batch
    torch.manual_seed(0)
    trainer = _trainer(tmp_path / "with", recipe={"transforms": {"tilt_old": {"by": 0.25}}})
    assert [t.name for t in trainer.offpolicy_transforms] == ["tilt_old"]
    trainer.train()
    assert len(plugin_module.CALLS) == 1  # one step, one micro-batch: one loss batch
    assert plugin_module.CALLS[0][0] == 4  # per_device_train_batch_size rows
    assert logged(trainer, "offpolicy/loss/ratio_mean") == [pytest.approx(math.exp(0.25), rel=1e-5)]
    assert logged(trainer, "offpolicy/loss/ratio_max") == [pytest.approx(math.exp(0.25), rel=1e-5)]
    torch.manual_seed(0)
    plain = _trainer(tmp_path / "without")
    plain.train()
    assert logged(plain, "offpolicy/loss/ratio_mean") == [pytest.approx(1.0, abs=1e-6)]
    assert len(plugin_module.CALLS) == 1  # not called without the transform


def test_a_plugin_transform_whose_input_trl_cannot_fetch_is_refused_naming_it(plugin_module, tmp_path):
    with pytest.raises(ValueError, match=r"^OffPolicyGRPOTrainer: rollout_logp \(the engine's log-probs μ of the "
                                         r"sampled tokens\), which mu_as_old needs, cannot be supplied"):
        _trainer(tmp_path, recipe={"transforms": {"mu_as_old": {}}})
