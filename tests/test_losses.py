"""policy_loss: hand-computed numbers for every objective and aggregation, plus property tests."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import Correction, CorrectionResult
from offpolicy.losses import policy_loss
from offpolicy.registry import AGGREGATIONS, OBJECTIVES

LN = math.log

# What each built-in objective reads besides π_θ and A (without a correction), and its per-token loss at r = 1,
# A = 1, log π_θ = −1: the clipped surrogate −r·A = −1; reinforce −A·log π = 1; cispo −sg[r]·A·log π = 1;
# sapo −(4/τ_pos)·σ(0)·A = −2 (τ_pos = 1); dppo −A·sg[r]·log π·1[inside] = 1 (p = p_old is inside).
READS = {"ppo": {"old_logp"}, "gspo": {"old_logp"}, "decoupled": {"old_logp", "rollout_logp"}, "bypass": {"rollout_logp"},
         "reinforce": set(), "cispo": {"old_logp"}, "sapo": {"old_logp"}, "dppo_tv": {"old_logp"}, "dppo_kl": {"old_logp"}}
AT_RATIO_ONE = {"ppo": -1.0, "gspo": -1.0, "decoupled": -1.0, "bypass": -1.0, "reinforce": 1.0, "cispo": 1.0,
                "sapo": -2.0, "dppo_tv": 1.0, "dppo_kl": 1.0}


def takes(objective: str, parameter: str) -> bool:
    return parameter in OBJECTIVES[objective].parameters()


def test_every_builtin_objective_is_described_here():
    assert set(READS) <= set(OBJECTIVES.names())
    for name, reads in READS.items():
        assert set(OBJECTIVES[name].inputs_read(False)) == reads, name


def leaf(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def grad_of(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, x)
    return g


def batch_with_ratios(ratios, adv, **kw) -> tuple[LogProbBatch, torch.Tensor]:
    """logp = -1 everywhere, old_logp chosen so that π/π_old = ratios exactly."""
    logp = leaf([[-1.0] * len(ratios)])
    old = torch.tensor([[-1.0 - LN(r) for r in ratios]])
    return LogProbBatch(logp=logp, mask=torch.ones(1, len(ratios)), old_logp=old, advantages=torch.tensor([adv]), **kw), logp


# ---------------------------------------------------------------------------------------------------------------------
# PPO
# ---------------------------------------------------------------------------------------------------------------------


def test_ppo_clip_hand_computed():
    b, logp = batch_with_ratios([1.0, 1.5, 0.5, 0.9], [1.0, 1.0, -1.0, -1.0])
    loss, m = policy_loss(b, clip_low=0.2)
    # t0: r=1,   A=+1: -min(1, 1)        = -1
    # t1: r=1.5, A=+1: -min(1.5, 1.2)    = -1.2   (upper clip active)
    # t2: r=0.5, A=-1: -min(-0.5, -0.8)  = +0.8   (lower clip active)
    # t3: r=0.9, A=-1: -min(-0.9, -0.9)  = +0.9
    # token mean = (-1 - 1.2 + 0.8 + 0.9) / 4 = -0.125
    assert loss.item() == pytest.approx(-0.125, abs=1e-6)
    assert m["loss/clipfrac_low"].item() == pytest.approx(0.25)
    assert m["loss/clipfrac_high"].item() == pytest.approx(0.25)
    assert m["loss/ratio_max"].item() == pytest.approx(1.5, rel=1e-6)
    assert m["loss/ratio_min"].item() == pytest.approx(0.5, rel=1e-6)
    assert m["loss/ratio_mean"].item() == pytest.approx((1 + 1.5 + 0.5 + 0.9) / 4, rel=1e-6)
    # d/dlogp of -A r = -A r (dr/dlogp = r), /4 for the mean; clipped tokens have no gradient:
    # t0: -1·1/4 = -0.25, t1: 0, t2: 0, t3: +1·0.9/4 = 0.225
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[-0.25, 0.0, 0.0, 0.225]]))


def test_ppo_clip_higher_asymmetric():
    b, _ = batch_with_ratios([1.0, 1.5, 0.5, 0.9], [1.0, 1.0, -1.0, -1.0])
    loss, m = policy_loss(b, clip_low=0.2, clip_high=0.6)
    # t1 now inside [0.8, 1.6]: -1.5;  (-1 - 1.5 + 0.8 + 0.9) / 4 = -0.2
    assert loss.item() == pytest.approx(-0.2, abs=1e-6)
    assert m["loss/clipfrac_high"].item() == 0.0
    assert m["loss/clipfrac_low"].item() == pytest.approx(0.25)


def test_dual_clip_bounds_negative_advantage_loss():
    b, logp = batch_with_ratios([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0])
    loss, m = policy_loss(b, clip_low=0.2, dual_clip=3.0)
    # t0: A=-1, r=5: PPO = -min(-5, -1.2) = 5 → min(5, 3·1) = 3   (dual clip active, no gradient)
    # t1: A=-1, r=2: PPO = 2 < 3                                   (gradient dr/dlogp = 2)
    # t2: A=+1, r=5: PPO = -min(5, 1.2) = -1.2                      (upper clip, no gradient; dual clip ignores A>0)
    # mean = (3 + 2 - 1.2) / 3 = 1.266667
    assert loss.item() == pytest.approx(3.8 / 3, abs=1e-5)
    assert m["loss/dual_clip_frac"].item() == pytest.approx(1 / 3)
    assert m["loss/clipfrac_high"].item() == pytest.approx(1 / 3)  # only t2 (A > 0); t0's dual clip is not counted here
    assert m["loss/clipfrac_low"].item() == 0.0
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[0.0, 2.0 / 3, 0.0]]))
    no_dual, _ = policy_loss(b, clip_low=0.2)
    assert no_dual.item() == pytest.approx((5 + 2 - 1.2) / 3, abs=1e-5)


def test_old_logp_none_means_ratio_one():
    logp = leaf([[-1.0, -2.0]])
    b = LogProbBatch(logp=logp, mask=torch.ones(1, 2), advantages=torch.tensor([2.0]))
    loss, m = policy_loss(b)
    # r = 1 → L_t = -A = -2 each, mean -2; gradient -A·r/2 = -1 per token
    assert loss.item() == pytest.approx(-2.0)
    assert m["loss/ratio_mean"].item() == 1.0
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[-1.0, -1.0]]))


# ---------------------------------------------------------------------------------------------------------------------
# Other objectives
# ---------------------------------------------------------------------------------------------------------------------


def test_bypass_uses_rollout_ratio():
    logp = leaf([[-1.0, -1.0]])
    rollout = torch.tensor([[-1.0 - LN(1.5), -1.0 - LN(1.1)]])  # π/μ = (1.5, 1.1)
    b = LogProbBatch(logp=logp, mask=torch.ones(1, 2), old_logp=logp.detach(), rollout_logp=rollout, advantages=torch.tensor([1.0]))
    loss, m = policy_loss(b, objective="bypass")
    # t0: -min(1.5, 1.2) = -1.2; t1: -1.1; mean -1.15 (old_logp is ignored: under ppo the loss would be -1)
    assert loss.item() == pytest.approx(-1.15, abs=1e-6)
    assert m["loss/clipfrac_high"].item() == pytest.approx(0.5)
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[0.0, -0.55]]))  # -A·r/2 = -1.1/2
    assert policy_loss(b)[0].item() == pytest.approx(-1.0)


def test_decoupled_without_correction_applies_old_over_rollout():
    logp = leaf([[-1.0, -1.0]])
    old = torch.tensor([[-1.0, -1.0 - LN(1.5)]])  # r = π/π_old = (1, 1.5)
    rollout = torch.tensor([[-1.0 - LN(2.0), -1.0 - LN(1.5)]])  # π_old/μ = (2, 1)
    b = LogProbBatch(logp=logp, mask=torch.ones(1, 2), old_logp=old, rollout_logp=rollout, advantages=torch.tensor([1.0]))
    loss, _ = policy_loss(b, objective="decoupled")
    # t0: w=2 · -min(1, 1) = -2;  t1: w = (π_old/μ) = exp(-1-ln1.5 - (-1-ln1.5)) = 1 · -min(1.5, 1.2) = -1.2
    # mean = -1.6; gradient: t0 = w·(-A r)/2 = -1, t1 clipped = 0
    assert loss.item() == pytest.approx(-1.6, abs=1e-5)
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[-1.0, 0.0]]))


def test_decoupled_with_correction_equals_ppo_with_correction():
    b, _ = batch_with_ratios([1.0, 1.5], [1.0, -1.0], rollout_logp=torch.tensor([[-3.0, -0.5]]))
    corr = CorrectionResult(weights=torch.tensor([[0.5, 2.0]]), keep=torch.tensor([[True, True]]))
    a, _ = policy_loss(b, objective="decoupled", correction=corr)
    p, _ = policy_loss(b, objective="ppo", correction=corr)
    assert a.item() == p.item()


def test_gspo_geometric_ratio_with_per_token_gradient():
    logp = leaf([[-1.0, -1.0, 0.0]])
    old = torch.tensor([[-1.1, -1.3, 5.0]])  # log r = (0.1, 0.3); third token is padding
    mask = torch.tensor([[1, 1, 0]])
    b = LogProbBatch(logp=logp, mask=mask, old_logp=old, advantages=torch.tensor([1.0]))
    loss, m = policy_loss(b, objective="gspo", clip_low=0.3)
    # s = exp((0.1 + 0.3) / 2) = exp(0.2) = 1.221403 inside [0.7, 1.3]: L_t = -1.221403 for both tokens
    s = math.exp(0.2)
    assert loss.item() == pytest.approx(-s, rel=1e-6)
    assert m["loss/ratio_mean"].item() == pytest.approx(s, rel=1e-6)
    # GSPO-token: ∂s_it/∂logp_t = s (not e^{log r_t} as in token PPO): grad = -A s / 2 per token
    torch.testing.assert_close(grad_of(loss, logp), torch.tensor([[-s / 2, -s / 2, 0.0]]))
    # clipped at 1 + 0.2 = 1.2 < 1.2214: constant loss, both tokens counted in clipfrac_high
    loss2, m2 = policy_loss(b, objective="gspo", clip_low=0.2)
    assert loss2.item() == pytest.approx(-1.2, abs=1e-6)
    assert m2["loss/clipfrac_high"].item() == 1.0


def test_sequence_level_ratio_is_product():
    logp = leaf([[-1.0, -1.0]])
    b = LogProbBatch(logp=logp, mask=torch.ones(1, 2), old_logp=torch.tensor([[-1.1, -1.3]]), advantages=torch.tensor([1.0]))
    loss, _ = policy_loss(b, objective="ppo", level="sequence", clip_low=0.9)
    # s = exp(0.1 + 0.3) = 1.491825 inside [0.1, 1.9]
    assert loss.item() == pytest.approx(-math.exp(0.4), rel=1e-6)
    geo, _ = policy_loss(b, objective="ppo", level="geometric", clip_low=0.9)
    gspo, _ = policy_loss(b, objective="gspo", clip_low=0.9)
    assert geo.item() == gspo.item() == pytest.approx(-math.exp(0.2), rel=1e-6)



@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_ratio_beyond_the_20_bound_is_clipped_at_every_level(level):
    # A = −1, no dual clip, three tokens with log r = 10 (token level: log r = 25 on each token instead).
    # sequence: log s = 30 > 20 -> the ±20 bound clamps it: value −A·e^20 per token, clamp active -> gradient 0,
    # and the token counts in clipfrac_high ("clamped from above other than by the dual clip"), as at token level.
    per_token = 10.0 if level == "sequence" else 25.0
    logp = leaf([[per_token - 1.0] * 3])
    b = LogProbBatch(logp=logp, mask=torch.ones(1, 3), old_logp=torch.full((1, 3), -1.0), advantages=torch.tensor([-1.0]))
    loss, m = policy_loss(b, level=level)
    loss.backward()
    assert loss.item() == pytest.approx(math.exp(20.0), rel=1e-6)  # token mean of 3 × e^20
    assert torch.equal(logp.grad, torch.zeros(1, 3))
    assert m["loss/clipfrac_high"].item() == 1.0 and m["loss/clipfrac_low"].item() == 0.0

# ---------------------------------------------------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------------------------------------------------


def reinforce_batch() -> tuple[LogProbBatch, torch.Tensor]:
    logp = leaf([[-1.0, -2.0, 7.0], [-3.0, 7.0, 7.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    return LogProbBatch(logp=logp, mask=mask, advantages=torch.tensor([1.0, 2.0, 5.0])), logp


@pytest.mark.parametrize(
    "aggregation, max_tokens, expected",
    [
        # L = -A·logp: row0 = (1, 2), row1 = (6,), row2 empty
        ("token_mean", None, 9 / 3),  # (1 + 2 + 6) / 3 valid tokens = 3
        ("seq_mean_token_mean", None, 3.75),  # ((1+2)/2 + 6/1) / 2 non-empty sequences = 3.75 (row2 left out)
        ("seq_mean_token_sum_norm", None, 1.0),  # 9 / (B=3 · T=3) = 1
        ("seq_mean_token_sum_norm", 10, 0.3),  # 9 / (3 · 10) = 0.3
        ("token_sum", None, 9.0),  # 1 + 2 + 6, no normalisation (verl's token-sum)
    ],
)
def test_aggregations_hand_computed(aggregation, max_tokens, expected):
    b, _ = reinforce_batch()
    loss, m = policy_loss(b, objective="reinforce", aggregation=aggregation, max_tokens=max_tokens)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["loss/empty_batch"].item() == 0.0


def test_correction_weights_and_keep_and_denominator():
    b, logp = reinforce_batch()
    corr = CorrectionResult(
        weights=torch.tensor([[0.5, 2.0, float("nan")], [3.0, 9.0, 9.0], [9.0, 9.0, 9.0]]),
        keep=torch.tensor([[True, False, True], [True, True, True], [True, True, True]]),
        metrics={"mine/x": torch.tensor(4.0)},
    )
    loss, m = policy_loss(b, objective="reinforce", correction=corr)
    # row0: 0.5·1 = 0.5, dropped token → 0; row1: 3·6 = 18; denominator stays 3 valid tokens: 18.5 / 3
    assert loss.item() == pytest.approx(18.5 / 3, rel=1e-6)
    assert m["mine/x"].item() == 4.0
    # ∂/∂logp = -A·w/3: row0 t0 = -0.5/3, t1 (dropped) = 0; row1 t0 = -2·3/3 = -2; padding (NaN weight) = 0
    expected = torch.tensor([[-0.5 / 3, 0.0, 0.0], [-2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(grad_of(loss, logp), expected)


def test_correction_object_is_called_and_metrics_merged():
    b, _ = reinforce_batch()
    seen = []

    def fn(batch):
        seen.append(batch)
        return CorrectionResult(weights=torch.full_like(batch.logp, 2.0).detach(), keep=batch.bool_mask, metrics={"twice/k": torch.tensor(1.0)})

    loss, m = policy_loss(b, objective="reinforce", correction=Correction("twice", fn))
    assert seen and seen[0] is b
    assert loss.item() == pytest.approx(2 * 3.0, rel=1e-6)
    assert "twice/k" in m and "loss/clipfrac_low" in m


# ---------------------------------------------------------------------------------------------------------------------
# Edge cases and validation
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_all_masked_batch_gives_zero_loss_and_zero_grad(objective, aggregation):
    logp = leaf([[float("nan"), -1.0], [float("inf"), -2.0]])
    b = LogProbBatch(
        logp=logp,
        mask=torch.zeros(2, 2),
        old_logp=torch.full((2, 2), float("nan")),
        rollout_logp=torch.tensor([[0.0, float("-inf")], [1.0, 2.0]]),
        advantages=torch.tensor([1.0, float("nan")]),
    )
    loss, m = policy_loss(b, objective=objective, aggregation=aggregation)
    assert loss.item() == 0.0 and loss.dtype == torch.float32
    assert loss.grad_fn is not None
    assert torch.equal(grad_of(loss, logp), torch.zeros(2, 2))
    assert m["loss/empty_batch"].item() == 1.0
    assert all(torch.isfinite(v).item() for v in m.values())


def test_nonfinite_valid_tokens_contribute_zero_and_are_counted(monkeypatch):
    monkeypatch.setenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT", "none")  # non-finite μ on purpose: the paths past the limit
    logp = leaf([[-1.0, float("nan"), -1.0, -1.0, -1.0]])
    old = torch.tensor([[-1.0, -1.0, float("inf"), -1.0, -1.0]])
    rollout = torch.tensor([[-1.0, -1.0, -1.0, float("-inf"), -1.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0, float("nan")]])
    b = LogProbBatch(logp=logp, mask=torch.ones(1, 5), old_logp=old, rollout_logp=rollout, advantages=adv)
    # what each objective reads besides π_θ and A: π_old (token 2 is inf) and/or μ (token 3 is −inf)
    for objective in READS:
        loss, m = policy_loss(b, objective=objective)
        usable = [0] + ([2] if "old_logp" not in READS[objective] else [])
        usable += [3] if "rollout_logp" not in READS[objective] else []
        # each usable token: r = 1 (π_θ = π_old = μ there), A = 1, log π = −1 (AT_RATIO_ONE); denominator 5
        per_token = AT_RATIO_ONE[objective]
        assert loss.item() == pytest.approx(per_token * len(usable) / 5, rel=1e-6), objective
        g = grad_of(loss, logp)
        assert torch.isfinite(g).all(), objective
        dropped = [t for t in range(1, 5) if t not in usable]
        assert torch.equal(g[0, dropped], torch.zeros(len(dropped))), objective
        assert m["loss/nonfinite_tokens"].item() == 5 - len(usable), objective


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_compute_in_float32(dtype):
    logp32 = torch.tensor([[-1.0, -2.5, -0.3]])
    logp = logp32.to(dtype).requires_grad_(True)
    old = (logp32 - 0.1).to(dtype)
    b = LogProbBatch(logp=logp, mask=torch.ones(1, 3), old_logp=old, advantages=torch.tensor([1.0]))
    loss, m = policy_loss(b, clip_low=0.5)
    assert loss.dtype == torch.float32
    ref = LogProbBatch(logp=logp.detach().float(), mask=torch.ones(1, 3), old_logp=old.float(), advantages=torch.tensor([1.0]))
    assert loss.item() == pytest.approx(policy_loss(ref, clip_low=0.5)[0].item(), rel=1e-6)
    assert all(v.dtype == torch.float32 for v in m.values())
    g = grad_of(loss, logp)
    assert g.dtype == dtype and torch.isfinite(g.float()).all()


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"objective": "ppo2"}, "objective"),
        ({"aggregation": "mean"}, "aggregation"),
        ({"clip_low": -0.1}, "clip_low"),
        ({"clip_high": float("nan")}, "clip_high"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"dual_clip": 0.5}, "dual_clip"),
        ({"objective": "reinforce", "dual_clip": 3.0}, "dual_clip"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"level": "seq"}, "level"),
        ({"objective": "bypass"}, "rollout_logp"),
        ({"objective": "decoupled"}, "rollout_logp"),
    ],
)
def test_validation_names_the_argument(kwargs, name):
    b = LogProbBatch(logp=torch.zeros(1, 2), mask=torch.ones(1, 2), advantages=torch.ones(1))
    with pytest.raises(ValueError, match=name):
        policy_loss(b, **kwargs)


def test_missing_advantages_raises():
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(LogProbBatch(logp=torch.zeros(1, 2), mask=torch.ones(1, 2)))


# ---------------------------------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------------------------------

finite_f = st.floats(-8.0, 0.0, allow_nan=False, width=32)


@st.composite
def batches(draw, max_b=4, max_t=6):
    B = draw(st.integers(1, max_b))
    T = draw(st.integers(1, max_t))
    vals = lambda: torch.tensor(draw(st.lists(finite_f, min_size=B * T, max_size=B * T))).view(B, T)  # noqa: E731
    logp, old, roll = vals(), vals(), vals()
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))).view(B, T)
    adv = torch.tensor(draw(st.lists(st.floats(-3, 3, allow_nan=False, width=32), min_size=B, max_size=B)))
    return logp, old, roll, mask, adv


@settings(max_examples=50, deadline=None)
@given(batches(), st.floats(0.0, 0.5), st.floats(0.0, 0.5), st.sampled_from(AGGREGATIONS.names()))
def test_on_policy_ppo_gradient_equals_reinforce_gradient(data, eps_low, eps_high, aggregation):
    logp_v, _, _, mask, adv = data
    logp = logp_v.clone().requires_grad_(True)
    b = LogProbBatch(logp=logp, mask=mask, old_logp=logp_v.clone(), advantages=adv)
    g_ppo = grad_of(policy_loss(b, clip_low=eps_low, clip_high=eps_high, aggregation=aggregation)[0], logp)
    # REINFORCE: ∂/∂logp of -A·logp is -A on valid tokens, then the same aggregation scaling
    g_rf = grad_of(policy_loss(b, objective="reinforce", aggregation=aggregation)[0], logp)
    torch.testing.assert_close(g_ppo, g_rf)
    if aggregation == "token_mean":
        n = mask.float().sum().clamp(min=1)
        torch.testing.assert_close(g_rf, torch.where(mask, -adv[:, None].expand_as(logp) / n, torch.zeros_like(logp)))


@settings(max_examples=50, deadline=None)
@given(batches(), st.sampled_from(OBJECTIVES.names()), st.sampled_from(AGGREGATIONS.names()), st.integers(0, 2**31 - 1))
def test_padding_never_contributes(data, objective, aggregation, seed):
    logp_v, old, roll, mask, adv = data
    g = torch.Generator().manual_seed(seed)
    junk = torch.randn(logp_v.shape, generator=g) * 100
    junk[torch.rand(logp_v.shape, generator=g) < 0.3] = float("nan")
    junk[torch.rand(logp_v.shape, generator=g) < 0.2] = float("inf")

    def run(fill: bool):
        def f(x):
            return torch.where(mask, x, junk) if fill else x

        lp = f(logp_v).clone().requires_grad_(True)
        b = LogProbBatch(logp=lp, mask=mask, old_logp=f(old), rollout_logp=f(roll), advantages=adv)
        dual_clip = 3.0 if takes(objective, "dual_clip") else None
        loss, m = policy_loss(b, objective=objective, aggregation=aggregation, dual_clip=dual_clip)
        return loss, grad_of(loss, lp), m

    l0, g0, m0 = run(False)
    l1, g1, m1 = run(True)
    torch.testing.assert_close(l0, l1)
    torch.testing.assert_close(g0, g1)
    assert torch.equal(g1[~mask], torch.zeros_like(g1[~mask]))
    for k in m0:
        torch.testing.assert_close(m0[k], m1[k])


@settings(max_examples=50, deadline=None)
@given(batches(), st.sampled_from(OBJECTIVES.names()), st.integers(0, 2**31 - 1))
def test_nonfinite_at_valid_positions_never_nan(data, objective, seed):
    logp_v, old, roll, mask, adv = data
    g = torch.Generator().manual_seed(seed)
    specials = torch.tensor([float("nan"), float("inf"), float("-inf")])

    def poison(x):
        hit = torch.rand(x.shape, generator=g) < 0.3
        return torch.where(hit, specials[torch.randint(0, 3, x.shape, generator=g)], x)

    lp = poison(logp_v).requires_grad_(True)
    b = LogProbBatch(logp=lp, mask=mask, old_logp=poison(old), rollout_logp=poison(roll), advantages=adv,
                     max_nonfinite_rollout=None)  # non-finite μ on purpose: the never-NaN paths past the limit
    loss, m = policy_loss(b, objective=objective)
    assert torch.isfinite(loss)
    assert torch.isfinite(grad_of(loss, lp)).all()
    finite = torch.isfinite(lp)
    for name in READS.get(objective, OBJECTIVES[objective].inputs_read(False)):
        finite &= torch.isfinite(getattr(b, name))
    assert m["loss/nonfinite_tokens"].item() == (~finite & mask).sum().item()


@settings(max_examples=50, deadline=None)
@given(batches(), st.floats(0.05, 0.5), st.floats(0.05, 0.5))
def test_clip_fractions_are_the_zero_gradient_tokens(data, eps_low, eps_high):
    """For A ≠ 0, a valid token's PPO gradient is zero exactly when its clip is active: the clipfracs must count them."""
    logp_v, old, _, mask, adv = data
    adv = torch.where(adv.abs() < 0.1, torch.ones_like(adv), adv)  # tiny |A| would underflow the gradient to 0
    lp = logp_v.clone().requires_grad_(True)
    b = LogProbBatch(logp=lp, mask=mask, old_logp=old, advantages=adv)
    loss, m = policy_loss(b, clip_low=eps_low, clip_high=eps_high)
    r = torch.exp((logp_v - old).clamp(-20, 20))
    on_bound = ((r - (1 - eps_low)).abs() < 1e-4) | ((r - (1 + eps_high)).abs() < 1e-4) | ((logp_v - old).abs() >= 20)
    if (on_bound & mask).any():
        return  # a ratio on a clip boundary has an ambiguous subgradient; skip such draws
    zero_grad = (grad_of(loss, lp) == 0) & mask
    n = max(int(mask.sum()), 1)
    assert (m["loss/clipfrac_low"] + m["loss/clipfrac_high"]).item() == pytest.approx(zero_grad.sum().item() / n, abs=1e-6)
    a = adv[:, None].expand_as(r)
    assert m["loss/clipfrac_high"].item() == pytest.approx((zero_grad & (a > 0)).sum().item() / n, abs=1e-6)


@settings(max_examples=30, deadline=None)
@given(batches(), st.floats(1.5, 10.0))
def test_dual_clip_caps_each_negative_token_loss(data, c):
    logp_v, old, _, mask, adv = data
    adv = -adv.abs() - 0.1  # all negative
    for i in range(logp_v.shape[0]):
        for t in range(logp_v.shape[1]):
            if not mask[i, t]:
                continue
            one = LogProbBatch(logp=logp_v[i : i + 1, t : t + 1], mask=torch.ones(1, 1), old_logp=old[i : i + 1, t : t + 1], advantages=adv[i : i + 1])
            loss, _ = policy_loss(one, dual_clip=c)
            assert loss.item() <= c * abs(adv[i].item()) * (1 + 1e-6)


def test_ratio_stats_exact_in_a_mostly_padded_batch():
    """Padding must not enter the ratio sums: 1 valid token among 400k positions still reports its own ratio."""
    B, T = 4, 100_000
    logp = torch.zeros(B, T)
    old = torch.zeros(B, T)
    old[2, 7] = -math.log(1.5)  # r = 1.5 on the only valid token
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[2, 7] = True
    b = LogProbBatch(logp=logp, mask=mask, old_logp=old, advantages=torch.ones(B))
    _, m = policy_loss(b)
    for k in ("loss/ratio_mean", "loss/ratio_max", "loss/ratio_min"):
        assert m[k].item() == pytest.approx(1.5, rel=1e-6), k


def test_inputs_are_not_mutated():
    logp = torch.tensor([[-1.0, float("nan"), -0.5]], requires_grad=True)
    old = torch.tensor([[-1.2, -1.0, float("inf")]])
    rollout = torch.tensor([[-1.1, -0.9, -0.4]])
    adv = torch.tensor([[1.0, float("nan"), -2.0]])
    weights = torch.tensor([[2.0, float("nan"), 0.5]])
    keep = torch.tensor([[True, True, False]])
    before = [x.detach().clone() for x in (logp, old, rollout, adv, weights)]
    b = LogProbBatch(logp=logp, mask=torch.ones(1, 3), old_logp=old, rollout_logp=rollout, advantages=adv)
    for objective in OBJECTIVES:
        policy_loss(b, objective=objective, correction=CorrectionResult(weights, keep))[0].backward()
    for x, y in zip((logp, old, rollout, adv, weights), before):
        torch.testing.assert_close(x.detach(), y, equal_nan=True)


@settings(max_examples=50, deadline=None)
@given(batches(), st.sampled_from(["ppo", "gspo", "reinforce"]))
def test_aggregations_agree_when_every_sequence_is_full(data, objective):
    """All rows fully valid: seq-mean of token-means = token mean = Dr.GRPO sum / (B·T) = token sum / (B·T)."""
    logp, old, _, mask, adv = data
    full = torch.ones_like(mask)
    b = LogProbBatch(logp=logp, mask=full, old_logp=old, advantages=adv)
    names = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "token_sum")
    losses = [policy_loss(b, objective=objective, aggregation=a)[0] for a in names]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses[0], losses[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses[3] / logp.numel(), losses[2], rtol=1e-5, atol=1e-5)
    # and Dr.GRPO with T_max = 2T halves it
    half = policy_loss(b, objective=objective, aggregation="seq_mean_token_sum_norm", max_tokens=2 * logp.shape[1])[0]
    torch.testing.assert_close(half * 2, losses[2], rtol=1e-5, atol=1e-5)
