"""Binary divergences of the sampled token (``offpolicy.binary``): the exact value (mpmath, 50 digits), ≥ 0 for
nearby policies in float32 and bfloat16 inputs, and no false "outside the trust region" in DPPO-KL
(``benchmarks/binary_kl_roundoff.py`` prints the round-off of the textbook form beside this one)."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy import LogProbBatch, bernoulli_kl, bernoulli_tv, policy_loss
from offpolicy.binary import expm1_minus_x
from offpolicy.objectives.dppo import binary_kl, binary_tv

mpmath.mp.dps = 50
# p near 0, in the middle and near 1 (1 − 1e-7 is 1 − 1.19e-7 in float32: its log is −1.19e-7)
PROBS = (1e-7, 1e-5, 1e-3, 0.1, 0.5, 0.9, 1 - 1e-3, 1 - 1e-5, 1 - 1e-7, 1.0)
DELTAS = (1e-6, -1e-6, 3e-7, -3e-7, 1e-8, -1e-8, 0.0)


def exact_kl(log_q: float, log_p: float, lo: float = 0.0, hi: float = 1.0) -> float:
    """KL((q, 1 − q) ‖ (p, 1 − p)) of the clamped probabilities, 50 digits."""
    q, p = mpmath.exp(mpmath.mpf(log_q)), mpmath.exp(mpmath.mpf(log_p))
    q, p = min(max(q, lo), hi), min(max(p, lo), hi)
    if (p == 1 and q < 1) or (p == 0 and q > 0):
        return math.inf
    first = q * mpmath.log(q / p) if q > 0 else 0
    second = (1 - q) * mpmath.log((1 - q) / (1 - p)) if q < 1 else 0
    return float(first + second)


def nearby(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(log q, log p) with |log q − log p| ≤ 1e-6 over PROBS (p < 1), rounded to ``dtype``."""
    pairs = [(math.log(q), math.log(q) - d) for q in PROBS for d in DELTAS if math.log(q) - d <= 0]
    a = torch.tensor([x for x, _ in pairs], dtype=torch.float64).to(dtype)
    b = torch.tensor([y for _, y in pairs], dtype=torch.float64).to(dtype)
    return a, b


def test_by_hand():
    # KL((¼, ¾) ‖ (½, ½)) = ¼·ln(½) + ¾·ln(3/2) = −0.173287 + 0.304099 = 0.130812
    assert bernoulli_kl(torch.tensor(0.25).log(), torch.tensor(0.5).log()).item() == pytest.approx(0.130812, abs=1e-6)
    # nearby, q = ½, p = ½e^(−d), d = 1e-3: KL ≈ (q − p)²/(2q(1 − q)) = (½·1e-3)²/(2·¼) = 5.0e-7 (4.9949e-7 exactly)
    a, b = torch.tensor(math.log(0.5)), torch.tensor(math.log(0.5) - 1e-3)
    assert bernoulli_kl(a, b).item() == pytest.approx(exact_kl(a.item(), b.item()), rel=1e-6)
    assert exact_kl(a.item(), b.item()) == pytest.approx(5.0e-7, rel=2e-3)
    # the limits: q = 0 → −log(1 − p) = ln 2 at p = ½; p = 1 with q < 1 → +inf; q = p = 1 → 0
    assert bernoulli_kl(torch.tensor(-math.inf), torch.tensor(0.5).log()).item() == pytest.approx(math.log(2))
    assert bernoulli_kl(torch.tensor(0.5).log(), torch.tensor(0.0)).item() == math.inf
    assert bernoulli_kl(torch.tensor(0.0), torch.tensor(0.0)).item() == 0.0
    # h(x) = eˣ − 1 − x: 1e-6 → 5.0000002e-13 (series), 1 → e − 2
    torch.testing.assert_close(expm1_minus_x(torch.tensor([1e-6, 1.0])), torch.tensor([5.0000002e-13, math.e - 2]))
    # TV: p − q, signed
    assert bernoulli_tv(torch.tensor(0.5).log(), torch.tensor(0.6).log()).item() == pytest.approx(0.1)
    assert binary_tv(torch.tensor(0.4).log(), torch.tensor(0.5).log()).item() == pytest.approx(-0.1)


@settings(max_examples=200, deadline=None)
@given(st.floats(-30.0, 0.0), st.floats(-30.0, 0.0), st.sampled_from([(0.0, 1.0), (1e-6, 1 - 1e-6), (0.0, 1 - 1e-8)]))
def test_equals_the_exact_value(a, b, clamp):
    lo, hi = clamp
    got = bernoulli_kl(torch.tensor(a), torch.tensor(b), min_prob=lo, max_prob=hi).item()
    a32, b32 = float(torch.tensor(a)), float(torch.tensor(b))  # the float32 inputs it saw
    # the clamp bounds as the function rounds them (float32 log-probabilities)
    lo32 = float(torch.tensor(math.log(lo))) if lo else -math.inf
    hi32 = float(torch.tensor(math.log1p(-(1 - hi)))) if hi < 1 else 0.0
    want = exact_kl(min(max(a32, lo32), hi32), min(max(b32, lo32), hi32))
    assert got >= 0.0
    if math.isinf(want):
        assert got == math.inf
    else:
        assert got == pytest.approx(want, rel=2e-5, abs=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nearby_policies_give_a_nonnegative_exact_kl(dtype):
    # |Δ log p| ≤ 1e-6, p from 1e-7 to 1: the textbook form (verl's dppo_kl, this project's before) is negative on some
    # of these pairs; bernoulli_kl is ≥ 0 on all and equals the exact value to ~1e-6 relative
    a, b = nearby(dtype)
    kl = bernoulli_kl(a, b)
    assert kl.dtype == torch.float32 and bool((kl >= 0).all())
    want = torch.tensor([exact_kl(x, y) for x, y in zip(a.float().tolist(), b.float().tolist())], dtype=torch.float64)
    finite = torch.isfinite(want)
    err = (kl.double() - want).abs()[finite]
    assert float((err / want[finite].clamp(min=1e-300)).max()) < 1e-5 or float(err.max()) < 1e-20
    p, p_old = torch.exp(b.float()), torch.exp(a.float())  # the textbook's cancellation, float32
    textbook = p_old * (a.float() - b.float()) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
    if dtype == torch.float32:
        assert int((textbook < 0).sum()) >= 5  # what the exact form removes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dppo_kl_puts_nearby_tokens_outside_the_trust_region_only_when_they_are(dtype):
    # DPPO-KL masks a token (A > 0: p > p_old; A < 0: p < p_old) iff its binary KL exceeds δ. On the nearby pairs the
    # masked set is the exact one at every δ — at the default 0.05 none, at 1e-9 only those whose exact KL (up to
    # 7.6e-7 where 1 − p ~ 1e-7) exceeds it — with bf16 log-probs too (computed in float32). The textbook form's
    # ±6e-8 round-off would put tokens whose exact KL is ~1e-13 outside a δ of 1e-9 ("before" below).
    a, b = nearby(dtype)  # a = log π_old, b = log π_θ
    assert bool((binary_kl(b, a) >= 0).all())
    top = float(torch.tensor(math.log1p(-1e-8)))  # DPPO clamps both probabilities at 1 − 1e-8 (float32 log)
    exact = torch.tensor([exact_kl(min(x, top), min(y, top)) for x, y in zip(a.float().tolist(), b.float().tolist())],
                         dtype=torch.float64)
    n = a.numel()
    for delta in (0.05, 1e-6, 1e-9, 1e-12):
        for sign in (1.0, -1.0):
            logp = b.reshape(1, n).clone().requires_grad_(True)
            batch = LogProbBatch(logp=logp, old_logp=a.reshape(1, n), mask=torch.ones(1, n),
                                 advantages=torch.full((1,), sign))
            _, m = policy_loss(batch, objective={"name": "dppo_kl", "delta_low": delta})
            outward = (b.float() > a.float()) if sign > 0 else (b.float() < a.float())
            masked = m["loss/clipfrac_high" if sign > 0 else "loss/clipfrac_low"].item() * n
            surely = int((outward & (exact > delta * (1 + 1e-4))).sum())
            maybe = int((outward & (exact > delta * (1 - 1e-4))).sum())
            assert surely <= round(masked) <= maybe, (delta, sign)
    # before: the textbook form, in float32, on the same pairs and δ = 1e-9
    p, p_old = torch.exp(b.float()), torch.exp(a.float())
    textbook = p_old * (a.float() - b.float()) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
    false_outside = (textbook > 1e-9) & (exact < 1e-10)
    if dtype == torch.float32:
        assert int(false_outside.sum()) > 0


def test_bad_clamps_are_named():
    with pytest.raises(ValueError, match=r"min_prob must be a number in \[0.0, 0.5\]"):
        bernoulli_kl(torch.zeros(1), torch.zeros(1), min_prob=0.7)
    with pytest.raises(ValueError, match=r"max_prob must be a number in \[0.5, 1.0\]"):
        bernoulli_tv(torch.zeros(1), torch.zeros(1), max_prob=1.5)
