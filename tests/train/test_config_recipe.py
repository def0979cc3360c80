"""The reference trainer reads a Recipe as ``algorithm.recipe`` (a file, inline, or a preset's name), mapped onto its
own config keys; a recipe's plug-in transform runs in the trainer."""

from __future__ import annotations

import copy
import sys
import textwrap
from pathlib import Path

import pytest

from offpolicy.recipe import Recipe
from offpolicy.registry import TRANSFORMS
from offpolicy.train.config import load_config, objective_call
from offpolicy.train.loop import train
from offpolicy.train.presets import PRESETS, build_chain

DATA = Path(__file__).parents[1] / "data" / "recipes"


def _chain(cfg):
    return build_chain(PRESETS[cfg.algorithm.preset], cfg.algorithm)


def test_dvp_tis_recipe_maps_onto_the_dvp_preset_with_its_chain_and_sync_check():
    cfg = load_config(None, [f"algorithm.recipe={DATA / 'dvp_tis.yaml'}"])
    a = cfg.algorithm
    assert (a.preset, a.dvp_rho, a.corrections, a.recipe) == ("dvp", 0.001, [{"name": "tis", "upper": 2.0}], None)
    assert cfg.rollout.sync_check == "warn"
    assert repr(_chain(cfg)) == repr(Recipe.load(DATA / "dvp_tis.yaml").build_correction())
    # the same as writing the trainer's own keys
    own = load_config(None, ["algorithm.preset=dvp", "algorithm.dvp_rho=1e-3", "rollout.sync_check=warn",
                             "algorithm.corrections=[{name: tis, upper: 2.0}]"])
    assert own.model_dump() == cfg.model_dump()


def test_alp_and_score_centering_recipes(tmp_path):
    cfg = load_config(None, [f"algorithm.recipe={DATA / 'alp.yaml'}"])
    assert (cfg.algorithm.preset, cfg.alp.enabled, cfg.alp.init_std, cfg.alp.lr) == ("alp", True, 0.03, 5e-4)
    assert objective_call(cfg) == ("bypass", {"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 10.0})
    cfg = load_config(None, [f"algorithm.recipe={DATA / 'score_centering.yaml'}"])
    assert cfg.algorithm.preset == "score_centering_topk" and _chain(cfg) is None
    cfg = load_config(None, [f"algorithm.recipe={DATA / 'alp_score_centering.yaml'}"])
    assert (cfg.algorithm.preset, cfg.alp.enabled, cfg.alp.init_std) == ("alp_score_centering_topk", True, 0.03)
    assert objective_call(cfg)[0] == "bypass"
    with pytest.raises(ValueError, match=r"algorithm.recipe: transforms.score_centering.weighting='tis' with alp: "
                                         r"the reference trainer combines ALP with the plain centring only"):
        load_config(None, ["algorithm.recipe={transforms: {alp: {}, score_centering: {source: topk, weighting: tis}}}"])
    with pytest.raises(ValueError, match=r"algorithm.recipe: the reference trainer combines at most one of dvp, alp, "
                                         r"score_centering and exact_kl, or alp with score_centering; the recipe has "
                                         r"dvp, alp"):
        load_config(None, ["algorithm.recipe={transforms: {dvp: {}, alp: {}}}"])


def test_alp_with_score_centering_keeps_alps_loss_and_centres_its_gradient(tmp_path, tiny_pair, make_overrides,
                                                                          varying_task):
    # the same rollout and ALP noise (run.seed) with and without the centring: the loss of the first update is ALP's
    # own value (the centred log-probs keep their value), its gradient is not (the score is centred on the sampler's q)
    model, tok = tiny_pair

    def first_update(recipe: str, folder: str) -> dict:
        overrides = [o for o in make_overrides(tmp_path / folder, steps=1) if not o.startswith("algorithm.preset")]
        cfg = load_config(None, [*overrides, f"algorithm.recipe={recipe}"])
        return train(cfg, model=copy.deepcopy(model), tokenizer=tok, task=varying_task()).history[0]

    alone = first_update("{transforms: {alp: {init_std: 0.03}}}", "alp")
    again = first_update("{transforms: {alp: {init_std: 0.03}}}", "again")
    both = first_update(str(DATA / "alp_score_centering.yaml"), "both")  # the recipe file TRL's and verl's tests read
    assert again["loss/grad_norm"] == alone["loss/grad_norm"]  # a rerun is exact: a difference below is the centring
    assert both["reward/mean"] == alone["reward/mean"]  # the same rollout
    assert both["loss/loss"] == pytest.approx(alone["loss/loss"], rel=1e-6, abs=1e-8)
    # the names TRL and verl log for the same recipe file (tests/vllm/test_trl_live.py, test_verl_e2e_live.py)
    assert {"alp/sigma_mean", "score_centering/drift_tv", "score_centering/head_mass_q"} <= set(both)
    # the engine here is the trainer's own fp32 model, so q ≈ π_θ and E_q[∇log π_θ] ≈ 0: the centred gradient moves
    # only by the top-20's tail (4e-5 of the norm here), but it moves
    assert both["loss/grad_norm"] != alone["loss/grad_norm"]


def test_a_recipe_inline_in_the_config_file_and_by_preset_name(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("algorithm:\n  recipe:\n    corrections: [{name: icepop}, {name: opsm, delta: 0.5}]\n"
                    "    aggregation: seq_mean_token_mean\n    naming: verl\n")
    cfg = load_config(path)
    assert cfg.algorithm.corrections == [{"name": "icepop"}, {"name": "opsm", "delta": 0.5}]
    assert (cfg.algorithm.aggregation, cfg.run.metric_naming, cfg.algorithm.preset) == (
        "seq_mean_token_mean", "verl", "naive")
    assert load_config(None, ["algorithm.recipe=dvp_mis"]).algorithm.preset == "dvp"


def test_the_dvp_tis_recipe_file_trains_and_logs_the_names_trl_and_verl_log(tmp_path, tiny_pair, make_overrides,
                                                                            varying_task):
    # the file TRL's train() (tests/integrations/test_trl_recipe.py) and verl's main_ppo
    # (tests/vllm/test_verl_e2e_live.py) run unchanged: the same correction metrics, under each host's prefix
    model, tok = tiny_pair
    overrides = [o for o in make_overrides(tmp_path, steps=1) if not o.startswith("algorithm.preset")]
    cfg = load_config(None, [*overrides, f"algorithm.recipe={DATA / 'dvp_tis.yaml'}"])
    first = train(cfg, model=copy.deepcopy(model), tokenizer=tok, task=varying_task()).history[0]
    assert {"tis/weight_mean", "tis/kept_frac", "dvp_keep/masked_frac"} <= set(first)
    assert first["dvp_keep/masked_frac"] == 0.0  # the engine sampled inside the same safe set


def test_a_recipe_and_a_key_that_contradicts_it_are_refused_naming_both():
    with pytest.raises(ValueError, match=r"algorithm.recipe sets transforms.dvp.rho to 0.001 but "
                                         r"algorithm.dvp_rho=0.01 says otherwise; give it once"):
        load_config(None, [f"algorithm.recipe={DATA / 'dvp_tis.yaml'}", "algorithm.dvp_rho=0.01"])
    with pytest.raises(ValueError, match=r"sets sync_check to 'warn' but rollout.sync_check='error'"):
        load_config(None, [f"algorithm.recipe={DATA / 'dvp_tis.yaml'}", "rollout.sync_check=error"])
    # a key the recipe leaves alone combines with it; the same value twice is no contradiction
    cfg = load_config(None, [f"algorithm.recipe={DATA / 'dvp_tis.yaml'}", "algorithm.dvp_rho=1e-3", "run.steps=3"])
    assert cfg.run.steps == 3 and cfg.algorithm.dvp_rho == 0.001


def test_recipe_errors_name_the_host_section_and_the_nearest_key():
    with pytest.raises(ValueError, match=r"algorithm.recipe: unknown key 'transfroms' \(did you mean 'transforms'\?\)"):
        load_config(None, ["algorithm.recipe={transfroms: {}}"])
    with pytest.raises(ValueError, match=r"the reference trainer: recipe transform 'topk_bounds' is not computed"):
        load_config(None, ["algorithm.recipe={transforms: {topk_bounds: {k: 4}}}"])
    with pytest.raises(ValueError, match=r"algorithm.recipe: transforms.alp.seed=3 is not supported here \(the "
                                         r"reference trainer draws ALP's noise from run.seed\)"):
        load_config(None, ["algorithm.recipe={transforms: {alp: {seed: 3}}}"])


PLUGIN = '''
import offpolicy as op


@op.register_transform("on_policy_old", needs=("rollout_logp",), provides="old_logp",
                       description="π_old := μ (the engine's log-probs), on every minibatch")
def on_policy_old(batch, shift: float = 0.0):
    CALLS.append(batch.logp.shape)
    return batch.replace(old_logp=batch.rollout_logp + shift)


CALLS = []


@op.register_transform("topk_seen", needs=("engine_topk",), provides="nothing",
                       description="records the engine's top-K it is handed")
def topk_seen(batch, k: int = 0):
    SEEN.append((batch.extras["engine_topk.logp"], batch.extras["engine_topk.ids"], batch.mask, batch.logp.shape))
    return batch


SEEN = []
'''


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    (tmp_path / "my_transforms.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_transforms"
    TRANSFORMS.unregister("on_policy_old")
    TRANSFORMS.unregister("topk_seen")
    sys.modules.pop("my_transforms", None)


def test_a_plugin_transform_named_in_a_recipe_runs_in_the_trainer(plugin_module, tmp_path, tiny_pair,
                                                                     make_overrides, varying_task):
    # π_old := μ makes the mismatch ratio π_old/μ exactly 1 before the correction: TIS's raw ratio is 1 on every
    # token, where without the transform the bf16 engine's μ differs from the fp32 π_old
    model, tok = tiny_pair

    def run(recipe: str, folder: str):
        overrides = [o for o in make_overrides(tmp_path / folder, steps=1) if not o.startswith("algorithm.preset")]
        cfg = load_config(None, [*overrides, f"plugins=[{plugin_module}]", f"algorithm.recipe={recipe}"])
        return cfg, train(cfg, model=copy.deepcopy(model), tokenizer=tok, task=varying_task())

    cfg, res = run("{corrections: [tis], transforms: {on_policy_old: {}}}", "with")
    assert cfg.algorithm.transforms == [{"name": "on_policy_old", "shift": 0.0}]
    calls = sys.modules[plugin_module].CALLS
    assert len(calls) == 1  # one minibatch, one step
    first = res.history[0]
    assert first["tis/raw_ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert first["tis/raw_ratio_max"] == pytest.approx(1.0, abs=1e-6)
    _, plain = run("{corrections: [tis]}", "without")
    assert plain.history[0]["tis/raw_ratio_max"] != pytest.approx(1.0, abs=1e-6)
    assert len(calls) == 1  # not called without the transform
    with pytest.raises(ValueError, match=r"unknown transform 'on_policy_od' \(did you mean 'on_policy_old'\?\)"):
        load_config(None, [f"plugins=[{plugin_module}]", "algorithm.recipe={transforms: {on_policy_od: {}}}"])


def test_a_plugin_transform_that_needs_the_engines_topk_gets_it_in_the_trainer(plugin_module, tmp_path, tiny_pair,
                                                                                 make_overrides, varying_task):
    # k=3 in the plug-in's parameters: the engine reports its top-3 at every sampled position, and every minibatch
    # the transform sees carries it beside its mask: K log-probs of one distribution (at most 1 in all), the sampled
    # token among them where it is the engine's most likely
    model, tok = tiny_pair
    overrides = [o for o in make_overrides(tmp_path, steps=1) if not o.startswith("algorithm.preset")]
    cfg = load_config(None, [*overrides, f"plugins=[{plugin_module}]",
                             "algorithm.recipe={transforms: {topk_seen: {k: 3}}}"])
    train(cfg, model=copy.deepcopy(model), tokenizer=tok, task=varying_task())
    seen = sys.modules[plugin_module].SEEN
    assert len(seen) == 1
    logp, ids, mask, shape = seen[0]
    assert logp.shape == ids.shape == (*shape, 3)
    valid = mask.bool()
    assert bool(valid.any()) and bool((logp[valid].logsumexp(-1) <= 1e-5).all())
    assert bool((logp[valid][:, :-1] >= logp[valid][:, 1:]).all())  # the engine's order: most likely first
    assert bool(((ids[valid] >= 0) & (ids[valid] < model.config.vocab_size)).all())
