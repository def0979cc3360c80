"""Config: one pydantic source; unknown keys / impossible combinations / missing paths fail before any work."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.train.config import TrainConfig, config_to_yaml, load_config
from offpolicy.train.presets import PRESETS, list_presets


def test_defaults_validate_and_round_trip_through_yaml(tmp_path):
    cfg = load_config()
    assert cfg.model.path == "tiny" and cfg.rollout.dtype == "bfloat16" and cfg.rollout.kv_cache
    path = tmp_path / "run.yaml"
    path.write_text(config_to_yaml(cfg))
    assert load_config(path) == cfg


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("algorithm:\n  preset: icepop\n  group_size: 8\nrun:\n  steps: 7\n")
    cfg = load_config(path, ["run.steps=3", "alp.layers=[0, 1]", "algorithm.is_upper=1e-4", "rollout.kv_cache=false"])
    assert (cfg.algorithm.preset, cfg.algorithm.group_size, cfg.run.steps) == ("icepop", 8, 3)
    assert cfg.alp.layers == [0, 1] and cfg.algorithm.is_upper == 1e-4 and cfg.rollout.kv_cache is False


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["algorithm.bogus=1"], "algorithm.bogus"),
        (["nosuch.key=1"], "nosuch.key"),
        (["rollout.sampling.topp=0.9"], "rollout.sampling.topp"),
        (["run=3"], "run"),
        (["run.steps.x=3"], "run.steps.x"),
    ],
)
def test_unknown_key_is_named(overrides, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_unknown_key_in_yaml_is_named(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ValueError, match=r"optim\.learning_rate"):
        load_config(path)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["algorithm.preset=alp"], "alp.enabled"),
        (["alp.enabled=true"], "alp.enabled"),
        (["algorithm.advantage=rloo", "algorithm.group_size=1"], "group_size"),
        (["algorithm.group_size=1"], "group_size"),
        (["model.path=/definitely/not/here"], "model.path"),
        (["model.path= "], "model.path"),
        (["algorithm.preset=nope"], "algorithm.preset"),
        (["optim.lr=-1"], "optim.lr"),
        (["optim.minibatches=100"], "optim.minibatches"),
        (["algorithm.is_lower=3", "algorithm.is_upper=2"], "is_lower"),
        (["rollout.sampling.temperature=0"], "temperature"),
        (["alp.layers=middle"], "alp.layers"),
        (["algorithm.preset=alp", "alp.enabled=true", "algorithm.objective=ppo"], "algorithm.objective"),
        (["algorithm.preset=alp", "alp.enabled=true", "algorithm.level=token"], "algorithm.level"),
        (["algorithm.objective=gspo", "algorithm.level=sequence"], "algorithm.level"),
        (["algorithm.objective=reinforce", "algorithm.dual_clip=3"], "algorithm.dual_clip"),
        (["algorithm.is_level=seq"], "algorithm.is_level"),
    ],
)
def test_impossible_combinations_fail_naming_the_key(overrides, match):
    with pytest.raises(ValueError, match=match.replace(".", r"\.")):
        load_config(None, overrides)


def test_missing_config_file():
    with pytest.raises(ValueError, match="does not exist"):
        load_config("/no/such/run.yaml")


def test_every_preset_is_listed_and_builds():
    names = [n for n, _, _ in list_presets()]
    assert names == list(PRESETS)
    assert set(names) == {"naive", "tis", "mis", "geo_mask", "icepop", "opsm", "trm", "dvp", "dvp_mis", "alp"}
    for name in names:
        ov = [f"algorithm.preset={name}"] + (["alp.enabled=true"] if name == "alp" else [])
        a = load_config(None, ov).algorithm
        c = PRESETS[name].correction(a)
        assert (c is None) == (name in ("naive", "dvp", "alp")), name
    veto = PRESETS["naive"].correction(load_config(None, ["algorithm.veto_threshold=1e-4"]).algorithm)
    assert veto is not None and veto.name == "veto"


@settings(max_examples=25, deadline=None)
@given(steps=st.integers(1, 10_000), lr=st.floats(1e-8, 1.0), temp=st.floats(0.05, 5.0))
def test_property_override_values_round_trip(steps, lr, temp):
    cfg = load_config(None, [f"run.steps={steps}", f"optim.lr={lr!r}", f"rollout.sampling.temperature={temp!r}"])
    assert cfg.run.steps == steps and cfg.optim.lr == lr and cfg.rollout.sampling.temperature == temp
    assert TrainConfig.model_validate(cfg.model_dump()) == cfg


@pytest.mark.parametrize("name", ["tiny_mis", "tiny_alp", "tiny_trm_int8kv", "local_model_dvp_mis"])
def test_example_configs_validate(name, tmp_path):
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / f"{name}.yaml"
    if name.startswith("local"):
        with pytest.raises(ValueError, match="model.path"):  # the placeholder path must be replaced
            load_config(path)
        cfg = load_config(path, [f"model.path={tmp_path}"])
    else:
        cfg = load_config(path)
    assert cfg.run.steps > 0
