"""Low-precision number formats of serving engines, simulated: quantise → dequantise, round to nearest, ties to even.

Each function takes a tensor ``x [..., K]`` of any float dtype and returns a tensor of the same shape and dtype that
holds exactly the values the format can represent (times its scales), computed in float32 and cast back once.
Blocks run along the last dimension (a Linear's reduction dimension K: the input's features, a weight's input
columns), so the same call serves a weight ``[N, K]`` and an activation ``[B, T, K]``; a last block shorter than the
block size is quantised as if zero-padded (zeros never change a block's max).

Element formats (sign-magnitude minifloats, :func:`round_e4m3`, :func:`round_e2m1`):

* **FP8 E4M3** (OCP 8-bit FP, the ``fn`` variant): 4 exponent bits (bias 7), 3 mantissa bits, subnormals; largest
  finite 448 = 1.75·2⁸, smallest subnormal 2⁻⁹, no infinity. Beyond ±448 values saturate to ±448 ("satfinite").
* **FP4 E2M1**: 2 exponent bits (bias 1), 1 mantissa bit: the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}; saturates at 6.

Scaled formats (what an engine stores; the scale is chosen from each block's max |x|, the "amax"):

* :func:`fp8_e4m3` — FP8 E4M3 with one float32 scale s = amax / 448 per block of ``rows × cols``: per tensor
  (vLLM's ``--quantization fp8``), per row (per output channel of a weight, per token of an activation: llm-compressor's
  FP8_DYNAMIC), 128 × 128 weight blocks and 1 × 128 activation groups (DeepSeek-V3's block FP8). x̂ = s·E4M3(x / s).
* :func:`nvfp4` — NVIDIA's NVFP4: E2M1 values in blocks of 16, each block an E4M3 scale, the tensor an FP32 scale
  s_t = amax_tensor / (448·6). Block scale s_b = E4M3(amax_b / 6 / s_t) ∈ [0, 448]; x̂ = s_t·s_b·E2M1(x / (s_t·s_b))
  (clamped at ±6 first: a block scale rounded down would push the block's max past 6).
* :func:`mxfp8` — OCP Microscaling MXFP8: E4M3 values in blocks of 32 with one E8M0 (power of two, 2⁻¹²⁷ … 2¹²⁷)
  scale X per block. OCP MX v1.0 §6.3 (``floor``): X = 2^(⌊log₂ amax⌋ − 8), 8 being E4M3's largest exponent, so
  amax / X ∈ [256, 512) and a block's values above 448·X saturate; ``ceil`` (NVIDIA's kernels): X = 2^⌈log₂(amax /
  448)⌉, the smallest power of two at which nothing saturates.

A block whose amax is 0 dequantises to zeros (never NaN); a block holding a NaN or an infinity comes out NaN (its
scale is not finite), as a real engine's would.

:data:`QUANT_FORMATS` names the weight + activation pairs an engine runs (``quant=`` of
:class:`~offpolicy.rollout.hf.HFRolloutEngine`).

>>> round_e2m1(torch.tensor([0.25, 0.75, 2.5, 5.0, 7.0]))  # ties to even; 7 saturates
tensor([0., 1., 2., 4., 6.])
>>> round_e4m3(torch.tensor([0.3, 449.0, 500.0])).tolist()  # 0.3 → 1.25·2⁻²; beyond 448 saturates
[0.3125, 448.0, 448.0]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E4M3_EMAX = 8  # exponent of E4M3's largest power of two (448 = 1.75·2⁸): OCP MX's emax_elem
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_BLOCK = 16
MX_BLOCK = 32
FP8_BLOCK = 128


def _round_minifloat(x: Tensor, *, mantissa_bits: int, min_exp: int, max_value: float) -> Tensor:
    """Nearest value (ties to even) of a sign-magnitude minifloat with ``mantissa_bits`` stored mantissa bits and
    smallest normal exponent ``min_exp`` (subnormals below it), saturating at ±``max_value``; float32 in and out.

    Within a binade [2^e, 2^(e+1)) the grid step is 2^(e − mantissa_bits) (below 2^min_exp: the subnormal step
    2^(min_exp − mantissa_bits)); |x| / step is exact in float32 (a power-of-two division), and torch.round rounds
    half to even — an even multiple of the step is an even mantissa code.
    """
    a = x.abs()
    _, e = torch.frexp(a)  # a = m·2^e with m ∈ [0.5, 1): ⌊log₂ a⌋ = e − 1 (e = 0 for a = 0)
    step = torch.ldexp(torch.ones_like(a), (e - 1).clamp(min=min_exp) - mantissa_bits)
    q = torch.round(a / step) * step  # may carry into the next binade (e.g. 15.5·2⁻³ → 2): still on the grid
    return torch.copysign(q.clamp(max=max_value), x)


def round_e4m3(x: Tensor) -> Tensor:
    """``x`` (float32) rounded to FP8 E4M3 (3 mantissa bits, exponents −6 … 8, subnormal step 2⁻⁹), saturating at
    ±448; the same values as ``x.clamp(-448, 448).to(torch.float8_e4m3fn)``."""
    return _round_minifloat(x, mantissa_bits=3, min_exp=-6, max_value=E4M3_MAX)


def round_e2m1(x: Tensor) -> Tensor:
    """``x`` (float32) rounded to FP4 E2M1 (magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), saturating at ±6."""
    return _round_minifloat(x, mantissa_bits=1, min_exp=0, max_value=E2M1_MAX)


def _check_block(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None (the whole dimension) or an int >= 1, got {value!r}")


def block_amax(x: Tensor, rows: int | None = None, cols: int | None = None) -> Tensor:
    """max |x| over each ``rows × cols`` block of ``x`` viewed as ``[R, K]`` (R = every leading dimension joined),
    broadcast back to ``x``'s shape (float32). ``None``: the whole dimension. Partial edge blocks are zero-padded.

    >>> block_amax(torch.tensor([[1., -3., 2.], [0., 4., 1.]]), rows=1, cols=2)
    tensor([[3., 3., 2.],
            [4., 4., 1.]])
    """
    _check_block("rows", rows)
    _check_block("cols", cols)
    k = x.shape[-1] if x.dim() else 1
    a = x.detach().float().abs().reshape(-1, k)
    n = a.shape[0]
    r, c = rows or max(n, 1), cols or max(k, 1)
    pr, pc = -n % r, -k % c
    padded = torch.nn.functional.pad(a, (0, pc, 0, pr))  # zeros: |x| ≥ 0 never loses its max to them
    nr, nc = padded.shape[0] // r, padded.shape[1] // c
    m = padded.reshape(nr, r, nc, c).amax(dim=(1, 3), keepdim=True)
    return m.expand(nr, r, nc, c).reshape(nr * r, nc * c)[:n, :k].reshape(x.shape)


def _scaled(x: Tensor, scale: Tensor, rounder: Callable[[Tensor], Tensor]) -> Tensor:
    """scale · rounder(x / scale) in float32, zero where the scale is zero; cast back to ``x.dtype``."""
    xf = x.float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    out = torch.where(scale > 0, rounder(xf / safe) * safe, torch.zeros_like(xf))
    return out.to(x.dtype)


def fp8_e4m3(x: Tensor, *, rows: int | None = None, cols: int | None = None) -> Tensor:
    """FP8 E4M3 with one float32 scale s = amax / 448 per ``rows × cols`` block of ``x [..., K]`` (None: the whole
    dimension): x̂ = s · E4M3(x / s). ``rows=None, cols=None``: per tensor; ``rows=1``: per row (a token, an output
    channel); ``rows=1, cols=128``: per-token groups; ``rows=128, cols=128``: weight blocks.

    >>> fp8_e4m3(torch.tensor([[448.0, 1.3], [2.0, 0.0]]), rows=1)  # row 0: s = 1; row 1: s = 2/448
    tensor([[448.0000,   1.2500],
            [  2.0000,   0.0000]])
    """
    return _scaled(x, block_amax(x, rows, cols) / E4M3_MAX, round_e4m3)


def nvfp4(x: Tensor, *, tensor_rows: int | None = None) -> Tensor:
    """NVFP4: E2M1 values in blocks of 16 along the last dimension, an E4M3 scale per block and an FP32 scale per
    tensor (``tensor_rows=1``: per row instead, e.g. per token of an activation).

    s_t = amax_tensor / (448·6); s_b = E4M3(amax_b / (6·s_t)); x̂ = s_t·s_b · E2M1(clamp(x / (s_t·s_b), ±6)).
    A block whose E4M3 scale rounds to 0 (amax_b below ~2⁻¹⁰·amax_tensor, or an all-zero block) becomes zeros.

    >>> nvfp4(torch.tensor([6.0, 0.7, -2.6, 0.2]))  # s_t = 6/2688 = 1/448, s_b = 448: scale 1
    tensor([ 6.0000,  0.5000, -3.0000,  0.0000])
    """
    s_t = block_amax(x, tensor_rows, None) / (E4M3_MAX * E2M1_MAX)
    safe_t = torch.where(s_t > 0, s_t, torch.ones_like(s_t))
    s_b = round_e4m3(block_amax(x, 1, NVFP4_BLOCK) / E2M1_MAX / safe_t)  # the stored E4M3 block scale
    scale = torch.where(s_t > 0, s_b * s_t, torch.zeros_like(s_t))
    return _scaled(x, scale, lambda v: round_e2m1(v.clamp(-E2M1_MAX, E2M1_MAX)))


MX_SCALE_ROUNDINGS = ("floor", "ceil")


def mx_scale(amax: Tensor, *, emax_elem: int = E4M3_EMAX, max_elem: float = E4M3_MAX,
             scale_rounding: str = "floor") -> Tensor:
    """The E8M0 block scale X (a power of two in [2⁻¹²⁷, 2¹²⁷]; 0 where amax is 0) for block maxima ``amax``.

    ``floor`` (OCP MX v1.0 §6.3): X = 2^(⌊log₂ amax⌋ − emax_elem); ``ceil``: X = 2^⌈log₂(amax / max_elem)⌉.

    >>> mx_scale(torch.tensor([448.0, 500.0, 1.0, 0.0]))
    tensor([1.0000, 1.0000, 0.0039, 0.0000])
    >>> mx_scale(torch.tensor([448.0, 500.0, 1.0]), scale_rounding="ceil")
    tensor([1.0000, 2.0000, 0.0039])
    """
    if scale_rounding not in MX_SCALE_ROUNDINGS:
        raise ValueError(f"scale_rounding must be one of {MX_SCALE_ROUNDINGS}, got {scale_rounding!r}")
    a = amax.float()
    if scale_rounding == "floor":
        _, e = torch.frexp(a)
        exp = e - 1 - emax_elem
    else:
        m, e = torch.frexp(a / max_elem)
        exp = torch.where(m > 0.5, e, e - 1)  # ⌈log₂ r⌉: r = m·2^e is a power of two exactly when m = 0.5
    exp = exp.clamp(-127, 127)
    return torch.where(a > 0, torch.ldexp(torch.ones_like(a), exp), torch.zeros_like(a))


def mxfp8(x: Tensor, *, scale_rounding: str = "floor") -> Tensor:
    """MXFP8 (OCP MX, E4M3 elements): blocks of 32 along the last dimension, one E8M0 scale X each (:func:`mx_scale`):
    x̂ = X · E4M3(x / X), saturating at ±448·X.

    >>> mxfp8(torch.tensor([1.0, 0.3, 0.0]))  # X = 2^(0 − 8): 0.3·256 = 76.8 → 80 (step 8 in [64, 128))
    tensor([1.0000, 0.3125, 0.0000])
    """
    return _scaled(x, mx_scale(block_amax(x, 1, MX_BLOCK), scale_rounding=scale_rounding), round_e4m3)


@dataclass(frozen=True)
class QuantFormat:
    """A serving engine's Linear-layer numerics: ``weight`` quantises a weight ``[N, K]`` (once per sync),
    ``activation`` a Linear's input ``[..., K]`` (every forward; None: activations stay in the engine dtype)."""

    name: str
    weight: Callable[[Tensor], Tensor]
    activation: Callable[[Tensor], Tensor] | None
    description: str


QUANT_FORMATS: dict[str, QuantFormat] = {
    f.name: f
    for f in (
        QuantFormat("fp8", fp8_e4m3, fp8_e4m3,
                    "fp8 e4m3 W8A8, per-tensor scales (activation scale per forward: vLLM's --quantization fp8)"),
        QuantFormat("fp8-dynamic", partial(fp8_e4m3, rows=1), partial(fp8_e4m3, rows=1),
                    "fp8 e4m3 W8A8, per-channel weight and per-token activation scales"),
        QuantFormat("fp8-block", partial(fp8_e4m3, rows=FP8_BLOCK, cols=FP8_BLOCK),
                    partial(fp8_e4m3, rows=1, cols=FP8_BLOCK),
                    "fp8 e4m3 W8A8, 128x128 weight blocks and 1x128 activation groups"),
        QuantFormat("mxfp8", mxfp8, mxfp8, "MXFP8 W8A8, e4m3 in blocks of 32 with e8m0 scales"),
        QuantFormat("nvfp4", nvfp4, partial(nvfp4, tensor_rows=1),
                    "NVFP4 W4A4, e2m1 in blocks of 16 with e4m3 block and fp32 tensor scales"),
        QuantFormat("nvfp4a16", nvfp4, None, "NVFP4 W4A16, e2m1 weights in blocks of 16, engine-dtype activations"),
    )
}
QUANT_ALIASES = {"w4a4": "nvfp4", "w4a16": "nvfp4a16", "fp8-tensor": "fp8", "fp8-token": "fp8-dynamic"}


def quant_format(name: str) -> QuantFormat:
    """The :class:`QuantFormat` called ``name`` (or an alias: ``w4a4`` → ``nvfp4``, ``w4a16`` → ``nvfp4a16``).

    >>> quant_format("w4a4").name
    'nvfp4'
    """
    key = QUANT_ALIASES.get(name, name) if isinstance(name, str) else name
    if key not in QUANT_FORMATS:
        raise ValueError(f"quant must be one of {', '.join([*QUANT_FORMATS, *QUANT_ALIASES])}, got {name!r}")
    return QUANT_FORMATS[key]
