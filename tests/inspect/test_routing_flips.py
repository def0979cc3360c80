"""Routing flips in `offpolicy inspect`: the flip rate per MoE layer and the KL of flipped vs unflipped tokens."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.inspect.routing_flips import RoutingFlips, response_flips, route_flips, routing_summary


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(1, 3), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_a_flip_is_a_different_expert_set(n, layers, k, seed):
    gen = torch.Generator().manual_seed(seed)
    experts = 6
    engine = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(n * layers)]).reshape(n, layers, k)
    trainer = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(n * layers)]).reshape(n, layers, k)
    got = route_flips([engine], [trainer])[0]
    want = [[set(engine[i, j].tolist()) != set(trainer[i, j].tolist()) for j in range(layers)] for i in range(n)]
    assert got.tolist() == want
    assert not route_flips([engine], [engine.flip(-1)])[0].any()  # the order of the k experts is no flip


def test_a_token_is_flipped_where_the_position_that_predicts_it_flipped():
    # P = 3 prompt tokens, C = 2 completion tokens: positions 0..3 forwarded; token j is predicted at position 2 + j
    flips = torch.tensor([[True, True], [False, False], [False, True], [False, False]])
    assert response_flips(flips, 3, 2).tolist() == [True, False]
    with pytest.raises(ValueError, match="P \\+ C − 1"):
        response_flips(flips, 3, 3)
    with pytest.raises(ValueError, match="must both be"):
        route_flips([torch.zeros(2, 1, 2)], [torch.zeros(3, 1, 2)])


def test_the_summary_by_hand_and_padding_never_counts():
    # two rows: row 0 has 3 response tokens (token 1 flipped), row 1 has 1 (padding at 1, 2 marked flipped: ignored)
    r = RoutingFlips(flips=[2, 1], routed=[8, 8], tokens=torch.tensor([[False, True, False], [False, True, True]]))
    mask = torch.tensor([[True, True, True], [True, False, False]])
    kl_rev = torch.tensor([[0.1, 0.9, 0.2], [0.3, 50.0, 50.0]])
    s = routing_summary(r, mask, None, kl_rev)
    assert s["flip_rate_per_layer"] == [0.25, 0.125] and s["flip_rate"] == 3 / 16
    assert (s["flipped_tokens"], s["unflipped_tokens"], s["flipped_token_share"]) == (1, 3, 0.25)
    assert s["kl_reverse_flipped_mean"] == pytest.approx(0.9)
    assert s["kl_reverse_unflipped_mean"] == pytest.approx(0.2)
    assert s["kl_reverse_ratio"] == pytest.approx(4.5)
    assert s["kl_flipped_mean"] is None and s["kl_ratio"] is None  # not measured: None, never a made-up number


def _small_moe():
    from offpolicy.models import get_recipe
    from offpolicy.models.tiny import build_tiny_model

    recipe = get_recipe("lab-moe")
    config = {**recipe.config, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "moe_intermediate_size": 16}
    return build_tiny_model(0, architecture=recipe.architecture, **config)


def test_the_flips_agree_with_routing_replays_own_count():
    # the engine's recorded routes replayed in "compare" mode around the trainer's forward count the same flips as
    # inspect's per-position comparison of both sides' records
    from offpolicy.inspect.specs import build_inspect_engine as build_engine
    from offpolicy.rollout.routing import RouteRecorder, replay_routes
    from offpolicy.rollout.sampling import SamplingConfig
    from offpolicy.rollout.scoring import score_tokens
    from offpolicy.rollout.spec import EngineSpec

    model, tok = _small_moe()
    engine = build_engine(model, EngineSpec(name="bf16", dtype="bfloat16", record_routes=True), tok)
    prompts = [tok(p)["input_ids"] for p in ("1234>", "98>", "5>")]
    sampling = SamplingConfig(max_new_tokens=12)
    out = engine.generate(prompts, sampling, seed=0)
    lengths = [len(p) + len(c) - 1 for p, c in zip(prompts, out.completion_ids)]
    with torch.no_grad(), RouteRecorder(model, batch_size=3) as rec, \
            replay_routes(model, out.routed_experts, mode="compare") as replay:
        score_tokens(model, prompts, out.completion_ids, sampling)
    per_row = route_flips(out.routed_experts, rec.pop_rows(lengths))
    flips = RoutingFlips.from_rows(per_row, [len(p) for p in prompts], [len(c) for c in out.completion_ids], 12)
    assert sum(flips.flips) == replay.flips and sum(flips.routed) == replay.routed
    assert flips.routed == [sum(lengths)] * 2


@pytest.mark.parametrize("rollout, flipless", [("bf16", False), ("fp32,kv_cache=false", True)])
def test_compare_engines_reports_the_flips_of_an_moe_model(rollout, flipless):
    from offpolicy.inspect.compare import compare_engines
    from offpolicy.inspect.specs import parse_spec
    from offpolicy.inspect.summary import summarize
    from offpolicy.rollout.sampling import SamplingConfig

    model, tok = _small_moe()
    prompts = [tok(p)["input_ids"] for p in ("1234>", "98>", "5>", "777>")]
    measured = compare_engines(model, prompts, parse_spec(rollout, "rollout"), parse_spec("fp32", "trainer"),
                               SamplingConfig(max_new_tokens=10), tokenizer=tok, dvp_rhos=None)
    s = summarize(measured)["routing"]
    assert s["layers"] == 2 and len(s["flip_rate_per_layer"]) == 2
    assert s["flipped_tokens"] + s["unflipped_tokens"] == summarize(measured)["positions"]
    assert all(0.0 <= r <= 1.0 for r in s["flip_rate_per_layer"])
    if flipless:  # an fp32 engine without a KV cache routes exactly as the trainer's forward
        assert s["flip_rate"] == 0.0 and s["flipped_tokens"] == 0 and s["kl_reverse_flipped_mean"] is None


def test_a_dense_model_has_no_routing_block():
    from offpolicy.inspect.compare import compare_engines
    from offpolicy.inspect.specs import parse_spec
    from offpolicy.inspect.summary import summarize
    from offpolicy.models.tiny import build_tiny_model
    from offpolicy.rollout.sampling import SamplingConfig

    model, tok = build_tiny_model(0, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                  num_attention_heads=2, num_key_value_heads=1)
    measured = compare_engines(model, [tok("12>")["input_ids"]], parse_spec("bf16", "rollout"),
                               parse_spec("fp32", "trainer"), SamplingConfig(max_new_tokens=4), tokenizer=tok,
                               dvp_rhos=None)
    assert measured.routing is None and summarize(measured)["routing"] is None


def test_inspect_lab_moe_reports_flips_beside_the_dense_lab_model(tmp_path):
    from typer.testing import CliRunner

    from offpolicy.cli import app

    res = CliRunner().invoke(app, ["inspect", "--model", "lab-moe", "--rollout", "bf16", "--task", "pattern",
                                   "--prompts", "4", "--max-new-tokens", "8", "--no-layers", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "report.json").read_text())
    routing, beside = summary["routing"], summary["beside"]
    assert routing["layers"] == 4 and routing["routed_slots"] > 0
    assert beside["model"] == "lab" and beside["kl_mean"] > 0
    assert beside["kl_mean_ratio"] == pytest.approx(summary["kl_mean"] / beside["kl_mean"])
    assert "routing flips (MoE)" in res.output and "beside lab" in res.output
    assert "Routing flips (mixture of experts)" in (tmp_path / "report.html").read_text()


def test_routes_are_recorded_only_where_flips_can_be_counted():
    from offpolicy.inspect.routing_flips import recording_routes
    from offpolicy.inspect.specs import EngineSpec
    from offpolicy.models.tiny import build_tiny_model
    from offpolicy.rollout.routing import is_moe

    moe, _ = _small_moe()
    dense, _ = build_tiny_model(0, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                num_attention_heads=2, num_key_value_heads=1)
    assert is_moe(moe) and not is_moe(dense)
    spec = EngineSpec(name="bf16", dtype="bfloat16")
    assert recording_routes(moe, spec).record_routes and not recording_routes(dense, spec).record_routes
    assert not recording_routes(moe, EngineSpec(name="c", dtype="bfloat16", compile=True)).record_routes
    assert not recording_routes(moe, EngineSpec(name="v", backend="vllm", dtype="bfloat16")).record_routes
