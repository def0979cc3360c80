"""Divergence-gated importance sampling (``gated_is``, OpenRLHF's ``is_correction_*``): hand-computed numbers, the
corrections it coincides with (IcePop, TIS, MIS's sequence masks), properties, and its argument errors.
(``test_gated_openrlhf.py`` compares it with OpenRLHF 0.11.2's own function; ``test_base.py`` runs the properties every
correction has — on-policy identity, padding, non-finite inputs, bf16, chain == one by one — on several settings.)"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy import build_correction, chain, icepop, mis, tis
from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import DROP_NAMES, CorrectionResult
from offpolicy.corrections.gated import gate, gate_bounds, gated_is

LN = math.log


def _batch(mu, old, mask=None):
    """μ and π_old as probabilities of the sampled tokens; π_θ = π_old."""
    old_t = torch.tensor(old, dtype=torch.float64).log().float()
    mu_t = torch.tensor(mu, dtype=torch.float64).log().float()
    m = torch.ones_like(old_t) if mask is None else torch.tensor(mask)
    return LogProbBatch(logp=old_t.clone(), old_logp=old_t, rollout_logp=mu_t, mask=m,
                        advantages=torch.ones(old_t.shape[0]))


# ---------------------------------------------------------------------------------------------------------------------
# Hand-computed numbers
# ---------------------------------------------------------------------------------------------------------------------


def test_ratio_gate_at_token_level_by_hand():
    # ρ = π_old/μ = (0.5/0.5, 0.6/0.2, 0.1/0.4, 0.3/0.2) = (1, 3, 0.25, 1.5); band [0.5, 2] keeps tokens 0 and 3
    b = _batch([[0.5, 0.2, 0.4, 0.2]], [[0.5, 0.6, 0.1, 0.3]])
    r = gated_is(lower=0.5, upper=2.0)(b)
    assert r.keep.tolist() == [[True, False, False, True]]
    torch.testing.assert_close(r.weights, torch.tensor([[1.0, 0.0, 0.0, 1.5]]))
    m = {k.split("/")[1]: v.item() for k, v in r.metrics.items()}
    assert m["masked_frac"] == 0.5 and m["kept_frac"] == 0.5 and m["capped_frac"] == 0.0
    assert m["weight_mean"] == pytest.approx((1 + 1.5) / 4)  # 0.625
    assert m["stat_mean"] == pytest.approx((1 + 3 + 0.25 + 1.5) / 4)  # 1.4375: the ratio itself
    assert m["stat_max"] == pytest.approx(3.0) and m["nonfinite_frac"] == 0.0


def test_binary_kl_gate_at_sequence_level_keeps_each_tokens_own_weight():
    # row 0: μ = (0.5, 0.5), π_old = (0.5, 0.25): binary KL rollout first = (0, KL((½,½)‖(¼,¾)))
    #        KL = 0.5·ln(0.5/0.25) + 0.5·ln(0.5/0.75) = 0.346574 − 0.202733 = 0.143841; row mean 0.0719205
    # row 1: μ = π_old = (0.9, 0.8): 0
    b = _batch([[0.5, 0.5], [0.9, 0.8]], [[0.5, 0.25], [0.9, 0.8]])
    loose = gated_is(level="geometric", gating="binary_kl", upper=0.1)(b)
    assert loose.keep.all()
    torch.testing.assert_close(loose.weights, torch.tensor([[1.0, 0.5], [1.0, 1.0]]))  # ρ_t = (1, 0.25/0.5)
    assert loose.metrics["gated_is/stat_mean"].item() == pytest.approx(0.0719205 / 2, rel=1e-5)
    assert loose.metrics["gated_is/stat_max"].item() == pytest.approx(0.0719205, rel=1e-5)
    tight = gated_is(level="geometric", gating="binary_kl", upper=0.05)(b)  # 0.0719 > 0.05: row 0 dropped
    assert tight.keep.tolist() == [[False, False], [True, True]]
    assert tight.metrics["gated_is/masked_seq_frac"].item() == 0.5  # one of two sequences
    assert tight.metrics["gated_is/kept_frac"].item() == 0.5  # two of four tokens
    # the sum over the sequence (level="sequence"): 0.143841 > 0.1 drops row 0 at the looser bound
    assert gated_is(level="sequence", gating="binary_kl", upper=0.1)(b).keep.tolist() == [[False, False], [True, True]]


def test_tv_gate_by_hand_and_openrlhfs_own_examples():
    # OpenRLHF's test: |π − μ| = (0.6 − 0.5, 0.52 − 0.5) = (0.1, 0.02); δ = 0.05 drops the first, keeps the second
    # with its weight 0.52/0.5 = 1.04
    b = _batch([[0.5, 0.5]], [[0.6, 0.52]])
    r = gated_is(gating="tv", upper=0.05)(b)
    assert r.keep.tolist() == [[False, True]]
    torch.testing.assert_close(r.weights, torch.tensor([[0.0, 1.04]]))
    # OpenRLHF's binary-KL example: π = 1 (clamped to 1 − 1e-6), μ = 1/3: KL((⅓, ⅔) ‖ (1 − 1e-6, 1e-6))
    # = ⅓·ln(⅓/(1 − 1e-6)) + ⅔·ln(⅔/1e-6) = −0.366204 + ⅔·13.410045 = −0.366204 + 8.940030 = 8.573827 > 0.05:
    # dropped; the matched token kept
    b = _batch([[1 / 3, 0.5]], [[1.0, 0.5]])
    r = gated_is(gating="binary_kl", upper=0.05)(b)
    assert r.keep.tolist() == [[False, True]]
    assert r.metrics["gated_is/stat_max"].item() == pytest.approx(8.573827, rel=1e-6)


def test_product_and_geometric_levels_of_the_ratio_by_hand():
    # log ρ = (0.5, 0.5): product e¹ = 2.718 > 2 → dropped; geometric e^0.5 = 1.649 ≤ 2 → kept with ρ_t = e^0.5 each
    b = LogProbBatch(logp=torch.zeros(1, 2), old_logp=torch.zeros(1, 2), rollout_logp=torch.full((1, 2), -0.5),
                     mask=torch.ones(1, 2))
    assert not gated_is(level="sequence", lower=0.5, upper=2.0)(b).keep.any()
    geo = gated_is(level="geometric", lower=0.5, upper=2.0)(b)
    assert geo.keep.all()
    torch.testing.assert_close(geo.weights, torch.full((1, 2), math.exp(0.5)))
    assert geo.metrics["gated_is/stat_mean"].item() == pytest.approx(math.exp(0.5))


def test_truncate_clamps_the_token_ratio_and_counts_what_it_moved():
    # ρ = (1, 3, 0.25, 1.5) clamped into [0.5, 2] = (1, 2, 0.5, 1.5); two of four moved (OpenRLHF's is_filter_ratio):
    # capped, none masked
    b = _batch([[0.5, 0.2, 0.4, 0.2]], [[0.5, 0.6, 0.1, 0.3]])
    r = gated_is(mode="truncate", lower=0.5, upper=2.0)(b)
    assert r.keep.all()
    torch.testing.assert_close(r.weights, torch.tensor([[1.0, 2.0, 0.5, 1.5]]))
    m = {k: v.item() for k, v in r.metrics.items()}
    assert (m["gated_is/capped_frac"], m["gated_is/masked_frac"], m["gated_is/kept_frac"]) == (0.5, 0.0, 0.5)


def test_padding_and_undefined_tokens(monkeypatch):
    monkeypatch.setenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT", "none")  # non-finite μ on purpose: the paths past the limit
    # padding (mask 0) is neither a unit nor counted; a NaN μ on a valid token drops it (token level) or its sequence
    b = LogProbBatch(logp=torch.zeros(2, 3), old_logp=torch.zeros(2, 3),
                     rollout_logp=torch.tensor([[0.0, float("nan"), 0.0], [0.0, 0.0, float("inf")]]),
                     mask=torch.tensor([[1, 1, 1], [1, 1, 0]]))
    tok = gated_is()(b)
    assert tok.keep.tolist() == [[True, False, True], [True, True, False]]
    assert tok.metrics["gated_is/masked_frac"].item() == pytest.approx(1 / 5)  # the NaN token of five valid ones
    assert tok.metrics["gated_is/nonfinite_frac"].item() == pytest.approx(1 / 5)
    seq = gated_is(level="geometric", gating="binary_kl")(b)
    assert seq.keep.tolist() == [[False, False, False], [True, True, False]]
    assert seq.metrics["gated_is/masked_seq_frac"].item() == 0.5
    assert seq.metrics["gated_is/masked_frac"].item() == pytest.approx(3 / 5)  # row 0's three valid tokens
    assert all(bool(torch.isfinite(v)) for v in seq.metrics.values())


# ---------------------------------------------------------------------------------------------------------------------
# Where it coincides with an existing correction
# ---------------------------------------------------------------------------------------------------------------------

batches = st.tuples(st.integers(0, 2**31 - 1), st.integers(1, 5), st.integers(1, 12), st.sampled_from([0.05, 0.5, 2.0]))
bands = st.sampled_from([(0.5, 5.0), (0.8, 1.25), (0.9, 1.1), (None, 2.0), (0.5, None), (1.0, 1.0)])


@settings(max_examples=40, deadline=None)
@given(batches, bands)
def test_token_ratio_gate_is_icepop_and_truncation_is_tis(random_batch, shape, band):
    batch = random_batch(*shape)
    lower, upper = band
    default = gated_is()(batch)  # OpenRLHF's defaults: token, mask, ratio, [0.5, 5] = IcePop
    ice = icepop()(batch)
    assert torch.equal(default.keep, ice.keep) and torch.equal(default.weights, ice.weights)
    if not lower and upper is None:
        return
    g = gated_is(lower=lower, upper=upper)(batch)
    i = icepop(lower=lower if lower is not None else 0.0, upper=upper if upper is not None else 1e30)(batch)
    assert torch.equal(g.keep, i.keep) and torch.equal(g.weights, i.weights)
    for name in DROP_NAMES:
        assert g.metrics[f"gated_is/{name}"].item() == pytest.approx(i.metrics[f"icepop/{name}"].item()), name
    t = gated_is(mode="truncate", lower=lower, upper=upper)(batch)
    tt = tis(lower=lower, upper=upper)(batch)
    assert torch.equal(t.keep, tt.keep) and torch.equal(t.weights, tt.weights)
    for name in DROP_NAMES:
        assert t.metrics[f"gated_is/{name}"].item() == pytest.approx(tt.metrics[f"tis/{name}"].item()), name


@settings(max_examples=40, deadline=None)
@given(batches, bands, st.sampled_from(["geometric", "sequence"]))
def test_sequence_ratio_gate_drops_what_mis_drops_and_keeps_the_token_weights(random_batch, shape, band, level):
    # the same sequences as mis(level=...) (OpenRLHF's seq-mask-tis), but each kept token weighs its own ρ_t
    batch = random_batch(*shape)
    lower, upper = band
    if not lower and upper is None:
        return
    g = gated_is(level=level, lower=lower, upper=upper)(batch)
    m = mis(level=level, lower=lower, upper=upper)(batch)
    assert torch.equal(g.keep, m.keep)
    rho = torch.exp(batch.old_logp - batch.rollout_logp)
    torch.testing.assert_close(g.weights, torch.where(g.keep, rho, 0.0))


# ---------------------------------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------------------------------

SETTINGS = [dict(), dict(level="geometric"), dict(level="sequence", lower=0.2, upper=5.0),
            dict(gating="binary_kl"), dict(gating="binary_kl", level="geometric", upper=1e-3),
            dict(gating="tv", upper=0.01), dict(gating="tv", level="geometric", upper=0.05),
            dict(mode="truncate", lower=0.8, upper=1.2), dict(source="total", gating="binary_kl")]


@settings(max_examples=30, deadline=None)
@given(batches, st.sampled_from(SETTINGS))
def test_keep_is_inside_the_mask_and_weights_are_the_kept_ratios(random_batch, shape, kw):
    batch = random_batch(*shape)
    r = gated_is(**kw)(batch)
    assert not bool((r.keep & ~batch.bool_mask).any())
    assert bool(torch.isfinite(r.weights).all()) and bool((r.weights >= 0).all())
    assert bool((r.weights[~r.keep] == 0).all())
    assert r.weight_level == "token" and not r.weights.requires_grad
    assert all(bool(torch.isfinite(v)) for v in r.metrics.values())
    assert 0.0 <= r.metrics["gated_is/masked_frac"].item() <= 1.0


@settings(max_examples=30, deadline=None)
@given(batches, st.sampled_from(["binary_kl", "tv"]), st.sampled_from(["token", "geometric", "sequence"]))
def test_a_looser_bound_keeps_a_superset(random_batch, shape, gating, level):
    batch = random_batch(*shape)
    tight = gated_is(gating=gating, level=level, upper=1e-3)(batch).keep
    loose = gated_is(gating=gating, level=level, upper=1e-1)(batch).keep
    assert not bool((tight & ~loose).any())


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([torch.float32, torch.bfloat16]), st.sampled_from(SETTINGS))
def test_nearby_policies_are_never_rejected(seed, dtype, kw):
    # |log π_old − log μ| ≤ 1e-6 with p near 0, ½ and 1: every divergence gate keeps every token (the exact binary KL
    # is ~1e-13, never the float32 −4e-8 that OpenRLHF's [0, δ] rejected); a ratio band around 1 keeps them too
    g = torch.Generator().manual_seed(seed)
    p = torch.tensor([1e-5, 1e-3, 0.3, 0.5, 0.9, 1 - 1e-4, 1 - 1e-6]).repeat(4, 1)
    mu = p.log().to(dtype)
    old = (mu.float() + 1e-6 * (2 * torch.rand(mu.shape, generator=g) - 1)).clamp(max=0.0).to(dtype)
    b = LogProbBatch(logp=old, old_logp=old, rollout_logp=mu, mask=torch.ones(mu.shape))
    r = gated_is(**kw)(b)
    assert bool(r.keep.all()) and r.metrics["gated_is/masked_frac"].item() == 0.0, kw


# ---------------------------------------------------------------------------------------------------------------------
# The gate function, names and errors
# ---------------------------------------------------------------------------------------------------------------------


def test_the_gate_function_equals_the_correction():
    b = _batch([[0.5, 0.5], [0.9, 0.8]], [[0.5, 0.25], [0.9, 0.8]])
    g = gate(b.rollout_logp, b.old_logp, b.mask, level="geometric", gating="binary_kl", upper=0.05)
    r = gated_is(level="geometric", gating="binary_kl", upper=0.05)(b)
    assert torch.equal(g.keep, r.keep) and torch.equal(g.weights, r.weights)
    assert g.statistic.shape == (2, 1)


def test_by_name_and_in_a_chain():
    spec = {"name": "gated_is", "level": "geometric", "gating": "binary_kl", "upper": 5e-3}
    c = build_correction(spec)
    assert repr(c) == ("gated_is(level='geometric', mode='mask', gating='binary_kl', lower=None, upper=0.005, "
                       "source='mismatch')")
    b = _batch([[0.5, 0.5], [0.9, 0.8]], [[0.5, 0.25], [0.9, 0.8]])
    both = build_correction([spec, {"name": "icepop"}])(b)
    one_by_one = CorrectionResult.identity(b).then(c(b)).then(icepop()(b))
    assert torch.equal(both.keep, one_by_one.keep) and torch.equal(both.weights, one_by_one.weights)
    assert "gated_is/masked_frac" in both.metrics
    # two gates need two names (their metrics would collide)
    two = chain(gated_is(), gated_is(gating="tv", upper=0.1, name="tv_gate"))(b)
    assert {"gated_is/masked_frac", "tv_gate/masked_frac"} <= set(two.metrics)


@pytest.mark.parametrize(("kw", "match"), [
    (dict(level="seq"), r"level must be one of .* \(OpenRLHF's 'seq' is the per-sequence mean: 'geometric'\)"),
    (dict(mode="clip"), r"mode must be one of .* \(OpenRLHF's 'clip' is 'truncate'\)"),
    (dict(gating="kl"), r"gating must be one of \('ratio', 'binary_kl', 'tv'\)"),
    (dict(mode="truncate", level="geometric"), r"mode: 'truncate' clamps the token ratio"),
    (dict(mode="truncate", gating="binary_kl"), r"mode: 'truncate' clamps the token ratio"),
    (dict(gating="binary_kl", lower=0.5, upper=5.0), r"lower: gating='binary_kl' is bounded from above only"),
    (dict(gating="tv"), r"upper: gating='tv' has no default bound"),
    (dict(lower=2.0, upper=1.0), r"lower must be <= upper"),
    (dict(lower=0.0), r"upper: a ratio gate with lower=0 and no upper bound keeps every token"),
    (dict(upper=float("nan")), r"upper must be finite"),
    (dict(upper=-1.0), r"upper must be > 0"),
    (dict(source="bypass"), r"source must be one of"),
])
def test_bad_arguments_name_the_argument(kw, match):
    with pytest.raises(ValueError, match=match) as err:
        gated_is(**kw)
    assert "\n" not in str(err.value)


def test_bounds_resolve_to_the_gatings_defaults():
    assert gate_bounds("ratio", None, None) == (0.5, 5.0)  # OpenRLHF's default threshold
    assert gate_bounds("binary_kl", None, None) == (None, 5e-3)  # FlashREINFORCE's quick start
    assert gate_bounds("binary_kl", 0.0, 0.01) == (None, 0.01)  # OpenRLHF's [0, δ]
    assert gate_bounds("ratio", 0.0, 2.0) == (None, 2.0)  # ρ ≥ 0: lower 0 is no bound


def test_needs_the_rollout_log_probs():
    b = LogProbBatch(logp=torch.zeros(1, 2), mask=torch.ones(1, 2))
    with pytest.raises(ValueError, match="gated_is needs rollout_logp"):
        gated_is()(b)
    assert LN(1.0) == 0.0


def test_its_masked_fraction_under_each_frameworks_name(random_batch):
    # what each framework calls the masked fraction of the applied correction is gated_is/masked_frac (at token
    # level in mask mode also OpenRLHF's is_filter_ratio; nothing is capped, so it is 1 − gated_is/kept_frac)
    from offpolicy import offpolicy_metrics

    batch = random_batch(3, 4, 12, 0.5)
    r = gated_is(gating="binary_kl", upper=1e-3)(batch)
    masked = r.metrics["gated_is/masked_frac"].item()
    assert 0.0 < masked < 1.0
    assert 1.0 - r.metrics["gated_is/kept_frac"].item() == pytest.approx(masked)
    for naming, key in (("verl", "rollout_corr/rollout_rs_masked_fraction"), ("swift", "rollout_correction/masked_frac"),
                        ("trl", "sampling/masked_frac"), ("openrlhf", "train/masked_frac")):
        m = offpolicy_metrics(batch.old_logp, batch.rollout_logp, batch.mask, r, naming=naming)
        assert m[key].item() == pytest.approx(masked), naming
