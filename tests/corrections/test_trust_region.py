"""Tests for offpolicy.corrections.trust_region: k-estimators, TRM max/avg/combined, LN-TRM, SER and presets."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.trust_region import k1, k2, k3, ln_trm, ln_trm_mask, ser, ser_mask, trm, trust_region_mask

NAN, INF = float("nan"), float("inf")


def close(t: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(t, torch.tensor(expected, dtype=t.dtype), atol=atol, rtol=1e-5)


@st.composite
def token_batches(draw, max_b: int = 5, max_t: int = 12, nonneg: bool = False):
    b, t = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = draw(st.sampled_from([0.01, 0.05, 0.3])) * torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) > draw(st.sampled_from([0.0, 0.3, 0.7]))
    return (x.abs() if nonneg else x), mask


def junk_like(x: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.tensor([NAN, INF, -INF, 1e30, 5.0])[torch.randint(0, 5, x.shape, generator=g)]


# ---------------------------------------------------------------------------------------------------------------------
# k-estimators
# ---------------------------------------------------------------------------------------------------------------------


def test_k_estimators_by_hand():
    r = torch.tensor([0.0, 0.5, -1.0])
    close(k1(r), [0.0, -0.5, 1.0])
    close(k2(r), [0.0, 0.125, 0.5])  # ½·0.25, ½·1
    close(k3(r), [0.0, math.exp(0.5) - 1.5, math.exp(-1.0)])  # e^0.5 − 1 − 0.5 = 0.1487; e^-1 − 1 + 1 = 0.3679


def test_k_estimators_compute_in_float32():
    r = torch.tensor([0.5], dtype=torch.bfloat16)
    assert k1(r).dtype == k2(r).dtype == k3(r).dtype == torch.float32


def test_k1_k3_unbiased_for_kl_mu_pi_exactly():
    # μ = (0.5, 0.3, 0.2), π = (0.4, 0.4, 0.2); KL(μ‖π) = 0.5 ln(5/4) + 0.3 ln(3/4) = 0.111572 − 0.086305 = 0.025266
    mu = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    pi = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    kl = 0.5 * math.log(5 / 4) + 0.3 * math.log(3 / 4)
    r = torch.log(pi / mu)  # log(π/μ) of each token, weighted by how often μ samples it
    assert (mu * k1(r).double()).sum().item() == pytest.approx(kl, rel=1e-6)
    assert (mu * k3(r).double()).sum().item() == pytest.approx(kl, rel=1e-6)
    # k2 is biased: ½ Σ μ r² = ½(0.5·0.049793 + 0.3·0.082760) = 0.024862 ≠ 0.025266
    k2_mean = 0.5 * (0.5 * math.log(5 / 4) ** 2 + 0.3 * math.log(3 / 4) ** 2)
    assert (mu * k2(r).double()).sum().item() == pytest.approx(k2_mean, rel=1e-6)
    assert abs((mu * k2(r).double()).sum().item() - kl) > 1e-4


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=1, max_size=30))
def test_k2_k3_nonnegative_and_finite(values):
    r = torch.tensor(values)
    for f in (k2, k3):
        out = f(r)
        assert bool((out >= 0).all())
    assert bool(torch.isfinite(k3(r)).all())  # r clamped at +20 before exp; below −20 k3 ≈ −1 − r, finite


def test_k3_is_not_understated_below_minus_20_and_infinite_at_minus_inf():
    # k3(−40) = e^−40 − 1 + 40 = 39.0 (a ±20 clamp of the linear term would give 19); k3(−inf) = +inf
    out = k3(torch.tensor([-40.0, -float("inf")]))
    assert out[0].item() == pytest.approx(39.0) and out[1].item() == float("inf")


def test_k3_tiny_r_accurate():
    # k3(r) ≈ r²/2 for small r: 1e-4 → 5e-9 (a naive exp(r) − 1 − r in float32 returns 0 or noise here)
    assert k3(torch.tensor([1e-4])).item() == pytest.approx(5e-9, rel=1e-2)


# ---------------------------------------------------------------------------------------------------------------------
# trust_region_mask
# ---------------------------------------------------------------------------------------------------------------------


def test_trm_max_avg_combined_by_hand():
    d = torch.tensor([[0.01, 0.02, 9.0], [0.001, 0.09, 0.0], [0.04, 0.04, 0.04], [0.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [0, 0, 0]])
    # row max (valid): 0.02, 0.09, 0.04, – ; row mean: 0.015, 0.0303, 0.04, –
    keep_max = trust_region_mask(d, m, max_kl=0.05)
    assert keep_max.any(-1).tolist() == [True, False, True, False]
    keep_avg = trust_region_mask(d, m, avg_kl=0.035)
    assert keep_avg.any(-1).tolist() == [True, True, False, False]
    both = trust_region_mask(d, m, max_kl=0.05, avg_kl=0.035)
    assert both.any(-1).tolist() == [True, False, False, False]
    assert torch.equal(both, keep_max & keep_avg)
    assert not (both & ~m.bool()).any()  # never keeps padding
    # thresholds are inclusive: max 0.04 ≤ 0.04
    assert trust_region_mask(d, m, max_kl=0.04)[2].all()


def test_trm_nonfinite_divergence_drops_sequence():
    d = torch.tensor([[0.0, NAN], [0.0, INF], [0.0, NAN]])
    m = torch.tensor([[1, 1], [1, 1], [1, 0]])
    for kw in (dict(max_kl=1.0), dict(avg_kl=1.0), dict(max_kl=1.0, avg_kl=1.0)):
        assert trust_region_mask(d, m, **kw).tolist() == [[False, False], [False, False], [True, False]]


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(), "max_kl and/or avg_kl"),
        (dict(max_kl=-0.1), "max_kl"),
        (dict(max_kl=NAN), "max_kl"),
        (dict(avg_kl=INF), "avg_kl"),
        (dict(avg_kl="0.1"), "avg_kl"),
    ],
)
def test_trm_validation(kw, name):
    with pytest.raises(ValueError, match=name):
        trust_region_mask(torch.zeros(1, 2), torch.ones(1, 2), **kw)
    with pytest.raises(ValueError, match=name):
        trm(**{"max_kl": None, "avg_kl": None, **kw})


@settings(max_examples=50, deadline=None)
@given(token_batches(nonneg=True), st.integers(0, 2**31 - 1))
def test_trm_padding_never_contributes(batch, seed):
    d, m = batch
    a = trust_region_mask(d, m, max_kl=0.05, avg_kl=0.02)
    b = trust_region_mask(torch.where(m, d, junk_like(d, seed)), m, max_kl=0.05, avg_kl=0.02)
    assert torch.equal(a, b)
    assert torch.equal(trust_region_mask(torch.zeros_like(d), m, max_kl=0.0, avg_kl=0.0), m)  # on-policy: all kept


@pytest.mark.parametrize("T, paper", [(256, 0.774), (1024, 0.358), (4096, 0.017)])
def test_trm_max_acceptance_matches_iid_formula(T, paper):
    """i.i.d. violation probability p per token ⇒ TRM-Max acceptance (1 − p)^T (arXiv 2512.23075 App. F.1)."""
    p, n = 1e-3, 4000
    expected = (1 - p) ** T  # 0.7741, 0.3589, 0.0166
    assert expected == pytest.approx(paper, abs=2e-3)  # the paper's rounded numbers
    g = torch.Generator().manual_seed(T)
    u = torch.rand(n, T, generator=g)
    d = torch.where(u < p, torch.full_like(u, 1.0), 0.01 * u)  # violators have D = 1 > 0.05, others ≤ 0.01
    rate = trust_region_mask(d, torch.ones(n, T, dtype=torch.bool), max_kl=0.05).any(-1).float().mean().item()
    se = math.sqrt(expected * (1 - expected) / n)  # 0.0066, 0.0076, 0.0020
    assert abs(rate - expected) < 4 * se


# ---------------------------------------------------------------------------------------------------------------------
# LN-TRM and SER
# ---------------------------------------------------------------------------------------------------------------------


def test_ln_trm_by_hand_with_padding_inside():
    # valid ρ = (1.2, 1, 1) with a padded junk token in between: t counts valid tokens only, so T = 3, t = 1, 2, 3
    # w = min(1, (T−t)ε, √((T−t)δ/2)) with ε = 0.5, δ = 1: T−t = 2, 1, 0 → min(1, 1, 1) = 1; min(1, 0.5, 0.707) = 0.5; 0
    # W = 0.2·1 = 0.2, Z = 1.5, W/Z = 0.1333
    r = torch.log(torch.tensor([[1.2, 50.0, 1.0, 1.0]]))
    m = torch.tensor([[1, 0, 1, 1]])
    assert ln_trm_mask(r, m, eps=0.5, delta=1.0, threshold=0.134).tolist() == [[True, False, True, True]]
    assert not ln_trm_mask(r, m, eps=0.5, delta=1.0, threshold=0.133).any()
    # the same deviation on the *last* token has weight 0 (it shifts no later context): kept at any threshold
    r_last = torch.log(torch.tensor([[1.0, 1.0, 1.2]]))
    assert ln_trm_mask(r_last, torch.ones(1, 3), eps=0.5, delta=1.0, threshold=0.0).all()


def test_ln_trm_sqrt_and_linear_branches_by_hand():
    # ε = 0.08, δ = 0.02, T = 3: T−t = 2 → min(1, 0.16, √(2·0.02/2) = 0.14142) = 0.14142 (√ branch);
    # T−t = 1 → min(1, 0.08, √(0.02/2) = 0.1) = 0.08 (linear branch); T−t = 0 → 0
    # ρ = (1.1, 1.3, 5): W = 0.1·0.14142 + 0.3·0.08 = 0.038142, Z = 0.221421 → W/Z = 0.172260
    r = torch.log(torch.tensor([[1.1, 1.3, 5.0]]))
    assert ln_trm_mask(r, torch.ones(1, 3), eps=0.08, delta=0.02, threshold=0.17227).all()
    assert not ln_trm_mask(r, torch.ones(1, 3), eps=0.08, delta=0.02, threshold=0.17225).any()


def test_ln_trm_single_token_and_nonfinite():
    r = torch.tensor([[3.0, 0.0], [NAN, 0.0], [0.0, NAN]])
    m = torch.tensor([[1, 0], [1, 1], [1, 0]])
    # row 0: T = 1, Z = 0 → W/Z := 0, kept; row 1: NaN in a valid position → dropped; row 2: NaN is padding
    assert ln_trm_mask(r, m, eps=0.1, delta=0.1, threshold=0.0).tolist() == [[True, False], [False, False], [True, False]]


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 300), st.floats(0.0, 0.5), st.sampled_from([1e-3, 5e-3, 0.1]), st.sampled_from([1e-4, 1e-2, 1.0]))
def test_ln_trm_constant_deviation_is_length_neutral(T, c, eps, delta):
    """|ρ_t − 1| = c everywhere ⇒ W/Z = c for any length T ≥ 2 (W/Z is a weighted mean of the deviations)."""
    r = torch.full((1, T), math.log1p(c))
    m = torch.ones(1, T)
    assert ln_trm_mask(r, m, eps=eps, delta=delta, threshold=c * (1 + 1e-4) + 1e-7).all()
    if c > 1e-3:
        assert not ln_trm_mask(r, m, eps=eps, delta=delta, threshold=c * (1 - 1e-3)).any()


def test_ser_by_hand():
    r = torch.log(torch.tensor([[1.1, 0.9, 1.0, 7.0], [1.5, 1.0, 1.0, 1.0]]))
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    # row 0: (0.1 + 0.1 + 0)/3 = 0.0667; row 1: (0.5 + 0)/2 = 0.25
    assert ser_mask(r, m, threshold=0.07).any(-1).tolist() == [True, False]
    assert ser_mask(r, m, threshold=0.066).any(-1).tolist() == [False, False]
    assert ser_mask(r, m, threshold=0.25).any(-1).tolist() == [True, True]
    assert ser_mask(torch.tensor([[NAN, 0.0]]), torch.ones(1, 2), threshold=10.0).tolist() == [[False, False]]


@settings(max_examples=50, deadline=None)
@given(token_batches())
def test_ser_invariant_to_repeating_a_sequence(batch):
    r, m = batch
    for th in (0.01, 0.05, 0.2):
        once = ser_mask(r, m, threshold=th).any(-1)
        twice = ser_mask(torch.cat([r, r], -1), torch.cat([m, m], -1), threshold=th).any(-1)
        if not _near_ser_threshold(r, m, th):  # the mean of the doubled row may round across the threshold
            assert torch.equal(once, twice)


def _near_ser_threshold(r, m, th):
    dev = torch.where(m, (torch.exp(r) - 1).abs(), torch.zeros_like(r)).sum(-1) / m.float().sum(-1).clamp(min=1)
    return bool(((dev - th).abs() < 1e-6).any())


@settings(max_examples=50, deadline=None)
@given(token_batches(), st.integers(0, 2**31 - 1))
def test_ln_trm_and_ser_padding_never_contributes(batch, seed):
    r, m = batch
    j = torch.where(m, r, junk_like(r, seed))
    kw = dict(eps=0.01, delta=0.01, threshold=0.05)
    assert torch.equal(ln_trm_mask(r, m, **kw), ln_trm_mask(j, m, **kw))
    assert torch.equal(ser_mask(r, m, threshold=0.05), ser_mask(j, m, threshold=0.05))
    z = torch.zeros_like(r)
    assert torch.equal(ln_trm_mask(z, m, eps=0.01, delta=0.01, threshold=0.0), m)
    assert torch.equal(ser_mask(z, m, threshold=0.0), m)


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(eps=0.0), "eps"),
        (dict(eps=NAN), "eps"),
        (dict(delta=-1.0), "delta"),
        (dict(threshold=-0.1), "threshold"),
        (dict(threshold=INF), "threshold"),
    ],
)
def test_ln_trm_validation(kw, name):
    args = {**dict(eps=0.01, delta=0.01, threshold=0.05), **kw}
    with pytest.raises(ValueError, match=f"^{name}"):
        ln_trm_mask(torch.zeros(1, 2), torch.ones(1, 2), **args)
    with pytest.raises(ValueError, match=f"^{name}"):
        ln_trm(**args)
    if name == "threshold":
        with pytest.raises(ValueError, match="^threshold"):
            ser_mask(torch.zeros(1, 2), torch.ones(1, 2), threshold=kw["threshold"])
        with pytest.raises(ValueError, match="^threshold"):
            ser(threshold=kw["threshold"])


FUNCS = {
    "trust_region_mask": (lambda x, m: trust_region_mask(x, m, max_kl=0.1), "token_divergence"),
    "ln_trm_mask": (lambda x, m: ln_trm_mask(x, m, eps=0.1, delta=0.1, threshold=0.1), "log_ratio"),
    "ser_mask": (lambda x, m: ser_mask(x, m, threshold=0.1), "log_ratio"),
}


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(sorted(FUNCS)), st.lists(st.integers(1, 5), max_size=3), st.lists(st.integers(1, 5), max_size=3))
def test_fuzz_wrong_shapes_name_the_argument(fname, x_shape, m_shape):
    f, first = FUNCS[fname]
    x, m = torch.zeros(tuple(x_shape)), torch.ones(tuple(m_shape))
    if len(x_shape) != 2:
        with pytest.raises(ValueError, match=f"^{first}"):
            f(x, m)
    elif x_shape != m_shape:
        with pytest.raises(ValueError, match="^mask"):
            f(x, m)
    else:
        assert f(x, m).shape == x.shape


# ---------------------------------------------------------------------------------------------------------------------
# presets
# ---------------------------------------------------------------------------------------------------------------------


def _m(result):
    return {k: v.item() for k, v in result.metrics.items()}


def test_trm_preset_k_estimator_fallback_by_hand():
    # r = log(π_old/μ) = (0, 0.2 | 0.1, 0.1 | 0.5, ·); row 3 empty
    b = LogProbBatch(
        logp=torch.zeros(4, 2),
        old_logp=torch.tensor([[0.0, 0.2], [0.1, 0.1], [0.5, 0.0], [0.0, 0.0]]),
        rollout_logp=torch.zeros(4, 2),
        mask=torch.tensor([[1, 1], [1, 1], [1, 0], [0, 0]]),
    )
    # max test on k2 = ½r²: row maxima 0.02, 0.005, 0.125; avg test on k3 = e^r − 1 − r:
    # row 0: (0 + 0.021403)/2 = 0.010701; row 1: 0.005171; row 2: 0.148721
    r = trm(max_kl=0.05, avg_kl=0.008, source="mismatch")(b)
    assert r.keep.any(-1).tolist() == [False, True, False, False]
    m = _m(r)
    assert m["trm/masked_seq_frac"] == pytest.approx(2 / 3)  # of the 3 non-empty sequences (1 − the acceptance rate)
    assert m["trm/masked_frac"] == pytest.approx(3 / 5)  # rows 0 and 2: 3 of the 5 valid tokens
    assert m["trm/max_divergence_mean"] == pytest.approx((0.02 + 0.005 + 0.125) / 3, rel=1e-5)
    k3s = [(math.exp(0.2) - 1.2) / 2, math.exp(0.1) - 1.1, math.exp(0.5) - 1.5]
    assert m["trm/avg_divergence_mean"] == pytest.approx(sum(k3s) / 3, rel=1e-4)
    assert (m["trm/divergence_exact"], m["trm/divergence_topk"], m["trm/divergence_k_estimator"]) == (0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="rollout_logp"):
        trm()(b.replace(rollout_logp=None))


@pytest.mark.parametrize("kind", ["exact", "topk"])
def test_trm_preset_uses_token_divergence_when_given(kind):
    d = torch.tensor([[0.01, 0.06], [0.01, 0.0]])
    # no rollout_logp needed: the divergence is given
    b = LogProbBatch(logp=torch.zeros(2, 2), mask=torch.ones(2, 2), token_divergence=d, token_divergence_kind=kind)
    r = trm(max_kl=0.05, avg_kl=None)(b)
    assert r.keep.tolist() == [[False, False], [True, True]]  # row maxima 0.06 and 0.01
    m = _m(r)
    assert m["trm/divergence_" + kind] == 1.0 and m["trm/divergence_k_estimator"] == 0.0
    assert m["trm/divergence_exact"] + m["trm/divergence_topk"] == 1.0
    assert m["trm/max_divergence_mean"] == pytest.approx((0.06 + 0.01) / 2)
    assert m["trm/avg_divergence_mean"] == pytest.approx((0.035 + 0.005) / 2)


def test_trm_measures_the_current_policy_by_default():
    # μ = π_old, π_θ moved: the paper's D_t is KL(π_roll ‖ π_θ), so the default (source="total") sees the drift
    b = LogProbBatch(logp=torch.tensor([[0.5]]), old_logp=torch.zeros(1, 1), rollout_logp=torch.zeros(1, 1), mask=torch.ones(1, 1))
    assert not trm(max_kl=0.05, avg_kl=None)(b).keep.any()  # π_θ/μ = e^0.5, k2 = 0.125 > 0.05
    assert trm(max_kl=0.05, avg_kl=None, source="mismatch")(b).keep.all()  # π_old/μ = 1
    # LN-TRM and SER too: |ρ − 1| = e^0.5 − 1 = 0.6487 > 0.05 on π_θ/μ, 0 on π_old/μ
    assert not ser()(b).keep.any() and ser(source="mismatch")(b).keep.all()
    b2 = b.replace(logp=torch.tensor([[0.5, 0.0]]), old_logp=torch.zeros(1, 2), rollout_logp=torch.zeros(1, 2), mask=torch.ones(1, 2))
    assert not ln_trm()(b2).keep.any() and ln_trm(source="mismatch")(b2).keep.all()  # W/Z = 0.6487 (w = (·, 0))


def test_trm_avg_test_sees_a_catastrophic_token_and_drops_an_infinite_one():
    # T = 100, one token with log(π/μ) = −40: k3 = e^−40 − 1 + 40 = 39, mean 39/100 = 0.39 > 0.3 -> dropped
    # (a k3 clamped at −20 gives 19/100 = 0.19 and keeps it); a −inf log-ratio (KL = ∞) is dropped too
    rollout = torch.zeros(2, 100)
    logp = torch.zeros(2, 100)
    logp[0, 7] = -40.0
    logp[1, 3] = -float("inf")
    b = LogProbBatch(logp=logp, rollout_logp=rollout, mask=torch.ones(2, 100))
    r = trm(max_kl=None, avg_kl=0.3)(b)
    assert r.keep.any(-1).tolist() == [False, False]
    assert r.metrics["trm/avg_divergence_mean"].item() == pytest.approx((0.39 + 0.0) / 2, rel=1e-5)  # row 1: finite r only
    assert trm(max_kl=None, avg_kl=0.4)(b).keep.any(-1).tolist() == [True, False]  # 0.39 ≤ 0.4


def test_presets_repr_and_metrics():
    assert repr(trm()) == "trm(max_kl=0.05, avg_kl=0.001, source='total')"
    assert repr(ln_trm()) == "ln_trm(eps=0.005, delta=0.0001, threshold=0.05, source='total')"
    assert repr(ser()) == "ser(threshold=0.05, source='total')"
    # π_θ/μ (= π_old/μ here): row 0 ρ = (1.1, 1.1) → SER 0.1 > 0.05 dropped; row 1 ρ = (1, 1) → kept
    old = torch.log(torch.tensor([[1.1, 1.1], [1.0, 1.0]]))
    b = LogProbBatch(
        logp=old.clone(),
        old_logp=old,
        rollout_logp=torch.zeros(2, 2),
        mask=torch.ones(2, 2),
    )
    r = ser()(b)
    assert r.keep.tolist() == [[False, False], [True, True]]
    assert _m(r)["ser/masked_seq_frac"] == 0.5 and _m(r)["ser/stat_mean"] == pytest.approx(0.05, rel=1e-5)  # (0.1 + 0)/2
    r = ln_trm(eps=0.5, delta=1.0)(b)  # T = 2: w = (0.5, 0) → W/Z = 0.1 for row 0
    assert r.keep.tolist() == [[False, False], [True, True]]
    assert _m(r)["ln_trm/stat_mean"] == pytest.approx(0.05, rel=1e-5)


@settings(max_examples=30, deadline=None)
@given(token_batches(), st.integers(0, 2**31 - 1))
def test_presets_never_nan_with_nonfinite_inputs(batch, seed):
    r, m = batch
    g = torch.Generator().manual_seed(seed)
    hit = torch.rand(r.shape, generator=g) < 0.2
    bad = torch.tensor([NAN, INF, -INF])[torch.randint(0, 3, r.shape, generator=g)]
    old = torch.where(hit, bad, r)
    b = LogProbBatch(logp=old.clone(), old_logp=old, rollout_logp=torch.zeros_like(r), mask=m, token_divergence=None)
    for c in (trm(), ln_trm(), ser(), trm(source="mismatch"), ln_trm(source="mismatch"), ser(source="mismatch")):
        res = c(b)
        assert all(bool(torch.isfinite(v)) for v in res.metrics.values())
        bad_rows = (hit & m).any(-1)
        assert not res.keep[bad_rows].any()  # a sequence with an undefined ratio is never kept
    bd = LogProbBatch(logp=torch.zeros_like(r), mask=m, token_divergence=torch.where(hit, bad, r.abs()))
    res = trm()(bd)
    assert all(bool(torch.isfinite(v)) for v in res.metrics.values())
    assert not res.keep[(hit & m).any(-1)].any()
