"""``OffPolicyGRPOTrainer(recipe=...)``: the same recipe files the reference trainer and verl read, mapped onto the
trainer's keywords (on the tiny model, HF generate or the stub vLLM server); a keyword that contradicts the recipe and
a need this run cannot supply are refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from offpolicy.models.tiny import build_tiny_model

pytestmark = pytest.mark.slow
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
if not trl.__version__.startswith("1.16"):
    pytest.skip(f"overrides TRL 1.16's internal methods; installed {trl.__version__}", allow_module_level=True)

from offpolicy_testkit.trl_toy import logged, toy_dataset, varied_reward  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from offpolicy.integrations.trl import OffPolicyGRPOTrainer  # noqa: E402
from offpolicy.recipe import Recipe  # noqa: E402

DATA = Path(__file__).parents[1] / "data" / "recipes"


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
                max_steps=1, report_to=[], use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", beta=0.0,
                seed=0)
    return GRPOConfig(**{**base, **kw})


def _trainer(tmp_path, **kw):
    model, tok = build_tiny_model(seed=0)
    args = kw.pop("args", None) or _args(tmp_path)
    return OffPolicyGRPOTrainer(model=model, reward_funcs=varied_reward, args=args, train_dataset=toy_dataset(),
                                processing_class=tok, **kw)


def test_dvp_tis_recipe_file_trains_as_its_keywords_do(tmp_path):
    torch.manual_seed(0)
    trainer = _trainer(tmp_path / "recipe", recipe=str(DATA / "dvp_tis.yaml"))
    assert repr(trainer.offpolicy_correction) == repr(Recipe.load({"corrections": [{"name": "tis", "upper": 2.0}]})
                                                      .build_correction())
    assert trainer.args.min_p == 0.001 and trainer.offpolicy_recipe.min_p == 0.001  # DVP's ρ reached the engine
    assert trainer.offpolicy_method_recipe == Recipe.load(DATA / "dvp_tis.yaml")
    trainer.train()
    assert logged(trainer, "offpolicy/dvp_keep/masked_frac") == [0.0]  # every sampled token inside the safe set
    assert len(logged(trainer, "offpolicy/tis/weight_mean")) == 1
    assert len(logged(trainer, "offpolicy/tis/kept_frac")) == 1  # the names the trainer and verl log for this file
    # the old keywords give the same internal settings
    torch.manual_seed(0)
    old = _trainer(tmp_path / "keywords", correction={"name": "tis", "upper": 2.0}, dvp_rho=1e-3, sync_check="warn")
    assert repr(old.offpolicy_correction) == repr(trainer.offpolicy_correction)
    assert old.offpolicy_loss_kwargs == trainer.offpolicy_loss_kwargs and old.args.min_p == trainer.args.min_p
    assert old.offpolicy_recipe == trainer.offpolicy_recipe


def test_alp_recipe_and_a_recipe_object(tmp_path):
    trainer = _trainer(tmp_path, recipe=Recipe.load(DATA / "alp.yaml"))
    alp = trainer.offpolicy_alp
    assert alp is not None and trainer.offpolicy_alp_level == "token"
    assert float(alp.sigma.detach().flatten()[0]) == pytest.approx(0.03)
    assert trainer.offpolicy_alp_clip["dual_clip"] == 10.0


def test_score_centering_recipe_through_the_stub_vllm_server(tmp_path, stub_vllm, stub_vllm_client):
    model, tok = build_tiny_model(seed=0)
    stub_vllm["client"] = stub_vllm_client(model, tok)
    args = _args(tmp_path, use_vllm=True, vllm_mode="server", vllm_importance_sampling_correction=False)
    trainer = OffPolicyGRPOTrainer(model=model, reward_funcs=varied_reward, args=args, train_dataset=toy_dataset(),
                                   processing_class=tok, recipe={"transforms": {"score_centering": {"source": "topk"}},
                                                                 "sync_check": "warn"})
    assert trainer.offpolicy_score_centering is True and trainer.offpolicy_topk == 20
    assert trainer.vllm_generation.logprobs == 20
    assert trainer.offpolicy_sync is not None and trainer.offpolicy_sync.check.on_failure == "warn"


def test_refusals_name_the_setting(tmp_path):
    with pytest.raises(ValueError, match=r"^OffPolicyGRPOTrainer: recipe=\.\.\. sets transforms.dvp.rho to 0.001 "
                                         r"but dvp_rho=0.05 says otherwise; give it once$"):
        _trainer(tmp_path, recipe=str(DATA / "dvp_tis.yaml"), dvp_rho=0.05)
    with pytest.raises(ValueError, match=r"OffPolicyGRPOTrainer: recipe: unknown key 'transfroms' \(did you mean "):
        _trainer(tmp_path, recipe={"transfroms": {}})
    with pytest.raises(ValueError, match=r"^OffPolicyGRPOTrainer: policy_versions .* which proximal needs"):
        _trainer(tmp_path, recipe={"transforms": {"proximal": {"method": "loglinear"}}})
    with pytest.raises(ValueError, match=r"recipe transform 'exact_kl' is not computed by this host"):
        _trainer(tmp_path, recipe={"transforms": {"exact_kl": {}}})
    with pytest.raises(ValueError, match=r"^OffPolicyGRPOTrainer: engine_topk .* which score_centering needs"):
        _trainer(tmp_path, recipe=str(DATA / "alp_score_centering.yaml"))  # composes, but HF generate has no top-K
    # HF generate has no μ: the recipe's m2po is refused as the keyword's is
    with pytest.raises(ValueError, match=r"^use_vllm: the engine's log-probs μ.* are read by m2po"):
        _trainer(tmp_path, recipe={"corrections": ["m2po"]})
