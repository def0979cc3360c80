"""Tests for offpolicy.ratios: masked reductions, log-ratios, aggregation levels, three-policy decomposition."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.ratios import (
    LEVELS,
    LOG_RATIO_BOUND,
    aggregate_log_ratio,
    as_mask,
    count_nonfinite,
    decompose_log_ratio,
    log_ratio,
    masked_count,
    masked_fill_invalid,
    masked_max,
    masked_mean,
    masked_min,
    masked_sum,
    nonfinite_rows,
    per_sequence,
    sequence_log_ratio,
)

NAN, INF = float("nan"), float("inf")


def close(t: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(t, torch.tensor(expected, dtype=t.dtype), atol=atol, rtol=1e-5)


@st.composite
def token_batches(draw, max_b: int = 4, max_t: int = 9, scale: float = 3.0):
    """(x [B,T] float32, mask [B,T] bool) from a drawn seed: fast, and shapes/masks still vary."""
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = scale * torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) > draw(st.sampled_from([0.0, 0.3, 0.7]))
    return x, mask


def corrupt_padding(x: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    """Same tensor with arbitrary values (incl. NaN / ±inf / huge) written into the masked positions."""
    g = torch.Generator().manual_seed(seed)
    junk = torch.tensor([NAN, INF, -INF, 1e30, -1e30, 7.0])[torch.randint(0, 6, x.shape, generator=g)]
    return torch.where(mask, x, junk)


# ---------------------------------------------------------------------------------------------------------------------
# masks and masked reductions: hand-computed numbers
# ---------------------------------------------------------------------------------------------------------------------


def test_as_mask_accepts_bool_int_float():
    b = torch.tensor([[True, False]])
    assert as_mask(b) is b  # no copy for bool masks
    assert as_mask(torch.tensor([[1, 0]])).tolist() == [[True, False]]
    assert as_mask(torch.tensor([[1.0, 0.0]])).tolist() == [[True, False]]


def test_masked_fill_invalid_replaces_padding_and_nonfinite():
    x = torch.tensor([[1.0, NAN, INF, -INF, 5.0]], dtype=torch.bfloat16)
    m = torch.tensor([[1, 1, 1, 1, 0]])
    out = masked_fill_invalid(x, m, value=-1.0)
    assert out.dtype == torch.float32
    assert out.tolist() == [[1.0, -1.0, -1.0, -1.0, -1.0]]


def test_count_nonfinite_counts_only_valid_positions():
    x = torch.tensor([[NAN, INF, 1.0], [-INF, 2.0, NAN]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # valid non-finite: (0,0) NaN, (0,1) inf, (1,0) -inf → 3; (1,2) NaN is padding
    assert count_nonfinite(x, m).item() == 3.0


def test_masked_sum_count_mean_by_hand():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, NAN, 4.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert masked_sum(x, m, dim=-1).tolist() == [3.0, 7.0]  # 1+2 ; 3+0(NaN)+4
    assert masked_sum(x, m).item() == 10.0
    assert masked_count(m, dim=-1).tolist() == [2.0, 3.0]
    assert masked_count(m).item() == 5.0
    # means: 3/2 = 1.5 ; 7/3 = 2.3333 (the NaN still counts in the denominator, as a 0)
    assert masked_mean(x, m, dim=-1).tolist() == pytest.approx([1.5, 7.0 / 3.0])
    assert masked_mean(x, m).item() == pytest.approx(10.0 / 5.0)


def test_masked_mean_of_empty_row_is_zero_not_nan():
    x = torch.tensor([[1.0, 2.0], [5.0, 6.0]])
    m = torch.tensor([[1, 1], [0, 0]])
    assert masked_mean(x, m, dim=-1).tolist() == [1.5, 0.0]


def test_masked_max_min_by_hand():
    x = torch.tensor([[1.0, -3.0, 9.0], [NAN, -2.0, 0.5], [4.0, 4.0, 4.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    # row 0: max(1,-3)=1, min=-3 (9 is padding); row 1: NaN ignored → max 0.5, min -2; row 2: empty → 0
    assert masked_max(x, m, dim=-1).tolist() == [1.0, 0.5, 0.0]
    assert masked_min(x, m, dim=-1).tolist() == [-3.0, -2.0, 0.0]
    assert masked_max(x, m).item() == 1.0
    assert masked_min(x, m).item() == -3.0


# ---------------------------------------------------------------------------------------------------------------------
# log-ratios and aggregation: hand-computed numbers
# ---------------------------------------------------------------------------------------------------------------------


def test_log_ratio_by_hand_clamps_and_zeroes_invalid():
    num = torch.tensor([[-1.0, -50.0, -1.0, NAN, -1.0]])
    den = torch.tensor([[-2.0, -1.0, -40.0, -1.0, -1.0]])
    m = torch.tensor([[1, 1, 1, 1, 0]])
    # -1-(-2) = 1 ; -50+1 = -49 → -20 ; -1+40 = 39 → 20 ; NaN → 0 ; padding → 0
    assert log_ratio(num, den, m).tolist() == [[1.0, -20.0, 20.0, 0.0, 0.0]]


def test_log_ratio_gradient_flows_through_valid_positions_only():
    num = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    den = torch.tensor([[-1.5, -2.0, -1.0]])
    log_ratio(num, den, torch.tensor([[1, 1, 0]])).sum().backward()
    assert num.grad.tolist() == [[1.0, 1.0, 0.0]]


def test_log_ratio_bf16_inputs_computed_in_float32():
    num = torch.tensor([[-1.0]], dtype=torch.bfloat16)
    den = torch.tensor([[-1.0078125]], dtype=torch.bfloat16)  # exactly representable: -1 - 2^-7
    out = log_ratio(num, den, torch.ones(1, 1))
    assert out.dtype == torch.float32
    assert out.item() == 2.0**-7


def test_aggregate_levels_by_hand():
    r = torch.tensor([[0.1, 0.3, 0.5], [0.2, -0.6, 9.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1]])
    tok = aggregate_log_ratio(r, m, "token")
    seq = aggregate_log_ratio(r, m, "sequence")
    geo = aggregate_log_ratio(r, m, "geometric")
    close(tok, [[0.1, 0.3, 0.0], [0.2, -0.6, 9.0]])
    # sums: 0.1+0.3 = 0.4 ; 0.2-0.6+9 = 8.6, broadcast to valid tokens, 0 at padding
    close(seq, [[0.4, 0.4, 0.0], [8.6, 8.6, 8.6]])
    # means: 0.4/2 = 0.2 ; 8.6/3 = 2.8667
    close(geo, [[0.2, 0.2, 0.0], [8.6 / 3] * 3])


def test_aggregate_sequence_is_clamped_after_summing():
    r = torch.full((1, 30), 1.0)  # Σ = 30 → clamped to 20; geometric mean = 1 (unclamped)
    m = torch.ones(1, 30)
    assert aggregate_log_ratio(r, m, "sequence").max().item() == LOG_RATIO_BOUND
    assert aggregate_log_ratio(r, m, "geometric").max().item() == pytest.approx(1.0)


def test_aggregate_rejects_unknown_level():
    with pytest.raises(ValueError, match="level"):
        aggregate_log_ratio(torch.zeros(1, 2), torch.ones(1, 2), "product")  # type: ignore[arg-type]


def test_sequence_log_ratio_by_hand():
    r = torch.tensor([[0.1, 0.3, 7.0]])
    m = torch.tensor([[1, 1, 0]])
    assert sequence_log_ratio(r, m, "sequence").tolist() == pytest.approx([0.4])  # 0.1+0.3
    assert sequence_log_ratio(r, m, "geometric").tolist() == pytest.approx([0.2])  # 0.4/2
    with pytest.raises(ValueError, match="level"):
        sequence_log_ratio(r, m, "token")
    with pytest.raises(ValueError, match="level"):
        sequence_log_ratio(r, m, "bogus")  # type: ignore[arg-type]


def test_per_sequence_by_hand():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, NAN, 4.0], [-5.0, -1.0, 0.0], [9.0, 9.0, 9.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [0, 0, 0]])
    close(per_sequence(x, m, "sum"), [3.0, 7.0, -6.0, 0.0])  # the NaN adds 0 …
    close(per_sequence(x, m, "mean"), [1.5, 7.0 / 3.0, -3.0, 0.0])  # … and 1 to the length; an empty row is 0
    close(per_sequence(x, m, "max"), [2.0, 4.0, -1.0, 0.0])  # the NaN is left out; an all-negative row keeps its max
    assert per_sequence(x, m, "mean", keepdim=True).shape == (4, 1)
    assert per_sequence(x.to(torch.bfloat16), m, "sum").dtype == torch.float32
    with pytest.raises(ValueError, match="reduce must be one of"):
        per_sequence(x, m, "median")


def test_per_sequence_is_the_row_form_of_the_masked_reductions_and_the_levels():
    x = torch.tensor([[0.5, -0.25, INF], [NAN, 0.75, 0.125]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert torch.equal(per_sequence(x, m, "sum"), masked_sum(x, m, dim=-1))
    assert torch.equal(per_sequence(x, m, "mean"), masked_mean(x, m, dim=-1))
    assert torch.equal(per_sequence(x, m, "max"), masked_max(x, m, dim=-1))
    assert torch.equal(sequence_log_ratio(x, m, "sequence"), per_sequence(x, m, "sum"))
    assert torch.equal(sequence_log_ratio(x, m, "geometric"), per_sequence(x, m, "mean"))


def test_per_sequence_gradient_only_at_valid_finite_positions():
    x = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    per_sequence(x, torch.tensor([[1, 1, 0]]), "mean").sum().backward()
    assert x.grad.tolist() == [[0.5, 0.5, 0.0]]


def test_nonfinite_rows_by_hand():
    x = torch.tensor([[0.0, NAN], [1.0, INF], [-INF, 2.0], [1.0, 2.0]])
    m = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    assert nonfinite_rows(x, m).tolist() == [True, False, True, False]  # row 1's inf is padding
    assert nonfinite_rows(torch.zeros(0, 3), torch.zeros(0, 3)).shape == (0,)


def test_decompose_by_hand():
    logp = torch.tensor([[-1.0, -3.0]])
    old = torch.tensor([[-1.5, -2.0]])
    roll = torch.tensor([[-2.0, -2.5]])
    d = decompose_log_ratio(logp, old, roll, torch.ones(1, 2))
    # total = logp - roll = (1.0, -0.5); mismatch = old - roll = (0.5, 0.5); staleness = logp - old = (0.5, -1.0)
    close(d["total"], [[1.0, -0.5]])
    close(d["mismatch"], [[0.5, 0.5]])
    close(d["staleness"], [[0.5, -1.0]])


# ---------------------------------------------------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(token_batches(), st.integers(0, 1000))
def test_padding_never_contributes(batch, seed):
    x, m = batch
    y = corrupt_padding(x, m, seed)
    for f in (masked_sum, masked_mean, masked_max, masked_min):
        assert torch.equal(f(x, m, dim=-1), f(y, m, dim=-1))
        assert torch.equal(f(x, m), f(y, m))
    for reduce in ("sum", "mean", "max"):
        assert torch.equal(per_sequence(x, m, reduce), per_sequence(y, m, reduce))
    assert not nonfinite_rows(y, m).any()
    for level in LEVELS:
        assert torch.equal(aggregate_log_ratio(x, m, level), aggregate_log_ratio(y, m, level))
    assert torch.equal(log_ratio(x, torch.zeros_like(x), m), log_ratio(y, torch.zeros_like(y), m))


@settings(max_examples=50, deadline=None)
@given(token_batches())
def test_mean_lies_between_min_and_max(batch):
    x, m = batch
    lo, mean, hi = masked_min(x, m, dim=-1), masked_mean(x, m, dim=-1), masked_max(x, m, dim=-1)
    assert bool((lo <= mean + 1e-5).all()) and bool((mean <= hi + 1e-5).all())


@settings(max_examples=50, deadline=None)
@given(token_batches(scale=0.5))
def test_geometric_invariant_to_repeating_a_sequence(batch):
    x, m = batch
    once = sequence_log_ratio(x, m, "geometric")
    twice = sequence_log_ratio(torch.cat([x, x], dim=-1), torch.cat([m, m], dim=-1), "geometric")
    assert torch.allclose(once, twice, atol=1e-6)
    # …while the product (sequence level) doubles
    doubled = sequence_log_ratio(torch.cat([x, x], -1), torch.cat([m, m], -1), "sequence")
    assert torch.allclose(2 * sequence_log_ratio(x, m, "sequence"), doubled, atol=1e-5)


@settings(max_examples=50, deadline=None)
@given(token_batches(scale=0.5))
def test_sequence_level_is_log_of_product_of_token_ratios(batch):
    x, m = batch
    prod = torch.where(m, torch.exp(x.double()), torch.ones_like(x, dtype=torch.float64)).prod(dim=-1)
    assert torch.allclose(torch.exp(sequence_log_ratio(x, m, "sequence")).double(), prod, rtol=1e-4)


@settings(max_examples=50, deadline=None)
@given(token_batches(scale=2.0), st.integers(0, 2**31 - 1))
def test_decomposition_identity(batch, seed):
    x, m = batch
    g = torch.Generator().manual_seed(seed)
    logp = -x.abs()
    old = logp + 0.3 * torch.randn(x.shape, generator=g)
    roll = logp + 0.3 * torch.randn(x.shape, generator=g)
    d = decompose_log_ratio(logp, old, roll, m)
    assert torch.allclose(d["total"], d["mismatch"] + d["staleness"], atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(token_batches(), st.sampled_from([torch.bfloat16, torch.float16]))
def test_low_precision_inputs_give_float32_results(batch, dtype):
    x, m = batch
    xl = x.to(dtype)
    for level in LEVELS:
        out = aggregate_log_ratio(xl, m, level)
        assert out.dtype == torch.float32
        # same as first upcasting the (already rounded) low-precision values
        assert torch.equal(out, aggregate_log_ratio(xl.float(), m, level))
    assert masked_mean(xl, m).dtype == torch.float32


@settings(max_examples=50, deadline=None)
@given(token_batches(), st.integers(0, 1000))
def test_nonfinite_valid_values_never_produce_nan(batch, seed):
    x, m = batch
    g = torch.Generator().manual_seed(seed)
    hit = torch.rand(x.shape, generator=g) < 0.3
    y = torch.where(hit, torch.tensor([NAN, INF, -INF])[torch.randint(0, 3, x.shape, generator=g)], x)
    for level in LEVELS:
        assert bool(torch.isfinite(aggregate_log_ratio(y, m, level)).all())
    for f in (masked_sum, masked_mean, masked_max, masked_min):
        assert bool(torch.isfinite(f(y, m, dim=-1)).all())
    assert count_nonfinite(y, m).item() == float((hit & m).sum())


def test_log_ratio_bound_constant():
    # the exp of the bound must be finite in float32 (its square too: chi² metrics square the ratio)
    assert math.isfinite(math.exp(2 * LOG_RATIO_BOUND)) and torch.isfinite(torch.exp(torch.tensor(2 * LOG_RATIO_BOUND)))


def test_mean_over_sequences_hand_computed():
    from offpolicy.ratios import mean_over_sequences

    nonempty = torch.tensor([True, False, True, True])
    x = torch.tensor([1.0, float("inf"), 2.0, 6.0])  # the empty row's inf never contributes
    flag = torch.tensor([True, True, False, True])
    mean_x, frac = mean_over_sequences(x, nonempty), mean_over_sequences(flag, nonempty)
    assert mean_x.item() == pytest.approx((1.0 + 2.0 + 6.0) / 3)  # 3.0
    assert frac.item() == pytest.approx(2 / 3)  # rows 0 and 3 of the three non-empty ones
    # no non-empty sequence: 0, not NaN
    assert mean_over_sequences(torch.ones(2), torch.zeros(2, dtype=torch.bool)).item() == 0.0
    assert mean_x.dtype == frac.dtype == torch.float32 and mean_x.dim() == 0


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(st.tuples(st.booleans(), st.floats(-1e3, 1e3, width=32), st.booleans()), min_size=1, max_size=9))
def test_mean_over_sequences_is_the_masked_mean_over_rows(rows):
    from offpolicy.ratios import mean_over_sequences

    nonempty = torch.tensor([r[0] for r in rows])
    x = torch.tensor([r[1] for r in rows])
    flag = torch.tensor([r[2] for r in rows])
    n = nonempty.float().sum().clamp(min=1.0)
    torch.testing.assert_close(mean_over_sequences(x, nonempty), torch.where(nonempty, x, 0.0).sum() / n)
    torch.testing.assert_close(mean_over_sequences(flag, nonempty), (flag & nonempty).float().sum() / n)


@settings(max_examples=100, deadline=None)
@given(token_batches(), st.integers(0, 1000))
def test_per_sequence_and_nonfinite_rows_agree_with_a_loop_over_rows(batch, seed):
    x, m = batch
    g = torch.Generator().manual_seed(seed)
    junk = torch.tensor([NAN, INF, -INF])[torch.randint(0, 3, x.shape, generator=g)]
    y = torch.where(torch.rand(x.shape, generator=g) < 0.2, junk, x)  # non-finite values, valid or not
    sums, means, maxes = (per_sequence(y, m, reduce) for reduce in ("sum", "mean", "max"))
    bad = nonfinite_rows(y, m)
    for i in range(y.shape[0]):
        valid = [float(v) for v, k in zip(y[i], m[i]) if k]
        finite = [v for v in valid if math.isfinite(v)]
        assert bool(bad[i]) == (len(finite) < len(valid))
        assert sums[i].item() == pytest.approx(sum(finite), abs=1e-5)
        assert means[i].item() == pytest.approx(sum(finite) / max(len(valid), 1), abs=1e-5)
        assert maxes[i].item() == (max(finite) if finite else 0.0)
