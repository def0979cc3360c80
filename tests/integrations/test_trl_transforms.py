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


@op.register_transform("topk_probe", needs=("engine_topk",), provides="nothing",
                       description="records the engine's top-K it is handed")
def topk_probe(batch, k: int = 0):
    SEEN.append((batch.extras["engine_topk.logp"], batch.extras["engine_topk.ids"], batch.mask))
    return batch


SEEN = []


CALLS = []
'''


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    (tmp_path / "my_trl_transforms.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield importlib.import_module("my_trl_transforms")  # what a user's `import my_trl_transforms` does
    for name in ("tilt_old", "mu_as_old", "topk_probe"):
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


def _vllm_batch(tmp_path, stub_vllm, stub_vllm_client, transforms):
    """A trainer with the recipe's ``transforms`` on the stub vLLM server (its top-K), in train mode, and one batch of
    8 completions it generated and scored."""
    torch.manual_seed(0)
    model, tok = build_tiny_model(seed=0)
    stub_vllm["client"] = stub_vllm_client(model, tok)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=8, max_steps=1, report_to=[], use_cpu=True, bf16=False, logging_steps=1,
                      save_strategy="no", beta=0.0, seed=0, use_vllm=True, vllm_mode="server",
                      vllm_importance_sampling_correction=False)
    trainer = OffPolicyGRPOTrainer(model=model, reward_funcs=varied_reward, args=args, train_dataset=toy_dataset(),
                                   processing_class=tok, sync_check=None, recipe={"transforms": transforms})
    trainer.model.train()
    return trainer, trainer._generate_and_score_completions([toy_dataset()[i] for i in range(2)] * 4)


def test_alp_with_score_centering_keeps_alps_loss_and_centres_its_gradient(tmp_path, stub_vllm, stub_vllm_client):
    # one batch with vLLM's top-4 (the stub server), the same ALP noise twice: with score centering the loss is ALP's
    # own value (the centred log-probs have the same value), the gradient is not (the score is centred on q̂)
    from offpolicy_testkit.trl_toy import loss_and_grad

    trainer, inputs = _vllm_batch(tmp_path, stub_vllm, stub_vllm_client, {
        "alp": {"init_std": 0.03, "seed": 0}, "score_centering": {"source": "topk", "k": 4}})
    assert trainer.offpolicy_alp is not None and trainer.offpolicy_score_centering
    trainer.offpolicy_alp.reseed(7)
    both, g_both = loss_and_grad(trainer, trainer._compute_loss, inputs)
    assert "offpolicy/alp/sigma_mean" in trainer._metrics["train"]
    trainer.offpolicy_score_centering = False  # ALP alone on the same batch and noise
    trainer.offpolicy_transforms = [t for t in trainer.offpolicy_transforms if t.name != "score_centering"]
    trainer.offpolicy_alp.reseed(7)
    alone, g_alone = loss_and_grad(trainer, trainer._compute_loss, inputs)
    torch.testing.assert_close(both, alone, rtol=1e-6, atol=1e-7)
    assert torch.isfinite(g_both).all() and ((g_both - g_alone).norm() / g_alone.norm()).item() > 1e-3


def test_a_plugin_transform_that_needs_the_engines_topk_gets_it(plugin_module, tmp_path, stub_vllm,
                                                                  stub_vllm_client):
    # k=4 in the plug-in's parameters: TRL fetches vLLM's top-4 (the stub server) and the loss batch carries it,
    # as the scoring step padded it, beside TRL's mask
    from offpolicy.integrations.trl.topk import TOPK_IDS_KEY, TOPK_LOGP_KEY

    trainer, inputs = _vllm_batch(tmp_path, stub_vllm, stub_vllm_client, {"topk_probe": {"k": 4}})
    assert trainer.offpolicy_topk == 4
    trainer._compute_loss(trainer.model, inputs)
    (logp, ids, mask), = plugin_module.SEEN
    t = inputs["completion_ids"].shape[1]
    assert logp.shape == ids.shape == (8, t, 4)
    assert torch.equal(logp, inputs[TOPK_LOGP_KEY]) and torch.equal(ids, inputs[TOPK_IDS_KEY])
    valid = mask.bool()
    assert bool(valid.any()) and bool((logp[valid] <= 0).all())
    assert bool((logp[valid].logsumexp(-1) <= 1e-5).all())  # K of the engine's probabilities: at most 1 in all
    assert bool(((ids[valid] >= 0) & (ids[valid] < trainer.model.config.vocab_size)).all())
