"""Serving number formats (offpolicy.rollout.quant_formats): hand-computed values, torch's own float8 cast, properties."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy.rollout.quant_formats import (
    E2M1_MAGNITUDES,
    QUANT_FORMATS,
    block_amax,
    fp8_e4m3,
    mx_scale,
    mxfp8,
    nvfp4,
    quant_format,
    round_e2m1,
    round_e4m3,
)


def _all_e4m3() -> torch.Tensor:
    """Every finite float8_e4m3fn value, from torch's own dtype (the 254 bit patterns that are not NaN)."""
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return v[torch.isfinite(v)]


def _ulp(v: torch.Tensor, *, mantissa_bits: int, min_exp: int) -> torch.Tensor:
    """Grid step of a minifloat at |v| (the binade's step, or the subnormal step below 2^min_exp)."""
    _, e = torch.frexp(v.abs())
    return torch.ldexp(torch.ones_like(v), (e - 1).clamp(min=min_exp) - mantissa_bits)


# -- element formats ---------------------------------------------------------------------------------------------
def test_e4m3_every_representable_value_round_trips_and_448_is_the_max():
    v = _all_e4m3()
    assert v.numel() == 254
    assert torch.equal(round_e4m3(v), v)
    assert v.max().item() == 448.0 and v.abs()[v != 0].min().item() == 2.0**-9


def test_e4m3_ties_to_even_and_subnormals_by_hand():
    x = torch.tensor([1.0625, 1.1875, 2.0**-10, 1.5 * 2.0**-10, 3 * 2.0**-10, 0.3, 248.0, 272.0, -1.0625])
    # 1.0625: between 1 (mantissa 000) and 1.125 (001) → 1; 1.1875: between 1.125 (001) and 1.25 (010) → 1.25;
    # 2^-10 is half the smallest subnormal → 0 (even); 1.5·2^-10 → 2^-9; 3·2^-10 between 2^-9 (odd) and 2^-8 → 2^-8;
    # 0.3 = 1.2·2^-2 → 1.25·2^-2; 248 between 240 (1.875·2^7, odd) and 256 → 256 (even); 272 between 256 and 288 → 256
    want = torch.tensor([1.0, 1.25, 0.0, 2.0**-9, 2.0**-8, 0.3125, 256.0, 256.0, -1.0])
    assert torch.equal(round_e4m3(x), want)


def test_e4m3_saturates_at_448():
    x = torch.tensor([449.0, 464.0, 465.0, 479.0, 1e6, -1e6, float("inf")])
    assert torch.equal(round_e4m3(x), torch.tensor([448.0, 448.0, 448.0, 448.0, 448.0, -448.0, 448.0]))


def test_e4m3_matches_torchs_float8_cast_on_every_midpoint_and_random_values():
    v = _all_e4m3().sort().values
    mids = (v[1:] + v[:-1]) / 2  # every tie of the grid
    x = torch.cat([mids, torch.randn(20000) * 30, torch.randn(2000) * 1e-2, (torch.rand(2000) - 0.5) * 896])
    x = x.clamp(-448, 448)  # torch's cast turns values past 464 into NaN; the formats saturate instead
    assert torch.equal(round_e4m3(x), x.to(torch.float8_e4m3fn).float())


def test_e2m1_has_exactly_eight_magnitudes_with_ties_to_even():
    m = torch.tensor(E2M1_MAGNITUDES)
    assert torch.equal(round_e2m1(m), m) and torch.equal(round_e2m1(-m), -m)
    dense = torch.linspace(-10, 10, 40001)
    got = set(round_e2m1(dense).abs().tolist())
    assert got == set(E2M1_MAGNITUDES)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.26, 0.74, 5.01, 6.5, 100.0, -2.5])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 0.5, 6.0, 6.0, 6.0, -2.0])
    assert torch.equal(round_e2m1(ties), want)


# -- scaled formats -----------------------------------------------------------------------------------------------
def test_block_amax_blocks_and_partial_edges():
    x = torch.tensor([[1.0, -3.0, 2.0], [0.0, 4.0, 1.0], [-5.0, 0.0, 0.0]])
    assert torch.equal(block_amax(x), torch.full((3, 3), 5.0))
    assert torch.equal(block_amax(x, rows=1), torch.tensor([[3.0] * 3, [4.0] * 3, [5.0] * 3]))
    assert torch.equal(block_amax(x, rows=2, cols=2),
                       torch.tensor([[4.0, 4.0, 2.0], [4.0, 4.0, 2.0], [5.0, 5.0, 0.0]]))
    with pytest.raises(ValueError, match="cols must be None"):
        block_amax(x, cols=0)


def test_fp8_per_tensor_and_per_row_by_hand():
    x = torch.tensor([[1.0, 0.5, -0.3], [0.25, 0.0, 0.0]])
    # per tensor: s = 1/448; 0.5·448 = 224 exact; 0.3·448 = 134.4 → 128 (step 16 in [128, 256)); 0.25·448 = 112 exact
    want = torch.tensor([[1.0, 0.5, -128 / 448], [0.25, 0.0, 0.0]])
    torch.testing.assert_close(fp8_e4m3(x), want, rtol=1e-7, atol=0)
    # per row: row 1's own scale 0.25/448 puts 0.25 on 448 exactly
    torch.testing.assert_close(fp8_e4m3(x, rows=1)[1], torch.tensor([0.25, 0.0, 0.0]), rtol=0, atol=0)


def test_fp8_128x128_blocks_are_independent():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=g)
    big = w.clone()
    big[3, 5] = 1000.0  # block (0, 0) only
    a, b = fp8_e4m3(w, rows=128, cols=128), fp8_e4m3(big, rows=128, cols=128)
    assert torch.equal(a[128:], b[128:]) and torch.equal(a[:128, 128:], b[:128, 128:])
    assert not torch.equal(a[:128, :128], b[:128, :128])
    assert b[3, 5].item() == pytest.approx(1000.0, rel=1e-6)  # the block's max is always exact: amax/s = 448


def test_nvfp4_by_hand():
    x = torch.zeros(4, 16)
    x[0, :4] = torch.tensor([6.0, 0.7, -2.6, 0.2])  # tensor amax 6: s_t = 6/2688 = 1/448, block scale 448 → 1
    x[1, :2] = torch.tensor([3.0, 1.1])  # block amax 3 → E4M3(224) = 224 → scale 0.5: 1.1/0.5 = 2.2 → 2 → 1.0
    x[2, :2] = torch.tensor([5.0, 1.0])  # 5/6·448 = 373.3 → 384 (step 32) → scale 6/7: 5·7/6 = 5.83 → 6 → 36/7
    x[3, :2] = torch.tensor([4.9, 1e-6])  # 365.9 → 352 → scale 11/14: 4.9·14/11 = 6.24 saturates at 6 → 66/14
    want = torch.zeros(4, 16)
    want[0, :4] = torch.tensor([6.0, 0.5, -3.0, 0.0])
    want[1, :2] = torch.tensor([3.0, 1.0])
    want[2, :2] = torch.tensor([36 / 7, 6 / 7])
    want[3, :2] = torch.tensor([66 / 14, 0.0])
    torch.testing.assert_close(nvfp4(x.reshape(1, 64)).reshape(4, 16), want, rtol=1e-6, atol=0)
    # per-row tensor scale: each row its own s_t, so row 1's block scale is 448 and 1.1 → 1.0 (2.2 → 2 at scale 0.5)
    torch.testing.assert_close(nvfp4(x, tensor_rows=1)[1, :2], torch.tensor([3.0, 1.0]), rtol=1e-6, atol=0)


def _nvfp4_by_vllms_procedure(x: torch.Tensor) -> torch.Tensor:
    """NVFP4 as vLLM's reference quantiser for its kernel tests computes it (tests/kernels/quantization/
    nvfp4_utils.py, ref_nvfp4_quant), restated: the encode scale g = 448·6 / amax, the block scale through torch's
    float8_e4m3fn cast, reciprocals instead of divisions, and E2M1 by a table of half-open intervals."""
    m, n = x.shape
    g = torch.tensor(448 * 6.0) / x.abs().max()
    xb = x.reshape(m, n // 16, 16)
    s = (g * (xb.abs().amax(-1, keepdim=True) / 6)).clamp(max=448).to(torch.float8_e4m3fn).float()
    v = (xb * torch.where(s == 0, torch.zeros_like(s), 1 / (s / g))).clamp(-6, 6)
    a, q = v.abs(), torch.zeros_like(v)
    for lo, hi, value, closed in [(0.25, 0.75, 0.5, False), (0.75, 1.25, 1.0, True), (1.25, 1.75, 1.5, False),
                                  (1.75, 2.5, 2.0, True), (2.5, 3.5, 3.0, False), (3.5, 5.0, 4.0, True)]:
        q[((a >= lo) & (a <= hi)) if closed else ((a > lo) & (a < hi))] = value  # closed intervals: the even ties
    q[a > 5.0] = 6.0
    return (q * torch.sign(v) * s / g).reshape(m, n)


def test_nvfp4_agrees_with_vllms_reference_procedure():
    """Same grid point for every element; the values differ by at most 2 float32 ulps (division vs reciprocal)."""
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(64, 256, generator=g) * torch.exp(torch.randn(64, 256, generator=g))
        torch.testing.assert_close(nvfp4(x), _nvfp4_by_vllms_procedure(x), rtol=4e-7, atol=0)


def test_nvfp4_tiny_block_under_a_large_tensor_scale_becomes_zero():
    x = torch.cat([torch.full((16,), 6.0), torch.full((16,), 1e-6)])  # 1e-6/6·448 = 7.5e-5 < 2^-10: E4M3 scale 0
    out = nvfp4(x)
    assert torch.equal(out[16:], torch.zeros(16)) and torch.equal(out[:16], x[:16])


def test_mx_scale_floor_and_ceil_by_hand():
    amax = torch.tensor([448.0, 500.0, 512.0, 1.0, 0.0, 1e-40])
    assert mx_scale(amax).tolist() == [1.0, 1.0, 2.0, 2.0**-8, 0.0, 2.0**-127]
    assert mx_scale(amax[:5], scale_rounding="ceil").tolist() == [1.0, 2.0, 2.0, 2.0**-8, 0.0]
    with pytest.raises(ValueError, match="scale_rounding"):
        mx_scale(amax, scale_rounding="nearest")


def test_mxfp8_by_hand_blocks_of_32():
    x = torch.zeros(64)
    x[:3] = torch.tensor([1.0, 0.3, -0.0078125])  # X = 2^-8: 76.8 → 80; −2 exact
    x[32:34] = torch.tensor([500.0, 100.0])  # floor: X = 1, 500 saturates at 448; 100 → 96 (step 8 in [64, 128))
    out = mxfp8(x)
    assert out[:3].tolist() == [1.0, 0.3125, -0.0078125]
    assert out[32:34].tolist() == [448.0, 96.0]
    assert torch.equal(out[3:32], torch.zeros(29)) and torch.equal(out[34:], torch.zeros(30))
    # ceil: X = 2, 250 → 256 (step 16), 50 → 48 (step 4 in [32, 64)): 512 and 96
    assert mxfp8(x, scale_rounding="ceil")[32:34].tolist() == [512.0, 96.0]


@pytest.mark.parametrize("name", sorted(QUANT_FORMATS))
def test_formats_are_nan_free_on_zeros_and_keep_shape_and_dtype(name):
    fmt = QUANT_FORMATS[name]
    for fn in (fmt.weight, fmt.activation):
        if fn is None:
            continue
        z = torch.zeros(3, 5, 40, dtype=torch.bfloat16)
        out = fn(z)
        assert out.dtype == torch.bfloat16 and out.shape == z.shape and torch.equal(out, z)


def test_quant_format_names_and_aliases():
    assert quant_format("w4a4") is QUANT_FORMATS["nvfp4"] and quant_format("w4a16").activation is None
    with pytest.raises(ValueError, match="quant must be one of"):
        quant_format("int3")


# -- properties ---------------------------------------------------------------------------------------------------
_FNS = {
    "fp8-tensor": fp8_e4m3,
    "fp8-row": lambda x: fp8_e4m3(x, rows=1),
    "fp8-block": lambda x: fp8_e4m3(x, rows=4, cols=8),
    "nvfp4": nvfp4,
    "nvfp4-row": lambda x: nvfp4(x, tensor_rows=1),
    "mxfp8": mxfp8,
    "mxfp8-ceil": lambda x: mxfp8(x, scale_rounding="ceil"),
}


@st.composite
def _tensors(draw):
    rows, cols = draw(st.integers(1, 9)), draw(st.integers(1, 70))
    seed, log_scale = draw(st.integers(0, 2**31 - 1)), draw(st.integers(-30, 30))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 2.0**log_scale
    if draw(st.booleans()):  # heavy tails: a few outliers, as activations have
        x = x * torch.exp(2 * torch.randn(rows, cols, generator=g))
    if draw(st.booleans()):
        x[:, : cols // 2] = 0.0
    return x


@pytest.mark.parametrize("name", sorted(_FNS))
@settings(max_examples=60, deadline=None)
@given(x=_tensors())
def test_quantising_twice_is_quantising_once(name, x):
    once = _FNS[name](x)
    twice = _FNS[name](once)
    if name.startswith("mxfp8"):  # power-of-two scales: bitwise
        assert torch.equal(once, twice)
    else:  # a float32 scale recomputed from the quantised max can move by an ulp or two
        torch.testing.assert_close(twice, once, rtol=5e-7, atol=0)


@settings(max_examples=80, deadline=None)
@given(x=_tensors())
def test_error_within_half_a_grid_step(x):
    """|x̂ − x| ≤ ½ step of the format's grid at x's scaled magnitude (elements that do not saturate)."""
    s = block_amax(x, rows=1) / 448
    safe = torch.where(s > 0, s, torch.ones_like(s))
    v = x / safe
    bound = 0.5 * _ulp(v, mantissa_bits=3, min_exp=-6) * safe * (1 + 1e-6)
    assert bool(((fp8_e4m3(x, rows=1) - x).abs() <= bound).all())

    X = mx_scale(block_amax(x, rows=1, cols=32))
    safe_x = torch.where(X > 0, X, torch.ones_like(X))
    v = x / safe_x
    err = (mxfp8(x) - x).abs()
    inside = v.abs() <= 448  # OCP's floor scale lets a block's top values saturate: those go to ±448·X
    assert bool((err[inside] <= 0.5 * _ulp(v, mantissa_bits=3, min_exp=-6)[inside] * safe_x[inside]).all())
    assert bool((mxfp8(x)[~inside].abs() == 448 * X[~inside]).all())

    # NVFP4: the block's scale as stored (e4m3 block scale × fp32 tensor scale). With a normal e4m3 block scale
    # (relative rounding ≤ 2^-4) saturation stays inside half of the top step (6·(1 + 2^-4) − 6 < 1); a subnormal one
    # (a block below ~3.5e-5 of the tensor's max) can saturate further: there only |x̂| ≤ 6·scale holds
    s_t = block_amax(x) / 2688
    safe_t = torch.where(s_t > 0, s_t, torch.ones_like(s_t))
    s_b = round_e4m3(block_amax(x, rows=1, cols=16) / 6 / safe_t)
    scale = s_b * s_t
    out = nvfp4(x)
    normal = s_b >= 2.0**-6
    v = x[normal] / scale[normal]
    bound = 0.5 * _ulp(v.clamp(-6, 6), mantissa_bits=1, min_exp=0) * scale[normal] * (1 + 1e-6)
    assert bool(((out[normal] - x[normal]).abs() <= bound).all())
    assert bool((out.abs() <= 6 * scale * (1 + 1e-6)).all())
    assert bool((out[scale == 0] == 0).all())
