"""verl's ``OFFPOLICY_VERL`` block reads a Recipe: as ``recipe: <path or inline>`` or as the block itself, mapped onto
the block's own keys (the same recipe files the reference trainer and TRL read)."""

from __future__ import annotations

from pathlib import Path

import pytest

from offpolicy.integrations.verl.settings import ALPSettings, SamplingRecipe, parse_settings, settings_from_text

DATA = Path(__file__).parents[1] / "data" / "recipes"


def test_dvp_tis_recipe_file_gives_the_blocks_own_settings():
    from_file = parse_settings({"recipe": str(DATA / "dvp_tis.yaml")})
    own = parse_settings({"correction": [{"name": "tis", "upper": 2.0}], "sampling": {"min_p": 1e-3},
                          "sync_check": "warn"})
    assert from_file == own
    assert from_file.sampling == SamplingRecipe(min_p=0.001) and from_file.sampling.dvp_only
    assert from_file.correction == [{"name": "tis", "upper": 2.0}] and from_file.sync_check == "warn"
    # the block itself a recipe, as environment-variable text; allow_changed stays the block's own
    text = "{corrections: [{name: tis, upper: 2e0}], transforms: {dvp: {rho: 1e-3}}, sync_check: warn, " \
           "allow_changed: [correction.upper]}"
    inline = settings_from_text(text)
    assert inline.allow_changed == ("correction.upper",)
    assert inline.correction == own.correction and inline.sampling == own.sampling and inline.sync_check == "warn"


def test_alp_score_centering_and_sampling_replay_recipes():
    alp = parse_settings({"recipe": str(DATA / "alp.yaml")})
    assert alp.alp == ALPSettings(init_std=0.03, lr=5e-4)
    centred = parse_settings({"recipe": str(DATA / "score_centering.yaml")})
    assert (centred.score_centering, centred.topk_logprobs, centred.topk_bound) == (True, 20, "upper")
    replay = parse_settings({"transforms": {"sampling_replay": {"top_k": 8, "top_p": 0.9}}})
    assert replay.sampling == SamplingRecipe(top_k=8, top_p=0.9)
    topk = parse_settings({"corrections": ["trm"], "transforms": {"topk_bounds": {"k": 4, "bound": "lower"}}})
    assert (topk.topk_logprobs, topk.topk_bound) == (4, "lower")
    both = parse_settings({"recipe": str(DATA / "alp_score_centering.yaml")})  # ALP's noisy forward, centred
    assert both.score_centering and both.alp == ALPSettings(init_std=0.03, lr=5e-4) and both.topk_logprobs == 20
    with pytest.raises(ValueError, match=r"^OFFPOLICY_VERL: score_centering cannot be combined with sampling"):
        parse_settings({"recipe": {"transforms": {"score_centering": {"source": "topk"}, "dvp": {}}}})


def test_refusals_are_one_line_naming_the_key():
    with pytest.raises(ValueError, match=r"^OFFPOLICY_VERL: recipe sets sync_check to 'warn' but sync_check='off' "
                                         r"says otherwise; give it once$"):
        parse_settings({"recipe": str(DATA / "dvp_tis.yaml"), "sync_check": "off"})
    with pytest.raises(ValueError, match=r"^OFFPOLICY_VERL: the block is a recipe \(transforms\) but also has "
                                         r"'sampling'"):
        parse_settings({"transforms": {"dvp": {}}, "sampling": {"min_p": 0.1}})
    with pytest.raises(ValueError, match=r"^OFFPOLICY_VERL: recipe: unknown key 'transfroms' \(did you mean "):
        parse_settings({"recipe": {"transfroms": {}}})
    with pytest.raises(ValueError, match=r"objective / aggregation are verl's own"):
        parse_settings({"recipe": {"objective": "ppo"}})
    with pytest.raises(ValueError, match=r"OFFPOLICY_VERL: recipe transform 'exact_kl' is not computed"):
        parse_settings({"transforms": {"exact_kl": {}}})
    with pytest.raises(ValueError, match=r"OFFPOLICY_VERL: policy_versions .* which proximal needs"):
        parse_settings({"transforms": {"proximal": {"method": "loglinear"}}})
    with pytest.raises(ValueError, match=r"transforms.alp.level='sequence' is not supported here"):
        parse_settings({"transforms": {"alp": {"level": "sequence"}}})
    with pytest.raises(ValueError, match=r"recipe file 'missing.yaml' does not exist"):
        parse_settings({"recipe": "missing.yaml"})


def test_the_dvp_tis_file_drops_and_weights_in_verls_driver_as_the_reference_trainer_does():
    # the driver, given π_old's support (the engine's old-log-prob forward), chains dvp_keep ahead of TIS as
    # Recipe.build_correction does for the reference trainer: the same keep mask, weights and metric names (behind
    # verl's rollout_corr/ prefix); without the support fields the correction is TIS alone
    import torch

    from offpolicy import LogProbBatch, Recipe
    from offpolicy.integrations.verl import apply_driver_correction

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g)
    mu = old + 0.8 * torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1.0] * 5, [1.0] * 4 + [0.0], [1.0] * 2 + [0.0] * 3])
    inside = torch.rand(3, 5, generator=g) > 0.25
    mass = 1 - 0.05 * torch.rand(3, 5, generator=g)
    fields = {"old_log_probs": old, "rollout_log_probs": mu, "response_mask": mask, "advantages": torch.ones(3, 5)}
    settings = parse_settings({"recipe": str(DATA / "dvp_tis.yaml")})
    updates, metrics = apply_driver_correction({**fields, "dvp_keep": inside.float(), "dvp_mass": mass}, settings)
    trainer = Recipe.load(DATA / "dvp_tis.yaml").build_correction()(
        LogProbBatch(logp=old, old_logp=old, rollout_logp=mu, mask=mask, advantages=torch.ones(3, 5),
                     extras={"dvp_keep": inside, "dvp_mass": mass}))
    torch.testing.assert_close(updates["response_mask"], mask * (mask.bool() & trainer.keep))
    torch.testing.assert_close(updates["rollout_is_weights"], trainer.weights * mask * trainer.keep)
    assert 0 < float(metrics["rollout_corr/dvp_keep/masked_frac"]) < 1
    for key, value in trainer.metrics.items():
        torch.testing.assert_close(metrics[f"rollout_corr/{key}"], value, msg=key)
    assert {"dvp_keep/masked_frac", "dvp/mass_mean", "dvp/mass_min", "tis/weight_mean"} <= set(trainer.metrics)
    plain, plain_metrics = apply_driver_correction(fields, settings)
    assert not any("dvp" in k for k in plain_metrics) and bool((plain["response_mask"] == mask).all())
