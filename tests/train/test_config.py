"""Config: one pydantic source; unknown keys / impossible combinations / missing paths fail before any work."""

from __future__ import annotations

import re

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
        (["rollout.sampler=gumbel"], "rollout.sampler"),
        (["alp.layers=middle"], "alp.layers"),
        (["algorithm.preset=alp", "alp.enabled=true", "algorithm.objective=ppo"], "algorithm.objective"),
        (["algorithm.preset=alp", "alp.enabled=true", "algorithm.level=token"], "algorithm.level"),
        (["algorithm.objective=gspo", "algorithm.level=sequence"], "algorithm.level"),
        (["algorithm.objective=reinforce", "algorithm.dual_clip=3"], "algorithm.dual_clip"),
        (["algorithm.is_level=seq"], "algorithm.is_level"),
        # DVP scores the min-p safe set alone: another truncation would make μ a different distribution
        (["algorithm.preset=dvp", "rollout.sampling.top_k=20"], "rollout.sampling.top_k"),
        (["algorithm.preset=dvp_mis", "rollout.sampling.top_p=0.9"], "top_p"),
        (["algorithm.preset=dvp", "rollout.sampling.min_p=0.05"], "min_p"),
    ],
)
def test_impossible_combinations_fail_naming_the_key(overrides, match):
    with pytest.raises(ValueError, match=match.replace(".", r"\.")):
        load_config(None, overrides)


def test_the_trainers_engine_draws_with_the_configured_sampler():
    from offpolicy.lab.settings import LAB_BASE
    from offpolicy.models.tiny import build_tiny_model
    from offpolicy.train.build import build_run_engine

    model, tok = build_tiny_model()
    assert build_run_engine(load_config(None, []), model, tok).sampler == "inverse_cdf"  # the trainer's default
    assert build_run_engine(load_config(None, ["rollout.sampler=multinomial"]), model, tok).sampler == "multinomial"
    assert "rollout.sampler=multinomial" in LAB_BASE  # the lab's recorded runs drew with torch.multinomial


def test_missing_config_file():
    with pytest.raises(ValueError, match="does not exist"):
        load_config("/no/such/run.yaml")


def test_every_preset_is_listed_and_builds():
    names = [n for n, _, _ in list_presets()]
    assert names == list(PRESETS)
    assert set(names) == {"naive", "tis", "mis", "geo_mask", "icepop", "opsm", "trm", "dvp", "dvp_mis", "alp", "m2po",
                          "ipo", "score_centering", "score_centering_topk", "score_centering_tis",
                          "score_centering_icepop", "score_centering_replay", "alp_score_centering",
                          "alp_score_centering_topk"}
    for name in names:
        ov = [f"algorithm.preset={name}"] + (["alp.enabled=true"] if name.startswith("alp") else [])
        a = load_config(None, ov).algorithm
        c = PRESETS[name].correction(a)
        assert (c is None) == (name in ("naive", "dvp", "ipo") or "score_centering" in name or name == "alp"), name
    with pytest.raises(ValueError, match=r"algorithm.preset='alp_score_centering' needs alp.enabled=true"):
        load_config(None, ["algorithm.preset=alp_score_centering"])
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


# -- overrides of string fields, YAML errors, run.device, non-finite floats, trm's two tests ---------------------


@pytest.mark.parametrize("text", ["exp #1", "2024", "no", "1e3", "a: b", "[x]", "runs/[exp1]"])
def test_string_field_overrides_keep_the_raw_text(text):
    # Expected: a str field takes the override text verbatim. YAML would cut "exp #1" to "exp" (a comment) and turn
    # 2024 / no / 1e3 / "a: b" into an int, a bool, a float, a mapping that run.out_dir then rejects.
    cfg = load_config(None, [f"run.out_dir={text}", f"task.name={text}"])
    assert cfg.run.out_dir == text and cfg.task.name == text


def test_optional_string_fields_keep_text_and_accept_null():
    # Expected: Optional[str] keeps the raw text too, and YAML's null still resets it to None.
    cfg = load_config(None, ["model.cache_dir=2024", "task.reward_fn=pkg.mod:fn #2"])
    assert cfg.model.cache_dir == "2024" and cfg.task.reward_fn == "pkg.mod:fn #2"
    assert load_config(None, ["model.cache_dir=null"]).model.cache_dir is None
    # non-string fields are still YAML: ints, floats, bools, lists, mappings
    cfg = load_config(None, ["run.seed=2024", "optim.lr=1e-3", "run.tensorboard=no", "alp.layers=[0, 1]"])
    assert (cfg.run.seed, cfg.optim.lr, cfg.run.tensorboard, cfg.alp.layers) == (2024, 1e-3, False, [0, 1])


def test_yaml_syntax_errors_are_value_errors_naming_the_file_or_the_override(tmp_path):
    # Expected: a ValueError (the CLI's clean exit 2) naming the file / the override, not a yaml.YAMLError.
    path = tmp_path / "broken.yaml"
    path.write_text("run: [1,\n")
    with pytest.raises(ValueError, match=r"config file .*broken\.yaml.* not valid YAML"):
        load_config(path)
    with pytest.raises(ValueError, match=r"override run\.steps='\[1' is not valid YAML"):
        load_config(None, ["run.steps=[1"])
    with pytest.raises(ValueError, match="is a directory"):
        load_config(tmp_path)


def test_run_device_is_checked_when_the_config_is_built(monkeypatch):
    # Expected: run.device is named at load time, not by torch's RuntimeError / AssertionError after the model has
    # loaded ("Expected one of cpu, cuda, …", "Torch not compiled with CUDA enabled").
    import torch

    assert load_config(None, ["run.device=cpu"]).run.device == "cpu"
    for bad in ("banana", "meta"):
        with pytest.raises(ValueError, match=rf"run\.device: '{bad}'"):
            load_config(None, [f"run.device={bad}"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"run\.device: 'cuda'.*CUDA is not available"):
        load_config(None, ["run.device=cuda"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"run\.device: 'cuda:3'.*1 CUDA device"):
        load_config(None, ["run.device=cuda:3"])


@pytest.mark.parametrize("override", ["optim.lr=inf", "optim.lr=.inf", "optim.lr=nan", "optim.weight_decay=inf",
                                      "rollout.sampling.temperature=inf", "algorithm.trm_max_kl=.inf",
                                      "algorithm.clip_high=inf", "rollout.logit_noise=inf"])
def test_non_finite_floats_are_rejected_naming_the_key(override):
    # Expected: every float field must be finite; optim.lr=inf passed `gt=0` and then blew up the model.
    key = re.escape(override.split("=")[0])
    with pytest.raises(ValueError, match=rf"{key}: .*finite"):
        load_config(None, [override])


def test_trm_defaults_are_explicit_and_null_turns_a_test_off():
    # Expected: the config holds the paper's two thresholds (both tests on); null means "this test off" (not trm()'s
    # own avg_kl=0.001); both off is an error.
    a = load_config(None, ["algorithm.preset=trm"]).algorithm
    assert (a.trm_max_kl, a.trm_avg_kl) == (0.05, 0.001)
    assert PRESETS["trm"].correction(a).config == {"max_kl": 0.05, "avg_kl": 0.001, "source": "total"}
    off = load_config(None, ["algorithm.preset=trm", "algorithm.trm_avg_kl=null"]).algorithm
    assert PRESETS["trm"].correction(off).config["avg_kl"] is None
    off = load_config(None, ["algorithm.preset=trm", "algorithm.trm_max_kl=null"]).algorithm
    assert PRESETS["trm"].correction(off).config == {"max_kl": None, "avg_kl": 0.001, "source": "total"}
    with pytest.raises(ValueError, match=r"algorithm\.trm_max_kl and algorithm\.trm_avg_kl are both null"):
        load_config(None, ["algorithm.preset=trm", "algorithm.trm_max_kl=null", "algorithm.trm_avg_kl=null"])
    # the description names both tests
    assert "0.05" in PRESETS["trm"].description and "0.001" in PRESETS["trm"].description
