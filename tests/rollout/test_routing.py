"""Routing replay: record and replay MoE routes (engine → trainer, π_old → π_θ), gate weights, flip rate, errors."""

import math

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    OlmoeConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from offpolicy.rollout.hf import HFRolloutEngine
from offpolicy.rollout.routing import RouteRecorder, find_routers, replay_routes, split_routes
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.scoring import sequence_logprobs

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, eos_token_id=None, pad_token_id=0)
FAMILIES = {
    "qwen2_moe": lambda: Qwen2MoeConfig(**COMMON, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                        num_experts=8, num_experts_per_tok=2),
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                                        head_dim=8, norm_topk_prob=True),
    "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2),
    "olmoe": lambda: OlmoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2),
}
PROMPTS = [[1, 5, 9, 13, 17], [2, 6], [3, 7, 11]]


def build(family: str, seed: int = 0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()


@pytest.fixture(params=sorted(FAMILIES))
def moe(request):
    return build(request.param)


# ---------------------------------------------------------------------------------------------------------------------
# Gate weights by hand
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family, renormalises", [("qwen2_moe", False), ("qwen3_moe", True), ("mixtral", True)])
def test_replayed_gate_weights_are_the_routers_own_softmax_at_the_replayed_experts(family, renormalises):
    model = build(family)
    router = find_routers(model)[0]
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:4, 0] = torch.tensor([2.0, 1.0, 0.0, -1.0])  # logits (2, 1, 0, −1, 0, 0, 0, 0) for h = e_0
    h = torch.zeros(1, 32)
    h[0, 0] = 1.0
    # softmax: Z = e² + e + 1 + e⁻¹ + 4·e⁰ = 7.389 + 2.718 + 1 + 0.368 + 4 = 15.475
    # native top-2 = experts (0, 1); replayed (2, 3): p = (1/Z, e⁻¹/Z) = (0.06462, 0.02377)
    # renormalised (Qwen3-MoE with norm_topk_prob, Mixtral always): (1, e⁻¹)/(1 + e⁻¹) = (0.7311, 0.2689)
    z = math.exp(2) + math.exp(1) + 1 + math.exp(-1) + 4
    expected = [1 / (1 + math.exp(-1)), math.exp(-1) / (1 + math.exp(-1))] if renormalises else [1 / z, math.exp(-1) / z]
    routes = [torch.tensor([[[2, 3], [2, 3]]])]  # one row, one position, both layers → experts (2, 3)
    with replay_routes(model, routes) as replay:
        _, weights, experts = router(h)  # layer 0's router alone: one token of the one row
    assert experts.tolist() == [[2, 3]]
    assert weights[0].tolist() == pytest.approx(expected, rel=1e-5)
    assert (replay.flips, replay.routed) == (1, 1)  # native (0, 1) ≠ replayed (2, 3)
    with replay_routes(model, routes, mode="compare") as compare:
        _, weights, experts = router(h)
    assert experts.tolist() == [[0, 1]] and compare.flip_rate == 1.0  # compare: native routing, flips counted


# ---------------------------------------------------------------------------------------------------------------------
# Record → replay: exactness and alignment
# ---------------------------------------------------------------------------------------------------------------------


def _right_padded(rows):
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
    return ids, attn


def test_replaying_the_native_routes_changes_nothing(moe):
    ids, attn = _right_padded(PROMPTS)
    with torch.no_grad(), RouteRecorder(moe, batch_size=3) as rec:
        native = moe(input_ids=ids, attention_mask=attn).logits
    routes = rec.pop_rows([len(p) for p in PROMPTS])
    assert [tuple(r.shape) for r in routes] == [(5, 2, 2), (2, 2, 2), (3, 2, 2)]
    assert routes[0].dtype == torch.int16 and int(routes[0].max()) < 8
    with torch.no_grad(), replay_routes(moe, routes) as replay:
        replayed = moe(input_ids=ids, attention_mask=attn).logits
    assert torch.equal(native, replayed)
    assert (replay.flips, replay.routed) == (0, 10 * 2)  # 10 recorded positions × 2 layers


def test_replay_routes_each_row_as_recorded_and_the_rest_natively(moe):
    ids, attn = _right_padded(PROMPTS)
    with torch.no_grad(), RouteRecorder(moe, batch_size=3) as rec:
        moe(input_ids=ids, attention_mask=attn)
    native = rec.pop()
    # other experts for row 0's first 3 positions (e → (e + 3) mod 8 keeps the pair distinct), row 1 not given
    forced = [(native[0, :3].long() + 3) % 8, None, native[2, :3]]
    with torch.no_grad(), replay_routes(moe, forced) as replay, RouteRecorder(moe, batch_size=3) as seen:
        moe(input_ids=ids, attention_mask=attn)  # the recorder's hooks run after replay's: they see the result
    used = seen.pop()
    assert torch.equal(used[0, :3].long(), forced[0])
    assert torch.equal(used[2, :3], native[2, :3])
    # beyond the given positions and in the row without routes the model routes natively — but only where the
    # replayed positions cannot reach (position 3+ of row 0 attend to the forced ones, so they may move)
    assert torch.equal(used[1], native[1])
    assert replay.flips == 3 * 2 and replay.routed == 6 * 2


@pytest.mark.parametrize("kv_cache", [True, False], ids=["kv-cache", "full-forward"])
def test_fp32_engine_routes_replayed_give_the_engines_logprobs(moe, kv_cache):
    engine = HFRolloutEngine(moe, dtype="float32", kv_cache=kv_cache, record_routes=True, pad_token_id=0)
    cfg = SamplingConfig(max_new_tokens=6, temperature=1.0)
    first = engine.generate(PROMPTS, cfg, seed=3)
    # an eos that row 0 samples at step 3: the rows then end at different lengths (ragged routes)
    engine.eos_token_id = first.completion_ids[0][2]
    out = engine.generate(PROMPTS, cfg, seed=3)
    lengths = [len(c) for c in out.completion_ids]
    assert lengths[0] == 3
    assert [tuple(r.shape) for r in out.routed_experts] == [(len(p) + n - 1, 2, 2) for p, n in zip(PROMPTS, lengths)]

    with torch.no_grad():
        native, mask = sequence_logprobs(moe, PROMPTS, out.completion_ids, cfg)
        replayed, _ = sequence_logprobs(moe, PROMPTS, out.completion_ids, cfg, routes=out.routed_experts)
    torch.testing.assert_close(replayed[mask], out.logp[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(native[mask], out.logp[mask], rtol=0, atol=1e-5)  # fp32 both sides: no flips

    # the positions line up: routes shifted by one position are other routes, and the log-probs move
    shifted = [torch.roll(r, 1, dims=0) for r in out.routed_experts]
    with torch.no_grad(), replay_routes(moe, shifted) as replay:
        moved, _ = sequence_logprobs(moe, PROMPTS, out.completion_ids, cfg)
    assert replay.flip_rate > 0.3
    assert (moved[mask] - out.logp[mask]).abs().max() > 1e-3


def test_engine_routes_are_the_trainers_native_routes_in_fp32(moe):
    engine = HFRolloutEngine(moe, dtype="float32", record_routes=True, pad_token_id=0)
    out = engine.generate(PROMPTS, SamplingConfig(max_new_tokens=5), seed=0)
    with torch.no_grad(), replay_routes(moe, out.routed_experts, mode="compare") as compare:
        sequence_logprobs(moe, PROMPTS, out.completion_ids)
    assert compare.routed == sum(len(p) + len(c) - 1 for p, c in zip(PROMPTS, out.completion_ids)) * 2
    assert compare.flip_rate == 0.0


def test_the_per_layer_flip_counts_are_inspects_route_flips_of_the_same_routes():
    """replay_routes counts flips per MoE layer in its hooks; offpolicy inspect counts them from both sides' recorded
    routes (route_flips): on the same routes the counts agree layer by layer, and the metrics are their ratios."""
    from offpolicy.inspect.routing_flips import RoutingFlips, route_flips
    from offpolicy.rollout.routing import flip_rate_metrics, flip_rates

    model = build("qwen3_moe")
    completions = [[20, 21, 22], [23], [24, 25]]
    lengths = [len(p) + len(c) - 1 for p, c in zip(PROMPTS, completions)]
    with torch.no_grad(), RouteRecorder(model, batch_size=3) as rec:
        sequence_logprobs(model, PROMPTS, completions)
    recorded = rec.pop_rows(lengths)
    with torch.no_grad():  # other numerics on one side: routers moved enough to flip some routes, unevenly by layer
        for i, router in enumerate(find_routers(model)):
            router.weight.add_((0.05 * (i + 1)) * torch.randn_like(router.weight))
    with torch.no_grad(), replay_routes(model, recorded, mode="compare") as compare, \
            RouteRecorder(model, batch_size=3) as now:
        sequence_logprobs(model, PROMPTS, completions)
    theirs = RoutingFlips.from_rows(route_flips(recorded, now.pop_rows(lengths)), [len(p) for p in PROMPTS],
                                    [len(c) for c in completions], width=3)
    assert compare.flips_per_layer == theirs.flips and compare.routed_per_layer == theirs.routed == [sum(lengths)] * 2
    assert sum(compare.flips_per_layer) > 0 and compare.flips == sum(theirs.flips)
    metrics = flip_rate_metrics(compare.flips_per_layer, compare.routed_per_layer)
    assert sorted(metrics) == ["routing/flip_rate", "routing/flip_rate/layer0", "routing/flip_rate/layer1"]
    assert [metrics[f"routing/flip_rate/layer{i}"] for i in range(2)] == [f / sum(lengths) for f in theirs.flips]
    assert metrics["routing/flip_rate"] == compare.flip_rate == sum(theirs.flips) / (2 * sum(lengths))
    # by hand: 1 of 4 and 3 of 4 slots is 4 of 8 overall; a layer that routed nothing has rate 0, not NaN
    assert flip_rates([1, 3], [4, 4]) == ([0.25, 0.75], 0.5) and flip_rates([0, 2], [0, 4]) == ([0.0, 0.5], 0.5)
    assert flip_rates([], []) == ([], 0.0)
    with pytest.raises(ValueError, match="one count per MoE layer"):
        flip_rates([1], [4, 4])


def test_r2_pi_theta_replays_pi_old_routes_after_an_update():
    model = build("qwen2_moe")
    completions = [[20, 21, 22], [23], [24, 25]]
    lengths = [len(p) + len(c) - 1 for p, c in zip(PROMPTS, completions)]
    with torch.no_grad(), RouteRecorder(model, batch_size=3) as rec:
        old, mask = sequence_logprobs(model, PROMPTS, completions)
    old_routes = rec.pop_rows(lengths)
    with torch.no_grad():  # an "update" that moves the routers enough to flip some routes
        for router in find_routers(model):
            router.weight.add_(0.05 * torch.randn_like(router.weight))
    with torch.no_grad(), replay_routes(model, old_routes, mode="compare") as drift:
        sequence_logprobs(model, PROMPTS, completions)
    assert drift.flip_rate > 0  # without R2, π_θ routes differently from π_old
    with replay_routes(model, old_routes) as r2, RouteRecorder(model, batch_size=3) as seen:
        logp, _ = sequence_logprobs(model, PROMPTS, completions)
    used = seen.pop_rows(lengths)
    assert all(torch.equal(u, o) for u, o in zip(used, old_routes))  # π_θ used π_old's experts
    assert r2.flip_rate == drift.flip_rate
    # the gate weights still come from π_θ's router logits: the router gets a gradient
    logp[mask].sum().backward()
    grads = [r.weight.grad for r in find_routers(model)]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


# ---------------------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------------------


def test_dense_model_is_refused_by_name():
    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(Qwen2Config(**COMMON))
    with pytest.raises(ValueError, match="Qwen2ForCausalLM has no mixture-of-experts router"):
        find_routers(dense)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        HFRolloutEngine(dense, record_routes=True)


def test_bad_routes_are_refused(moe):
    with pytest.raises(ValueError, match=r"routes\[0\] must be \[n, L=2, k=2\]"):
        replay_routes(moe, [torch.zeros(3, 2, 3, dtype=torch.long)])
    with pytest.raises(ValueError, match="integer expert ids"):
        replay_routes(moe, [torch.zeros(3, 2, 2)])
    with pytest.raises(ValueError, match="non-empty list"):
        replay_routes(moe, [])
    with pytest.raises(ValueError, match="mode"):
        replay_routes(moe, [None], mode="r3")
    ids, attn = _right_padded(PROMPTS)
    with pytest.raises(ValueError, match="not a multiple of the 2 rows"):
        with torch.no_grad(), replay_routes(moe, [None, None]):
            moe(input_ids=ids, attention_mask=attn)
    with pytest.raises(ValueError, match="batch_size"):
        RouteRecorder(moe, batch_size=0)


def test_a_router_with_another_gate_is_refused_by_name():
    model = build("qwen2_moe")
    router = find_routers(model)[0]
    native_forward = router.forward

    def sigmoid_gate(hidden):  # e.g. DeepSeek-V3-style sigmoid scores: not what replay recomputes
        logits, _, experts = native_forward(hidden)
        return logits, torch.sigmoid(logits).gather(-1, experts), experts

    router.forward = sigmoid_gate
    with pytest.raises(ValueError, match="Qwen2MoeTopKRouter"):
        with torch.no_grad(), replay_routes(model, [None]):
            model(input_ids=torch.tensor([[1, 2, 3]]))


def test_split_routes_and_output_validation():
    routes = torch.arange(12).reshape(2, 3, 2, 1)
    attention = torch.tensor([[False, True, True], [True, True, False]])
    rows = split_routes(routes, attention, [2, 1])
    assert rows[0][:, 0, 0].tolist() == [2, 4] and rows[1][:, 0, 0].tolist() == [6]
    with pytest.raises(ValueError, match="row 1 has 2 recorded positions"):
        split_routes(routes, attention, [2, 3])
    from offpolicy.rollout.base import RolloutOutput

    with pytest.raises(ValueError, match="routed_experts has 1 rows"):
        RolloutOutput([[1], [2]], [[3], [4]], torch.zeros(2, 1), torch.ones(2, 1, dtype=torch.bool),
                      routed_experts=[torch.zeros(1, 2, 2)])


# ---------------------------------------------------------------------------------------------------------------------
# The gate check's tolerance: from the dtype and the number of experts, not a fixed 1e-5
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gate_check_holds_within_its_tolerance_at_one_and_two_threads_and_catches_another_gate(threads, dtype):
    from offpolicy.rollout.routing import _gate_renormalises, _gate_weights, gate_tolerance

    cfg = Qwen3MoeConfig(**{**COMMON, "hidden_size": 256}, moe_intermediate_size=16, num_experts=128,
                         num_experts_per_tok=8, head_dim=8, norm_topk_prob=True)  # Qwen3-MoE's 128 experts, top 8
    torch.manual_seed(0)
    router = find_routers(AutoModelForCausalLM.from_config(cfg).eval())[0].to(dtype)
    with torch.no_grad():
        router.weight.mul_(40.0)  # router logits up to |z| ≈ 20, as trained routers reach
    h = torch.randn(512, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)  # the native softmax's summation order
    try:
        with torch.no_grad():
            logits, weights, experts = router(h)
    finally:
        torch.set_num_threads(before)
    tol = gate_tolerance(logits, weights)
    # another kernel's gate: the softmax in float64 (another rounding than the replay's float32), cast alike
    probs = torch.softmax(logits.double(), dim=-1).gather(-1, experts)
    other = (probs / probs.sum(-1, keepdim=True)).to(dtype)
    gap = float((_gate_weights(logits, experts, True).to(dtype).float() - other.float()).abs().max())
    # measured (both thread counts, |z| ≤ 52): float32 gap 1.2e-7 of a 1.7e-4 tolerance; bfloat16 gap 0 of 8.0e-3
    assert gap <= 0.6 * tol, (gap, tol)
    assert _gate_renormalises(router, logits, other, experts) is True
    assert _gate_renormalises(router, logits, weights, experts) is True
    # another gate (weights off by 2 % — a temperature, a bias): refused, saying by how much and what to do
    with pytest.raises(ValueError, match=r"off by .* past the .* that rounding allows for torch\.(float32|bfloat16) "
                                         r"weights over 128 experts.*rollout\.routing_replay=none"):
        _gate_renormalises(router, logits, weights * 1.02 if dtype == torch.float32 else weights * 1.1, experts)
