"""Tests for offpolicy.corrections.importance: TIS / MIS weights, bands, normalisation, presets and their metrics."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.importance import (
    behaviour_log_ratio,
    check_threshold,
    geo_mask,
    icepop,
    importance_correction,
    importance_weights,
    mis,
    tis,
)

NAN, INF = float("nan"), float("inf")
LN = math.log
E = math.e


def close(t: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(t, torch.tensor(expected, dtype=t.dtype), atol=atol, rtol=1e-5)


@st.composite
def log_ratio_batches(draw, max_b: int = 4, max_t: int = 10):
    b, t = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    r = draw(st.sampled_from([0.05, 0.5, 2.0])) * torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) > draw(st.sampled_from([0.0, 0.3, 0.7]))
    return r, mask


bands = st.sampled_from([(None, 2.0), (0.5, None), (0.5, 2.0), (0.9, 1.1), (1.0, 1.0), (0.2, 5.0)])
levels = st.sampled_from(["token", "sequence", "geometric"])
modes = st.sampled_from(["truncate", "mask"])


# ---------------------------------------------------------------------------------------------------------------------
# importance_weights: hand-computed numbers
# ---------------------------------------------------------------------------------------------------------------------

R = torch.tensor([[0.0, LN(3.0), LN(0.25), LN(1.5)]])  # ρ = 1, 3, 0.25, 1.5
M = torch.ones(1, 4)


def test_token_truncate_two_sided():
    w, keep, raw = importance_weights(R, M, mode="truncate", lower=0.5, upper=2.0)
    close(raw, [[1.0, 3.0, 0.25, 1.5]])
    close(w, [[1.0, 2.0, 0.5, 1.5]])  # clamp(3, ·, 2) = 2, clamp(0.25, 0.5, ·) = 0.5
    assert keep.all()


def test_token_truncate_upper_only_and_no_bounds():
    w, _, _ = importance_weights(R, M, upper=2.0)
    close(w, [[1.0, 2.0, 0.25, 1.5]])
    w, _, _ = importance_weights(R, M)  # plain IS: w = ρ
    close(w, [[1.0, 3.0, 0.25, 1.5]])


def test_token_mask_two_sided():
    w, keep, raw = importance_weights(R, M, mode="mask", lower=0.5, upper=2.0)
    assert keep.tolist() == [[True, False, False, True]]  # 3 > 2 and 0.25 < 0.5 are dropped
    close(w, [[1.0, 0.0, 0.0, 1.5]])
    close(raw, [[1.0, 3.0, 0.25, 1.5]])  # raw is before masking


def test_sequence_level_is_the_product():
    r = torch.tensor([[LN(2.0), LN(3.0)], [LN(0.5), LN(0.5)]])  # products 6 and 0.25
    m = torch.ones(2, 2)
    w, keep, raw = importance_weights(r, m, level="sequence", upper=4.0)
    close(raw, [[6.0, 6.0], [0.25, 0.25]])
    close(w, [[4.0, 4.0], [0.25, 0.25]])  # min(6, 4) = 4 on every token of row 0
    w, keep, _ = importance_weights(r, m, level="sequence", mode="mask", lower=0.3, upper=4.0)
    assert keep.tolist() == [[False, False], [False, False]]  # 6 > 4, 0.25 < 0.3


def test_geometric_level_is_the_length_normalised_mean():
    r = torch.tensor([[LN(2.0), LN(8.0), 5.0]])
    m = torch.tensor([[1, 1, 0]])
    # geo = exp((ln 2 + ln 8)/2) = sqrt(16) = 4 on valid tokens; padding: weight 0, keep False, raw exp(0) = 1
    w, keep, raw = importance_weights(r, m, level="geometric", mode="mask", upper=5.0)
    close(w, [[4.0, 4.0, 0.0]])
    assert keep.tolist() == [[True, True, False]]
    close(raw, [[4.0, 4.0, 1.0]])
    w, keep, _ = importance_weights(r, m, level="geometric", mode="mask", upper=3.0)
    assert not keep.any()


def test_a_lower_bound_of_zero_is_no_bound():
    # ρ ≥ 0, so lower = 0 never binds (TRL writes vllm_importance_sampling_clip_min=0.0 for "none")
    for mode, upper in (("truncate", 2.0), ("mask", 2.0)):
        got = importance_weights(R, M, mode=mode, lower=0.0, upper=upper)
        want = importance_weights(R, M, mode=mode, upper=upper)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="lower"):
        importance_weights(R, M, lower=-0.1)


def test_mask_bounds_are_inclusive():
    r = torch.tensor([[LN(2.0), LN(0.5), 0.0]])
    _, keep, _ = importance_weights(r, torch.ones(1, 3), mode="mask", lower=0.5, upper=2.0)
    assert keep.all()
    _, keep, _ = importance_weights(torch.zeros(1, 2), torch.ones(1, 2), mode="mask", lower=1.0, upper=1.0)
    assert keep.all()  # the degenerate band [1, 1] keeps exactly on-policy tokens


def test_normalize_by_hand():
    w, _, _ = importance_weights(R, M, lower=0.5, upper=2.0, normalize=True)
    # truncated (1, 2, 0.5, 1.5), mean 5/4 = 1.25 → (0.8, 1.6, 0.4, 1.2)
    close(w, [[0.8, 1.6, 0.4, 1.2]])
    w, keep, _ = importance_weights(R, M, mode="mask", lower=0.5, upper=2.0, normalize=True)
    # masked (1, 0, 0, 1.5): mean over the 4 *valid* tokens = 2.5/4 = 0.625 → (1.6, 0, 0, 2.4): the kept tokens make
    # up for the dropped ones (verl's rollout_is_batch_normalize: w / mean_valid(w))
    close(w, [[1.6, 0.0, 0.0, 2.4]])
    padded = torch.tensor([[1, 1, 1, 0]])
    w, _, _ = importance_weights(R, padded, upper=2.0, normalize=True)
    # valid (1, 2, 0.25), mean 3.25/3 = 1.0833 → (0.9231, 1.8462, 0.2308, 0)
    close(w, [[3 / 3.25, 6 / 3.25, 0.75 / 3.25, 0.0]], atol=1e-5)


def test_normalize_at_sequence_level_averages_over_sequences_as_verl():
    # seq 0: one token, ρ = 2; seq 1: three tokens, ρ = 1 (product = geometric here). verl's sequence-level
    # normalisation averages one weight per sequence: (2 + 1)/2 = 1.5 → 2/1.5 = 1.3333, 1/1.5 = 0.6667
    # (a per-token mean would be (2 + 1 + 1 + 1)/4 = 1.25 → 1.6, 0.8)
    r = torch.tensor([[LN(2.0), 0.0, 0.0], [0.0, 0.0, 0.0]])
    m = torch.tensor([[1, 0, 0], [1, 1, 1]])
    for level in ("sequence", "geometric"):
        w, _, _ = importance_weights(r, m, level=level, upper=5.0, normalize=True)
        close(w, [[2 / 1.5, 0.0, 0.0], [1 / 1.5] * 3], atol=1e-6)
    # a dropped sequence counts as 0: mask [0.5, 1.5] drops seq 0 → mean (0 + 1)/2 = 0.5 → seq 1 gets 2
    w, _, _ = importance_weights(r, m, level="sequence", mode="mask", lower=0.5, upper=1.5, normalize=True)
    close(w, [[0.0, 0.0, 0.0], [2.0] * 3])


def test_normalize_skipped_when_mean_tiny():
    r = torch.full((1, 2), -20.0)  # ρ = e^-20 = 2.06e-9 ≤ 1e-8: left as is, not blown up to 1
    w, _, _ = importance_weights(r, torch.ones(1, 2), normalize=True)
    close(w, [[math.exp(-20)] * 2], atol=0)
    # everything dropped: mean 0 → zeros, not NaN
    w, keep, _ = importance_weights(torch.full((1, 2), 3.0), torch.ones(1, 2), mode="mask", upper=2.0, normalize=True)
    assert w.tolist() == [[0.0, 0.0]] and not keep.any()


def test_padding_gets_zero_weight_and_no_keep():
    r = torch.tensor([[0.1, NAN, INF]])
    w, keep, _ = importance_weights(r, torch.tensor([[1, 0, 0]]), upper=2.0)
    close(w, [[math.exp(0.1), 0.0, 0.0]])
    assert keep.tolist() == [[True, False, False]]


def test_nonfinite_valid_token_is_dropped_never_nan():
    r = torch.tensor([[NAN, 0.5, -INF], [INF, 0.0, 0.0], [0.1, 0.2, 0.3]])
    m = torch.ones(3, 3)
    w, keep, raw = importance_weights(r, m, upper=2.0)
    # token level: only the non-finite tokens go
    assert keep.tolist() == [[False, True, False], [False, True, True], [True, True, True]]
    assert bool(torch.isfinite(w).all()) and bool(torch.isfinite(raw).all())
    # sequence levels: a non-finite token makes the whole sequence's ratio undefined
    for level in ("sequence", "geometric"):
        w, keep, _ = importance_weights(r, m, level=level, mode="mask", upper=5.0)
        assert keep.tolist() == [[False] * 3, [False] * 3, [True] * 3]
        assert bool(torch.isfinite(w).all())


def test_huge_log_ratio_is_clamped_before_exp():
    w, keep, raw = importance_weights(torch.tensor([[500.0, -500.0]]), torch.ones(1, 2))
    close(raw, [[math.exp(20.0), math.exp(-20.0)]], atol=0)
    assert bool(torch.isfinite(w).all())


def test_mask_bounds_beyond_the_20_clamp_still_apply():
    # ρ = e^−25 = 1.4e-11 < lower = 1e-10 (log = −23.03): dropped, although the clamped log-ratio −20 is inside;
    # a sequence product e^(10+15) = e^25 > upper = 1e10 (log = 23.03): dropped, although e^20 (clamped) is inside
    _, keep, _ = importance_weights(torch.tensor([[-25.0, 0.0]]), torch.ones(1, 2), mode="mask", lower=1e-10)
    assert keep.tolist() == [[False, True]]
    _, keep, _ = importance_weights(torch.tensor([[10.0, 15.0]]), torch.ones(1, 2), level="sequence", mode="mask",
                                    upper=1e10)
    assert keep.tolist() == [[False, False]]
    _, keep, _ = importance_weights(torch.tensor([[10.0, 5.0]]), torch.ones(1, 2), level="sequence", mode="mask",
                                    upper=1e10)  # e^15 = 3.3e6 inside
    assert keep.tolist() == [[True, True]]


def test_weights_are_detached():
    r = torch.tensor([[0.3, -0.2]], requires_grad=True)
    w, _, raw = importance_weights(r, torch.ones(1, 2), upper=2.0, normalize=True)
    assert not w.requires_grad and not raw.requires_grad


# ---------------------------------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(level="product"), "level"),
        (dict(level="seq"), "level"),
        (dict(mode="clip"), "mode"),
        (dict(upper=0.0), "upper"),
        (dict(upper=-1.0), "upper"),
        (dict(upper=NAN), "upper"),
        (dict(upper=INF), "upper"),
        (dict(upper=True), "upper"),
        (dict(upper="2"), "upper"),
        (dict(lower=-0.5), "lower"),
        (dict(mode="mask", lower=0.0), "mode='mask'"),  # lower = 0 is no bound: no band left
        (dict(lower=-INF), "lower"),
        (dict(lower=3.0, upper=2.0), "lower"),
        (dict(mode="mask"), "mode='mask'"),
        (dict(normalize=1), "normalize"),
    ],
)
def test_bad_arguments_raise_naming_them(kw, name):
    with pytest.raises(ValueError, match=name.replace("(", r"\(")):
        importance_weights(torch.zeros(1, 2), torch.ones(1, 2), **kw)
    # the presets validate at construction, not at first call
    if name in ("lower", "upper", "level", "normalize"):
        with pytest.raises(ValueError, match=name):
            tis(**{k: v for k, v in kw.items() if k != "mode"})


def test_check_threshold_accepts_any_real():
    assert check_threshold("x", 3) == 3.0
    np = pytest.importorskip("numpy")
    assert check_threshold("x", np.float32(0.5)) == 0.5  # numpy scalars are numbers.Real
    assert check_threshold("x", 0, allow_zero=True) == 0.0
    assert check_threshold("x", None, allow_none=True) is None
    with pytest.raises(ValueError, match="^x is required"):
        check_threshold("x", None)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.lists(st.integers(1, 6), max_size=3), st.lists(st.integers(1, 6), max_size=3))
def test_fuzz_wrong_shapes_name_the_argument(b, t, r_shape, m_shape):
    r = torch.zeros(tuple(r_shape))
    m = torch.ones(tuple(m_shape))
    if len(r_shape) != 2:
        with pytest.raises(ValueError, match="^log_ratio"):
            importance_weights(r, m)
    elif tuple(m_shape) != tuple(r_shape):
        with pytest.raises(ValueError, match="^mask"):
            importance_weights(r, m)
    else:
        importance_weights(r, m)


def test_non_tensor_inputs_named():
    with pytest.raises(ValueError, match="^log_ratio"):
        importance_weights([[0.0]], torch.ones(1, 1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^mask"):
        importance_weights(torch.zeros(1, 1), [[1]])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^log_ratio"):
        importance_weights(torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1))


# ---------------------------------------------------------------------------------------------------------------------
# importance_weights: properties
# ---------------------------------------------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(log_ratio_batches(), levels, modes, bands, st.booleans())
def test_on_policy_gives_unit_weights(batch, level, mode, band, normalize):
    _, m = batch
    lo, hi = band
    if mode == "mask" and lo is None and hi is None:
        return
    w, keep, raw = importance_weights(torch.zeros(m.shape), m, level=level, mode=mode, lower=lo, upper=hi, normalize=normalize)
    assert torch.equal(keep, m)
    assert torch.equal(w, m.float())
    assert bool((raw == 1).all())


@settings(max_examples=50, deadline=None)
@given(log_ratio_batches(), levels, modes, bands, st.booleans(), st.integers(0, 2**31 - 1))
def test_padding_never_contributes(batch, level, mode, band, normalize, seed):
    r, m = batch
    lo, hi = band
    if mode == "mask" and lo is None and hi is None:
        return
    g = torch.Generator().manual_seed(seed)
    junk = torch.tensor([NAN, INF, -INF, 1e30, 3.0])[torch.randint(0, 5, r.shape, generator=g)]
    a = importance_weights(r, m, level=level, mode=mode, lower=lo, upper=hi, normalize=normalize)
    b = importance_weights(torch.where(m, r, junk), m, level=level, mode=mode, lower=lo, upper=hi, normalize=normalize)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert not a[1][~m].any() and bool((a[0][~m] == 0).all())


@settings(max_examples=50, deadline=None)
@given(log_ratio_batches(), levels, bands)
def test_truncated_weights_within_band(batch, level, band):
    r, m = batch
    lo, hi = band
    w, keep, raw = importance_weights(r, m, level=level, mode="truncate", lower=lo, upper=hi)
    assert torch.equal(keep, m)  # truncation drops nothing (all values finite here)
    wv = w[m]
    if hi is not None:
        assert bool((wv <= hi).all())
    if lo is not None:
        assert bool((wv >= lo).all())
    # inside the band the weight is the raw ratio, untouched
    inside = m & (raw >= (lo or 0.0)) & (raw <= (hi or INF))
    assert torch.equal(w[inside], raw[inside])


@settings(max_examples=50, deadline=None)
@given(log_ratio_batches(), levels, bands)
def test_masked_weights_are_raw_inside_band_and_zero_outside(batch, level, band):
    r, m = batch
    lo, hi = band
    if lo is None and hi is None:
        return
    w, keep, raw = importance_weights(r, m, level=level, mode="mask", lower=lo, upper=hi)
    assert not (keep & ~m).any()
    assert torch.equal(w[keep], raw[keep])
    assert bool((w[~keep] == 0).all())
    # kept ratios lie in the band (up to one float32 rounding of exp)
    if hi is not None:
        assert bool((raw[keep] <= hi * (1 + 1e-6)).all())
    if lo is not None:
        assert bool((raw[keep] >= lo * (1 - 1e-6)).all())


@settings(max_examples=50, deadline=None)
@given(log_ratio_batches(), modes, bands)
def test_geometric_invariant_to_repeating_a_sequence(batch, mode, band):
    r, m = batch
    lo, hi = band
    if mode == "mask" and lo is None and hi is None:
        return
    w1, k1, raw1 = importance_weights(r, m, level="geometric", mode=mode, lower=lo, upper=hi)
    w2, k2, raw2 = importance_weights(torch.cat([r, r], -1), torch.cat([m, m], -1), level="geometric", mode=mode, lower=lo, upper=hi)
    t = r.shape[1]
    for a, b in ((w1, w2), (raw1, raw2)):
        torch.testing.assert_close(b[:, :t], a, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b[:, t:], a, atol=1e-5, rtol=1e-5)
    # keep can only differ for ratios within float rounding of a bound; the drawn data never sits there
    near = torch.zeros_like(m)
    for bound in (lo, hi):
        if bound is not None:
            near |= (raw1 - bound).abs() < 1e-4 * bound
    assert torch.equal(k2[:, :t][~near], k1[~near])


@settings(max_examples=50, deadline=None)
@given(log_ratio_batches(), bands)
def test_normalized_weights_average_one_over_valid_tokens_or_sequences(batch, band):
    r, m = batch
    lo, hi = band
    for level in ("token", "geometric"):
        for mode in ("truncate", "mask"):
            if mode == "mask" and lo is None and hi is None:
                continue
            w0, _, _ = importance_weights(r, m, level=level, mode=mode, lower=lo, upper=hi)
            w, _, _ = importance_weights(r, m, level=level, mode=mode, lower=lo, upper=hi, normalize=True)
            rows = m.any(-1)
            # one value per valid token, or (sequence levels) the weight of each non-empty sequence
            values = (lambda x: x[m]) if level == "token" else (lambda x, rows=rows: x.amax(-1)[rows])
            if values(w0).double().mean() > 1e-8:
                assert values(w).double().mean().item() == pytest.approx(1.0, rel=1e-5)
            else:
                assert torch.equal(w, w0)  # skipped


@settings(max_examples=30, deadline=None)
@given(log_ratio_batches(), levels, modes, st.sampled_from([torch.bfloat16, torch.float16]))
def test_low_precision_inputs_computed_in_float32(batch, level, mode, dtype):
    r, m = batch
    rl = r.to(dtype)
    out = importance_weights(rl, m, level=level, mode=mode, lower=0.5, upper=2.0, normalize=True)
    ref = importance_weights(rl.float(), m, level=level, mode=mode, lower=0.5, upper=2.0, normalize=True)
    for x, y in zip(out, ref):
        assert x.dtype == y.dtype
        assert torch.equal(x, y)
    assert out[0].dtype == torch.float32 and out[2].dtype == torch.float32


@settings(max_examples=50, deadline=None)
@given(log_ratio_batches(), levels, modes, st.booleans(), st.integers(0, 2**31 - 1))
def test_nonfinite_valid_positions_never_give_nan(batch, level, mode, normalize, seed):
    r, m = batch
    g = torch.Generator().manual_seed(seed)
    hit = torch.rand(r.shape, generator=g) < 0.25
    bad = torch.tensor([NAN, INF, -INF])[torch.randint(0, 3, r.shape, generator=g)]
    w, keep, raw = importance_weights(torch.where(hit, bad, r), m, level=level, mode=mode, upper=2.0, normalize=normalize)
    assert bool(torch.isfinite(w).all()) and bool(torch.isfinite(raw).all())
    assert not (keep & hit & m).any()  # a token with an undefined ratio is never kept


@settings(max_examples=50, deadline=None)
@given(log_ratio_batches())
def test_sequence_level_equals_product_of_token_ratios(batch):
    r, m = batch
    r = r.clamp(-0.5, 0.5)  # stay inside the ±20 clamp
    w, _, _ = importance_weights(r, m, level="sequence")
    tok, _, _ = importance_weights(r, m, level="token")
    prod = torch.where(m, tok.double(), torch.ones_like(tok, dtype=torch.float64)).prod(dim=-1, keepdim=True)
    expected = torch.where(m, prod.expand_as(tok), torch.zeros_like(prod).expand_as(tok))
    torch.testing.assert_close(w.double(), expected, rtol=1e-4, atol=0)


# ---------------------------------------------------------------------------------------------------------------------
# presets
# ---------------------------------------------------------------------------------------------------------------------


def test_reprs():
    # chain()'s doctest in base.py relies on exactly these two
    assert repr(tis(upper=2.0)) == "tis(level='token', lower=None, upper=2.0, normalize=False, source='mismatch')"
    assert repr(icepop()) == "icepop(lower=0.5, upper=5.0, source='mismatch')"
    assert repr(tis(upper=2)) == repr(tis(upper=2.0))
    assert repr(mis(3, level="sequence", lower=0.1, source="total")) == (
        "mis(level='sequence', lower=0.1, upper=3.0, normalize=False, source='total')"
    )
    assert repr(geo_mask(lower=0.9, upper=1.1)) == "geo_mask(lower=0.9, upper=1.1, source='mismatch')"
    assert repr(importance_correction("geometric", "mask", upper=2.0, name="swift")) == (
        "swift(level='geometric', mode='mask', lower=None, upper=2.0, normalize=False, source='mismatch')"
    )


def test_preset_validation():
    with pytest.raises(ValueError, match="source"):
        tis(source="bypass")
    with pytest.raises(ValueError, match="name"):
        importance_correction("token", "truncate", name="")
    with pytest.raises(ValueError, match="lower"):
        icepop(lower=6.0)  # lower > upper
    with pytest.raises(ValueError, match="mode='mask'"):
        mis(upper=None)
    with pytest.raises(ValueError, match="mode"):
        importance_correction("token", "drop")


def test_source_mismatch_vs_total_by_hand():
    b = LogProbBatch(
        logp=torch.tensor([[-1.0]]), old_logp=torch.tensor([[-1.5]]), rollout_logp=torch.tensor([[-2.0]]), mask=torch.ones(1, 1)
    )
    # mismatch: π_old/μ = exp(-1.5 + 2) = e^0.5 = 1.6487 (under the cap); total: π_θ/μ = exp(1) = 2.718 → capped at 2
    close(tis(upper=2.0)(b).weights, [[math.exp(0.5)]])
    close(tis(upper=2.0, source="total")(b).weights, [[2.0]])
    # without old_logp, "mismatch" falls back to π_θ (detached): e^1 → 2
    close(tis(upper=2.0)(b.replace(old_logp=None)).weights, [[2.0]])


def test_preset_requires_rollout_logp():
    b = LogProbBatch(logp=torch.zeros(1, 2), old_logp=torch.zeros(1, 2), mask=torch.ones(1, 2))
    for c in (tis(), mis(), geo_mask(), icepop(), importance_correction("token", "truncate")):
        with pytest.raises(ValueError, match="rollout_logp"):
            c(b)


def test_behaviour_log_ratio_detaches():
    logp = torch.zeros(1, 2, requires_grad=True)
    b = LogProbBatch(logp=logp, rollout_logp=torch.zeros(1, 2), mask=torch.ones(1, 2))
    assert not behaviour_log_ratio(b, "total", "x").requires_grad
    assert not behaviour_log_ratio(b, "mismatch", "x").requires_grad


def _metrics(result, name):
    return {k.split("/", 1)[1]: v.item() for k, v in result.metrics.items() if k.startswith(name + "/")}


def test_tis_metrics_by_hand():
    # π_old/μ = 1, e, 1/e on valid tokens; a fourth padded token with junk
    b = LogProbBatch(
        logp=torch.zeros(1, 4),
        rollout_logp=torch.tensor([[0.0, -1.0, 1.0, NAN]]),
        mask=torch.tensor([[1, 1, 1, 0]]),
    )
    m = _metrics(tis(upper=2.0)(b), "tis")
    assert m["raw_ratio_mean"] == pytest.approx((1 + E + 1 / E) / 3, rel=1e-6)  # 1.3621, before truncation
    assert m["raw_ratio_max"] == pytest.approx(E, rel=1e-6)  # TRL would log 2 here
    assert m["raw_ratio_min"] == pytest.approx(1 / E, rel=1e-6)
    assert m["weight_mean"] == pytest.approx((1 + 2 + 1 / E) / 3, rel=1e-6)  # 1.1226
    assert m["capped_frac"] == pytest.approx(1 / 3)  # only e was changed
    assert m["kept_frac"] == pytest.approx(2 / 3) and m["masked_frac"] == 0.0
    assert m["nonfinite_frac"] == 0.0  # the NaN is padding


def test_mis_and_icepop_metrics_by_hand():
    b = LogProbBatch(logp=torch.zeros(1, 4), rollout_logp=torch.tensor([[0.0, -1.0, 1.0, -2.0]]), mask=torch.ones(1, 4))
    # ρ = 1, e = 2.718, 1/e = 0.368, e² = 7.389
    m = _metrics(mis(upper=2.0, lower=0.5)(b), "mis")
    assert m["kept_frac"] == 0.25 and m["masked_frac"] == 0.75 and m["capped_frac"] == 0.0  # only ρ = 1 in [0.5, 2]
    assert m["weight_mean"] == pytest.approx(0.25)  # (1 + 0 + 0 + 0)/4
    r = icepop()(b)
    assert r.keep.tolist() == [[True, True, False, False]]  # [0.5, 5] keeps 1 and e
    close(r.weights, [[1.0, E, 0.0, 0.0]])
    m = _metrics(r, "icepop")
    assert m["kept_frac"] == 0.5 and m["masked_frac"] == 0.5 and m["raw_ratio_max"] == pytest.approx(E**2, rel=1e-6)


def test_nonfinite_metric_and_no_nan(monkeypatch):
    monkeypatch.setenv("OFFPOLICY_MAX_NONFINITE_ROLLOUT", "none")  # non-finite μ on purpose: the paths past the limit
    logp, mu = torch.tensor([[0.5, NAN, 0.0, 0.3]]), torch.tensor([[0.0, 0.0, -INF, 0.0]])
    b = LogProbBatch(logp=logp, rollout_logp=mu, mask=torch.ones(1, 4))
    r = tis(upper=10.0)(b)
    m = _metrics(r, "tis")
    # NaN - 0 = NaN and 0 - (-inf) = +inf: 2 of 4 valid tokens non-finite, dropped
    assert m["nonfinite_frac"] == 0.5 and m["kept_frac"] == 0.5 and m["masked_frac"] == 0.5
    # raw statistics only over the defined ratios e^0.5 = 1.6487 and e^0.3 = 1.3499 (not the placeholder 1 of the others)
    assert m["raw_ratio_min"] == pytest.approx(math.exp(0.3), rel=1e-6)
    assert m["raw_ratio_mean"] == pytest.approx((math.exp(0.5) + math.exp(0.3)) / 2, rel=1e-6)
    assert r.keep.tolist() == [[True, False, False, True]]
    assert all(math.isfinite(v) for v in m.values())
    r = geo_mask(lower=0.5, upper=2.0)(b)
    assert not r.keep.any()  # the geometric ratio of this sequence is undefined


def test_geo_mask_uses_geometric_level():
    # row 0: log-ratios (0.3, -0.1) → geo exp(0.1) = 1.105; row 1: (0.05, 0.05) → 1.051
    b = LogProbBatch(logp=torch.tensor([[0.3, -0.1], [0.05, 0.05]]), rollout_logp=torch.zeros(2, 2), mask=torch.ones(2, 2))
    r = geo_mask(lower=0.95, upper=1.08)(b)
    assert r.keep.tolist() == [[False, False], [True, True]]
    close(r.weights, [[0.0, 0.0], [math.exp(0.05)] * 2])
