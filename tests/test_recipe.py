"""The Recipe schema (offpolicy.recipe): loading from a dict, YAML / JSON text or a file, writing it back, the
errors that name the nearest key, the presets as named recipes, the transform registry and ``needs()``."""

from __future__ import annotations

import inspect
import math
import sys
import textwrap

import pytest
import torch

import offpolicy as op
from offpolicy.recipe import Recipe, needs
from offpolicy.recipe.hosts import HOSTS, OLD_SPELLINGS, check_host, rows, trl_keywords
from offpolicy.recipe.named import NAMED_RECIPES, named_recipe
from offpolicy.registry import TRANSFORMS, build_transform, register_transform
from offpolicy.train.presets import PRESETS, AlgorithmDefaults, build_chain

DATA = __import__("pathlib").Path(__file__).parent / "data" / "recipes"


# -- loading and writing ----------------------------------------------------------------------------------------------


def test_the_same_recipe_from_a_dict_yaml_json_and_a_file(tmp_path):
    data = {"corrections": [{"name": "tis", "upper": 2.0}], "transforms": {"dvp": {"rho": 0.001}},
            "sync_check": "warn"}
    from_dict = Recipe.load(data)
    from_yaml = Recipe.load("{corrections: [{name: tis, upper: 2e0}], transforms: {dvp: {rho: 1e-3}}, sync_check: warn}")
    from_json = Recipe.load('{"corrections": [{"name": "tis", "upper": 2.0}], "transforms": {"dvp": {"rho": 0.001}},'
                            ' "sync_check": "warn"}')
    from_file = Recipe.load(DATA / "dvp_tis.yaml")
    from_text_path = Recipe.load(str(DATA / "dvp_tis.yaml"))
    assert from_dict == from_yaml == from_json == from_file == from_text_path
    assert from_file.transforms["dvp"]["rho"] == 0.001 and isinstance(from_file.corrections[0]["upper"], float)


def test_dump_and_load_round_trip(tmp_path):
    for name in NAMED_RECIPES:
        recipe = named_recipe(name)
        path = tmp_path / f"{name}.yaml"
        text = recipe.dump(path)
        assert path.read_text() == text
        again = Recipe.load(path)
        assert again == recipe and again.to_dict() == recipe.to_dict()
    # an empty recipe dumps to an empty mapping and loads back
    assert Recipe.load(Recipe().dump()) == Recipe()
    # sync_check: off (YAML 1.1's bare off is false) round-trips as the text 'off'
    off = Recipe.load("sync_check: off")
    assert off.sync_check == "off" and Recipe.load(off.dump()).sync_check == "off"


def test_only_given_sections_are_dumped():
    assert Recipe.load({"sync_check": "warn"}).to_dict() == {"sync_check": "warn"}
    assert Recipe.load({"corrections": []}).to_dict() == {"corrections": []}


@pytest.mark.parametrize(("data", "message"), [
    ({"transfroms": {}}, r"^recipe: unknown key 'transfroms' \(did you mean 'transforms'\?\); valid: corrections, "),
    ({"correction": ["tis"]}, r"unknown key 'correction' \(did you mean 'corrections'\?\)"),
    ({"transforms": {"dvpp": {}}}, r"^recipe: transforms: unknown transform 'dvpp' \(did you mean 'dvp'\?\)"),
    ({"transforms": {"dvp": {"rh": 0.1}}}, r"transform 'dvp' has no parameter 'rh' \(did you mean 'rho'\?\); it "
                                           r"takes: rho, coverage"),
    ({"corrections": ["tiss"]}, r"corrections: entry 0: unknown correction 'tiss' \(did you mean 'tis'\?\)"),
    ({"corrections": [{"name": "tis", "uper": 2}]}, r"correction 'tis' has no parameter 'uper'"),
    ({"aggregation": "token_meen"}, r"aggregation: 'token_meen' is unknown \(did you mean 'token_mean'\?\)"),
    ({"objective": {"name": "ppo", "clip_lo": 0.2}}, r"objective: objective 'ppo' has no parameter 'clip_lo'"),
    ({"sync_check": "auto"}, r"sync_check: Input should be 'error', 'warn' or 'off'"),
    ({"naming": "trll"}, r"naming: 'trll' is unknown \(did you mean 'trl'\?\)"),
    ({"transforms": {"dvp": {"rho": 2.0}}}, r"transform 'dvp': rho must be a real number in \(0.0, 1.0\], got 2.0"),
    ({"transforms": {"dvp": {"rho": "1e-3"}}}, r"rho must be a real number"),  # quoted: text, not a number
    ({"transforms": {"topk_bounds": {}}}, r"transform 'topk_bounds' needs parameter 'k'"),
    ({"transforms": {"score_centering": {"source": "exact", "weighting": "tis"}}}, r"weighting applies to source"),
    ({"transforms": {"alp": {"level": "tokens"}}}, r"level must be one of 'token', 'geometric', 'sequence'"),
    ({"transforms": ["dvp"]}, r"transforms: must be a mapping of transform names"),
])
def test_bad_recipes_fail_in_one_line_naming_the_key(data, message):
    with pytest.raises(ValueError, match=message) as err:
        Recipe.load(data)
    assert "\n" not in str(err.value)


def test_bad_sources_name_the_host_and_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"^algorithm.recipe: recipe file 'nope.yaml' does not exist$"):
        Recipe.load("nope.yaml", where="algorithm.recipe")
    bad = tmp_path / "bad.yaml"
    bad.write_text("corrections: [tis\n")
    with pytest.raises(ValueError, match=r"^OffPolicyGRPOTrainer: recipe \(.*bad.yaml\): not YAML / JSON: "):
        Recipe.load(bad, where="OffPolicyGRPOTrainer: recipe")
    with pytest.raises(ValueError, match=r"^recipe: must be a mapping .* got list"):
        Recipe.load("[tis]")


# -- the presets as named recipes ---------------------------------------------------------------------------------------


def test_every_preset_is_a_named_recipe():
    assert sorted(NAMED_RECIPES) == sorted(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_named_recipe_builds_the_presets_chain_and_objective(name):
    preset, recipe = PRESETS[name], named_recipe(name)
    ours, theirs = recipe.build_correction(), build_chain(preset, AlgorithmDefaults())
    assert repr(ours) == repr(theirs)
    if theirs is not None:  # the same parts, with the same parameters, and the same weights on a batch
        assert [(c.name, c.config) for c in ours.parts or (ours,)] == [(c.name, c.config) for c in
                                                                     theirs.parts or (theirs,)]
        batch = _batch()
        a, b = ours(batch), theirs(batch)
        assert torch.equal(a.weights, b.weights) and torch.equal(a.keep, b.keep)
    objective = recipe.objective if isinstance(recipe.objective, str) else recipe.objective["name"]
    assert objective == preset.objective
    assert ("dvp" in recipe.transforms) == preset.minp and ("alp" in recipe.transforms) == preset.alp
    assert ("exact_kl" in recipe.transforms) == preset.divergence
    centering = recipe.transform("score_centering")
    assert (centering.params["source"] if centering else None) == preset.score_centering
    assert (centering.params["weighting"] if centering else None) == preset.score_weighting
    if preset.dual_clip is not None:
        assert recipe.objective["dual_clip"] == preset.dual_clip
    if preset.minp:
        assert recipe.transform("dvp").params["rho"] == math.exp(-13)


def _batch() -> op.LogProbBatch:
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=g) * 3
    return op.LogProbBatch(logp=logp, old_logp=logp + 0.3 * torch.randn(3, 5, generator=g),
                           rollout_logp=logp + torch.randn(3, 5, generator=g), mask=torch.ones(3, 5),
                           advantages=torch.tensor([1.0, -1.0, 0.5]), extras={"dvp_keep": torch.rand(3, 5, generator=g) > 0.2})


# -- the transform registry and needs() ---------------------------------------------------------------------------------


def test_the_builtin_transforms_describe_their_params_and_needs():
    assert {"dvp", "sampling_replay", "score_centering", "proximal", "alp", "topk_bounds", "exact_kl"} <= set(TRANSFORMS)
    assert build_transform("dvp").params == {"rho": math.exp(-13), "coverage": None}
    assert build_transform("dvp").needs == ("sampling_recipe",)
    assert build_transform({"name": "score_centering", "source": "exact"}).needs == ("engine_logits",)
    assert build_transform({"name": "score_centering", "source": "topk", "weighting": "tis"}).needs == (
        "engine_topk", "rollout_logp")
    assert build_transform("proximal").needs == ("old_logp",)
    assert build_transform({"name": "proximal", "method": "loglinear"}).needs == ("policy_versions", "rollout_logp")
    assert build_transform("alp").needs == ("hidden_states",)
    assert build_transform({"name": "topk_bounds", "k": 8}).needs == ("engine_topk",)
    for name in TRANSFORMS:
        entry = TRANSFORMS[name]
        assert entry.provides in ("logp", "old_logp", "token_divergence")
        assert entry.description


def test_needs_answers_for_corrections_objectives_and_transforms():
    assert needs({}) == {"old_logp": ["objective"]}
    assert needs(DATA / "dvp_tis.yaml") == {"old_logp": ["tis", "objective"], "sampling_recipe": ["dvp"]}
    # μ: m2po (a correction) and ipo (an objective that reads it), as offpolicy.needs_rollout_logp says
    assert needs({"corrections": ["icepop", "m2po"], "objective": "ipo"}) == {
        "old_logp": ["icepop", "m2po", "objective"], "rollout_logp": ["m2po", "ipo"]}
    assert needs({"transforms": {"proximal": {"method": "loglinear"}, "topk_bounds": {"k": 4}}}) == {
        "old_logp": ["objective"], "policy_versions": ["proximal"], "rollout_logp": ["proximal"],
        "engine_topk": ["topk_bounds"]}
    assert Recipe.load({"corrections": ["m2po"]}).needs() == needs({"corrections": ["m2po"]})
    assert set(needs({"transforms": {"alp": {}, "dvp": {}}})) <= set(op.NEEDS)


def test_a_plugin_transform_registers_with_its_params_and_needs():
    @register_transform("scale_old", needs=("old_logp",), provides="old_logp", description="π_old shifted")
    def scale_old(batch, by: float = 0.0, *, label: str = "x"):
        return batch.replace(old_logp=batch.old_logp + by)

    try:
        bound = build_transform({"name": "scale_old", "by": 0.5})
        assert bound.params == {"by": 0.5, "label": "x"} and bound.needs == ("old_logp",)
        assert needs({"transforms": {"scale_old": {}}})["old_logp"] == ["objective", "scale_old"]
        plugin = Recipe.load({"transforms": {"scale_old": {}}})
        check_host(plugin, "trainer")  # the reference trainer runs a plug-in's apply on every minibatch
        check_host(plugin, "trl")  # so does OffPolicyGRPOTrainer, on every loss batch (apply_transforms)
        check_host(plugin, "verl")  # and verl's policy loss, on every micro-batch
        # the same function registered again (a module re-imported) replaces it; another function is refused
        register_transform("scale_old", needs=("old_logp",))(scale_old)
        with pytest.raises(ValueError, match="transform 'scale_old' is already registered"):
            register_transform("scale_old")(lambda batch: batch)
        with pytest.raises(ValueError, match="unknown need 'logits'; known: rollout_logp, old_logp"):
            register_transform("bad_needs", needs=("logits",))
        with pytest.raises(ValueError, match="is computed by the host"):
            build_transform("dvp")(None)
    finally:
        TRANSFORMS.unregister("scale_old")


# -- hosts: what they supply, the one table of old spellings -----------------------------------------------------------


def test_a_host_refuses_a_need_it_cannot_supply_naming_it():
    loglinear = Recipe.load({"transforms": {"proximal": {"method": "loglinear"}}})
    check_host(loglinear, "trainer")
    with pytest.raises(ValueError, match=r"^OffPolicyGRPOTrainer: policy_versions \(the policy version that sampled "
                                         r"each token, .*\), which proximal needs, cannot be supplied"):
        check_host(loglinear, "trl")
    with pytest.raises(ValueError, match=r"^the reference trainer: recipe transform 'topk_bounds' is not computed"):
        check_host(Recipe.load({"transforms": {"topk_bounds": {"k": 4}}}), "trainer")
    with pytest.raises(ValueError, match=r"rollout_logp .* which m2po needs"):
        check_host(Recipe.load({"corrections": ["m2po"]}), "trl", HOSTS["trl"].supplies)


def test_the_old_spellings_table_holds_each_hosts_defaults():
    from offpolicy.integrations.trl.mixin import OffPolicyGRPOMixin
    from offpolicy.integrations.verl.settings import VerlSettings
    from offpolicy.train.config import TrainConfig

    signature = inspect.signature(OffPolicyGRPOMixin.__init__).parameters
    for row in rows("trl"):
        assert row.key in signature and signature[row.key].default == row.default, row.key
    verl = VerlSettings()
    for row in rows("verl"):
        own = getattr(verl, row.key)
        assert (own if row.key != "sampling" else {}) == row.default or (own is None and row.default is None), row.key
    defaults = TrainConfig().model_dump()
    for row in rows("trainer"):
        node = defaults
        for part in row.key.split("."):
            node = node[part]
        assert node == row.default, row.key
    assert {row.host for row in OLD_SPELLINGS} == set(HOSTS)


def test_trl_keywords_refuse_a_keyword_the_recipe_contradicts():
    recipe = Recipe.load(DATA / "dvp_tis.yaml")
    kw = trl_keywords(recipe, {"dvp_rho": None, "sync_check": "error", "correction": None})
    assert kw["dvp_rho"] == 0.001 and kw["sync_check"] == "warn" and kw["correction"] == [{"name": "tis", "upper": 2.0}]
    assert trl_keywords(recipe, {"dvp_rho": 0.001})["dvp_rho"] == 0.001  # the same value twice is no contradiction
    with pytest.raises(ValueError, match=r"^OffPolicyGRPOTrainer: recipe=\.\.\. sets corrections to .* but "
                                         r"correction='icepop' says otherwise; give it once$"):
        trl_keywords(recipe, {"correction": "icepop"})
    assert trl_keywords(Recipe.load("sync_check: off"), {})["sync_check"] is None  # TRL's spelling of off
    assert trl_keywords(Recipe.load(DATA / "alp.yaml"), {"alp": None})["alp"] == {"init_std": 0.03, "lr": 5e-4}
    assert trl_keywords(Recipe.load({"transforms": {"alp": {}}}), {"alp": True})["alp"] == {}  # True: the defaults
    with pytest.raises(ValueError, match=r"alp=True says otherwise"):  # the defaults are not σ₀ = 3e-2
        trl_keywords(Recipe.load(DATA / "alp.yaml"), {"alp": True})


# -- the CLI ----------------------------------------------------------------------------------------------------------------


def test_presets_cli_lists_and_writes_the_named_recipes(tmp_path):
    from typer.testing import CliRunner

    from offpolicy.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["presets"])
    assert res.exit_code == 0 and "transforms" in res.output and "exact_kl" in res.output
    res = runner.invoke(app, ["presets", "dvp_mis", "--write", str(tmp_path / "r.yaml")])
    assert res.exit_code == 0, res.output
    assert Recipe.load(tmp_path / "r.yaml") == named_recipe("dvp_mis") and "dvp:" in res.output
    res = runner.invoke(app, ["presets", "dvp_miss"])
    assert res.exit_code == 2 and "did you mean 'dvp_mis'" in res.output


def test_doctor_validates_a_recipe_and_says_which_hosts_take_it(tmp_path):
    from typer.testing import CliRunner

    from offpolicy.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["doctor", "--recipe", str(DATA / "dvp_tis.yaml")])
    assert res.exit_code == 0, res.output
    assert "needs sampling_recipe" in res.output
    for host in ("trainer", "trl", "verl"):
        assert f"{host}: accepted" in res.output
    res = runner.invoke(app, ["doctor", "--recipe", str(DATA / "alp_score_centering.yaml")])
    assert res.exit_code == 0
    assert res.output.count("refused") == 0, res.output  # every host centres ALP's noisy forward
    for host in ("trainer", "trl", "verl"):
        assert f"{host}: accepted" in res.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("transfroms: {}\n")
    res = runner.invoke(app, ["doctor", "--recipe", str(bad)])
    assert res.exit_code == 2 and "did you mean 'transforms'" in res.output


def test_recipe_is_exported_lazily():
    code = "import sys, offpolicy; print('pydantic' in sys.modules); offpolicy.Recipe; print('pydantic' in sys.modules)"
    import subprocess

    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]
    assert op.Recipe is Recipe and op.needs is needs


# -- the docs page's tables are the code's ----------------------------------------------------------------------------


def _table(text: str, header: str) -> list[list[str]]:
    lines = text[text.index(header):].splitlines()[2:]
    out = []
    for line in lines:
        if not line.startswith("|"):
            break
        out.append([cell.strip() for cell in line.strip("|").split("|")])
    return out


def test_the_recipes_page_lists_the_old_spellings_and_the_hosts_needs():
    page = (DATA.parents[2] / "docs" / "recipes.md").read_text(encoding="utf-8")
    assert _table(page, "| host | its setting |") == [[row.host, f"`{row.key}`", f"`{row.path}`"]
                                                       for row in OLD_SPELLINGS]
    supplies = _table(page, "| need | what it is |")
    assert [r[0] for r in supplies] == [f"`{n}`" for n in op.NEEDS]
    for need, _, *marks in supplies:
        assert marks == ["yes" if need.strip("`") in h.supplies else "—" for h in HOSTS.values()], need
    for name in TRANSFORMS:
        assert f"| `{name}` |" in page
