"""The embedded mixture-of-experts lab model (lab-moe): its recipe, a deterministic build, loading by name, and a few
trainer steps that log the routing flips."""

from __future__ import annotations

import hashlib
import importlib
import math

import pytest

from offpolicy.models import RECIPES, get_recipe, model_dir

cache = importlib.import_module("offpolicy.models.cache")
ws = importlib.import_module("offpolicy.models.warm_start")

# the lab-moe architecture at a size that builds in a second (the recipe's routing, fewer and narrower layers)
SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
         "moe_intermediate_size": 16}


def test_lab_moe_is_a_qwen3_moe_of_the_lab_models_size():
    from offpolicy.models.tiny import build_tiny_model

    recipe = get_recipe("lab-moe")
    model, tok = build_tiny_model(0, architecture=recipe.architecture, **recipe.config)
    dense, _ = build_tiny_model(0, **get_recipe("lab").config)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.tie_word_embeddings
    assert (model.config.num_experts, model.config.num_experts_per_tok, model.config.vocab_size) == (8, 2, len(tok))
    n_moe, n_dense = (sum(p.numel() for p in m.parameters()) for m in (model, dense))
    assert abs(n_moe / n_dense - 1) < 0.01  # 8 experts × 128 = the dense MLP's 1024
    from offpolicy.rollout.routing import find_routers

    assert len(find_routers(model)) == 4  # one router per layer: routing replay handles the architecture


def test_the_moe_recipe_leaves_the_dense_models_hashes_alone():
    # the architecture joins the hashed description only where it is not the default, so the shipped dense folders
    # keep their names
    assert model_dir("lab", "/").name == "lab-f8eab39f9ce5"
    assert "architecture" not in cache._description(get_recipe("lab"))
    assert cache._description(get_recipe("lab-moe"))["architecture"] == "qwen3_moe"
    assert model_dir("lab-moe", "/").name != model_dir("lab", "/").name


def test_an_unknown_architecture_is_refused_by_name():
    from offpolicy.models.tiny import build_tiny_model

    with pytest.raises(ValueError, match="architecture must be one of"):
        build_tiny_model(0, architecture="mamba")


def _digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_a_moe_build_is_deterministic_whatever_the_callers_thread_count(tmp_path):
    # the warm start runs at WARM_START_THREADS whatever the caller set: two builds, one from a 1-thread and one from
    # a 2-thread caller, write the same weights
    recipe = get_recipe("lab-moe").with_overrides(SMALL, steps=3, batch_size=4, calibration_steps=1)
    digests = []
    for threads in (1, 2):
        out = tmp_path / str(threads)
        out.mkdir()
        monkey = pytest.MonkeyPatch()
        monkey.setattr(cache, "evaluate_reward", lambda *a, **k: {"reward": 0.0, "accuracy": 0.0})
        try:
            with ws.torch_threads(threads):
                cache.build_model(recipe, out)
        finally:
            monkey.undo()
        digests.append(_digest(out))
    assert digests[0] == digests[1]
    assert model_dir(recipe, tmp_path) == model_dir(recipe, tmp_path)  # the same hash for the same recipe
    # and the build is a real warm start: other steps give other weights
    other = tmp_path / "other"
    other.mkdir()
    monkey = pytest.MonkeyPatch()
    monkey.setattr(cache, "evaluate_reward", lambda *a, **k: {"reward": 0.0, "accuracy": 0.0})
    try:
        cache.build_model(recipe.with_overrides(steps=4), other)
    finally:
        monkey.undo()
    assert _digest(other) != digests[0]


def test_lab_moe_is_a_name_wherever_lab_is():
    from offpolicy.inspect.run import EMBEDDED
    from offpolicy.train.config import EMBEDDED_MODELS

    assert tuple(RECIPES) == EMBEDDED == tuple(n for n in EMBEDDED_MODELS if n != "tiny-random")


def test_the_shipped_lab_moe_loads_as_qwen3_moe():
    model, tok = cache.load_model("lab-moe")
    info = cache.tiny_model_info(cache.shipped_dir("lab-moe"))
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert 0.0 < info["stats"]["reward"] < 1.0  # calibrated like the dense lab model: a reward RL can raise


@pytest.mark.parametrize("dtype, flips", [("bfloat16", None), ("float32", 0.0)])
def test_lab_moe_trains_with_the_flip_rate_logged(dtype, flips, tmp_path):
    from offpolicy.train.config import load_config
    from offpolicy.train.loop import train

    cfg = load_config(None, [
        "model.path=lab-moe", "task.name=pattern", "task.options={length: 6}", "task.prompts_per_step=2",
        "algorithm.group_size=2", "rollout.sampling.max_new_tokens=6", "run.steps=2", f"run.out_dir={tmp_path}",
        "run.progress=false", "run.tensorboard=false", "run.threads=1", f"rollout.dtype={dtype}",
        "rollout.kv_cache=false",
    ])
    history = train(cfg).history
    for row in history:
        assert math.isfinite(row["loss/loss"])
        assert 0.0 <= row["routing/flip_rate"] <= 1.0
        # one rate per MoE layer (lab-moe: 4), each a share of the same routed slots: the overall rate is their mean
        per_layer = [row[f"routing/flip_rate/layer{i}"] for i in range(4)]
        assert "routing/flip_rate/layer4" not in row
        assert all(math.isfinite(r) and 0.0 <= r <= 1.0 for r in per_layer)
        assert row["routing/flip_rate"] == pytest.approx(sum(per_layer) / 4, rel=1e-12)
        if flips is not None:  # an fp32 engine without a KV cache routes as the trainer's forward does
            assert row["routing/flip_rate"] == flips and per_layer == [flips] * 4
            assert row["rollout_correction/k3_kl"] < 1e-9


def test_lab_moe_trains_with_r3_routing_replay(tmp_path):
    from offpolicy.train.config import load_config
    from offpolicy.train.loop import train

    cfg = load_config(None, [
        "model.path=lab-moe", "task.name=pattern", "task.options={length: 6}", "task.prompts_per_step=2",
        "algorithm.group_size=2", "rollout.sampling.max_new_tokens=6", "run.steps=1", f"run.out_dir={tmp_path}",
        "run.progress=false", "run.tensorboard=false", "run.threads=1", "rollout.dtype=bfloat16",
        "rollout.routing_replay=r3",
    ])
    row = train(cfg).history[0]
    assert 0.0 <= row["routing/flip_rate"] <= 1.0 and math.isfinite(row["loss/loss"])


@pytest.mark.parametrize("overrides, warned", [(["rollout.engine=vllm"], "rollout.engine=vllm"),
                                               (["rollout.compile=true"], "rollout.engine=hf (compiled)"),
                                               ([], None)])
def test_an_engine_without_routes_says_the_flip_rate_is_not_logged(monkeypatch, overrides, warned):
    """vLLM (and any engine that records no routes) gives the trainer nothing to count flips against: one warning
    says routing/flip_rate is not logged; the transformers engine records its routes and warns nothing."""
    import warnings

    from offpolicy.train import build
    from offpolicy.train.config import load_config

    built = []
    monkeypatch.setattr(build, "build_engine", lambda spec, **kw: built.append(spec) or spec)  # nothing started
    model, tok = cache.load_model("lab-moe")
    cfg = load_config(None, ["model.path=lab-moe", *overrides])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build.build_run_engine(cfg, model, tok)
    notes = [str(w.message) for w in caught if "routing/flip_rate" in str(w.message)]
    if warned is None:
        assert notes == [] and built[0].record_routes
    else:
        assert len(notes) == 1 and f"the engine {warned} records no routes" in notes[0], notes
        assert not built[0].record_routes
    dense, dense_tok = cache.load_model("tiny")  # a dense model: no routes to speak of, no warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build.build_run_engine(cfg, dense, dense_tok)
    assert not [w for w in caught if "routing/flip_rate" in str(w.message)]
