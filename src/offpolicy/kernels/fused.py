"""Chunked per-token statistics of a softmax policy without an ``[N, V]`` tensor.

Given hidden states ``h`` [N, H] and an lm_head ``W`` [V, H] (optional bias [V], temperature τ), the policy at
token n is softmax(z_n) with z_n = (W h_n + b) / τ. This module returns, per token,

===============  ==================================================================================  ======
name             value                                                                               grad
===============  ==================================================================================  ======
``logp``         log π(y_n) = z_y − lse(z)                                                           yes
``entropy``      H(π) = lse(z) − Σ_a π_a z_a                                                         yes
``minp_logp``    log π^mp(y_n) = z_y − lse_S(z), S = {a : z_a ≥ z_max + log ρ}  (DVP Defs 5.1–5.2)     yes
``minp_mass``    Z = Σ_{a∈S} π_a, retained (coverage) mass (DVP Prop 5.5)                            yes
``minp_inside``  y_n ∈ S (bool); where False the DVP ratio is 0: use it as the keep mask             —
``kl``           KL(μ ‖ π) to the rollout distribution μ — exact from rollout logits [N, V], or the    yes
                 top-k coarse-grained lower bound from rollout top-k log-probs [N, K] (see
                 :mod:`offpolicy.divergence`)
``tv``           TV(μ, π) (same two sources; top-k gives a lower bound)                              yes
``max_logit``    z_max (the min-p threshold is z_max + log ρ)                                         —
``logsumexp``    lse(z)                                                                               —
===============  ==================================================================================  ======

How: a custom ``torch.autograd.Function`` whose forward keeps only per-row statistics (logsumexp, entropy, the
safe set's logsumexp, the rollout's logsumexp …) and whose backward recomputes the logits tile by tile and forms
∂/∂z of every requested output at once, then pushes it through the matmuls into ∂h, ∂W, ∂b. Scratch is bounded by
``memory_budget_bytes`` (:mod:`offpolicy.kernels.chunking`) and reused across chunks. The forward takes full-row
chunks when at least ``ROW_PATH_MIN_ROWS`` rows fit (one pass); otherwise it streams over 2-D tiles with running
max / rescaled sums, plus a second pass for min-p (needs the final max) and exact TV (needs both normalisers). The
backward is always 2-D tiled, so each slice of ∂W is written once per row block. All softmax arithmetic is float32
(float64 if the inputs are float64, which is what ``gradcheck`` needs) whatever the input dtype; bf16/fp16 weights
are up-cast one vocabulary slice at a time, as each tile needs it (never a [V, H] float32 copy). The min-p safe set
is fixed during backpropagation (DVP §5.5). Targets equal to ``ignore_index`` give 0 for every output and no
gradient. The rollout's tensors are data: no gradient.

Gradients w.r.t. z (p = softmax(z), onehot at y; each is multiplied by its output's incoming gradient):
logp → onehot − p; entropy → −p ⊙ (z − lse + H); minp_logp → onehot − p ⊙ 1_S / Z (the contrastive form of
DVP Prop 5.4; for y ∉ S the value z_y − lse_S is a finite stand-in for −∞ and ``minp_inside`` drops the token);
minp_mass → p ⊙ (1_S − Z); kl → p − q (q = μ, or for top-k the coarse-grained q̃: q_i on the k ids, and
q_rest · p / p_rest on the rest); tv → ½ p ⊙ (s − Σ s p), s = sign(p − q) per bucket.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from offpolicy.kernels.chunking import DEFAULT_MEMORY_BUDGET_BYTES, chunk_rows, row_chunks

IGNORE_INDEX = -100
_NEG_LOGIT = -1e30  # stands in for −inf logits on the logits path (finite: 0 · z stays 0)
DIFF_OUTPUTS: tuple[str, ...] = ("logp", "entropy", "minp_logp", "minp_mass", "kl", "tv")
_AUX_OUTPUTS: tuple[str, ...] = ("minp_inside", "max_logit", "logsumexp")


@dataclass(frozen=True)
class TokenStats:
    """Per-token outputs of :func:`fused_token_stats` / :func:`token_stats_from_logits`; None when not requested.

    Every tensor has the leading shape of the targets ([N], or [B, T] from the logits path). ``kl_kind`` is
    ``"exact"`` (full rollout logits), ``"topk"`` (coarse-grained lower bound) or None.
    """

    logp: Tensor | None = None
    entropy: Tensor | None = None
    minp_logp: Tensor | None = None
    minp_mass: Tensor | None = None
    minp_inside: Tensor | None = None
    kl: Tensor | None = None
    tv: Tensor | None = None
    max_logit: Tensor | None = None
    logsumexp: Tensor | None = None
    kl_kind: str | None = None


@dataclass(frozen=True)
class _Config:
    want: frozenset[str]
    temperature: float
    log_rho: float
    rollout_temperature: float
    kl_source: str | None  # None | "logits" | "topk"
    ignore_index: int
    memory_budget_bytes: int

    def buffers(self) -> int:
        # Live [n, V] buffers at the peak of a chunk (an estimate that errs high): logits, probabilities, gradient,
        # plus the min-p/entropy temporaries and the rollout's logits, probabilities and difference.
        b = 3
        if self.want & {"entropy", "minp_logp", "minp_mass"}:
            b += 2
        if self.kl_source == "logits":
            b += 4
        elif self.kl_source == "topk":
            b += 2
        return b


# ---------------------------------------------------------------------------------------------------------------
# The per-chunk mathematics, shared by the hidden-state path and the logits path.
# ---------------------------------------------------------------------------------------------------------------

def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """Σ_v a[n, v] b[n, v] as [n, 1] without allocating a·b (a batched matmul)."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).squeeze(2)


def rest_mass_bounds(topk_logp: Tensor, vocab: int) -> tuple[Tensor, Tensor]:
    """Interval ``(lo, hi)`` [N, 1] float64 holding μ's rest mass 1 − Σ_i q_i, given its top-k log-probs ``topk_logp``
    [N, K] (−inf entries allowed) over a vocabulary of ``vocab`` tokens.

    Why an interval: the log-probs arrive rounded to their dtype. An absolute error of up to |lq_i|·eps/2 in lq_i (eps of
    that dtype) is a relative error of the same size in q_i = exp(lq_i). So 1 − Σ q_i, summed in float64, is off by up
    to tol = eps/2 · Σ_i q_i |lq_i| (about 1e-7 for float32 log-probs). A fixed 4·K·eps would be 1.2e-4 at K = 256, and
    would discard real tail mass. With K ≥ V there is no rest at all: the interval is [0, 0].
    """
    lq = topk_logp.double()
    q = lq.exp()
    q_hat = 1.0 - q.sum(dim=-1, keepdim=True)
    eps_in = torch.finfo(topk_logp.dtype).eps
    per_id = torch.where(q > 0, q * lq.abs(), torch.zeros((), dtype=torch.float64))
    tol = 0.5 * eps_in * per_id.sum(dim=-1, keepdim=True) + 4 * lq.shape[-1] * torch.finfo(torch.float64).eps
    if lq.shape[-1] >= vocab:  # ids are unique per row: the complement is empty
        zero = torch.zeros_like(q_hat)
        return zero, zero
    return (q_hat - tol).clamp(min=0.0), (q_hat + tol).clamp(min=0.0)


def topk_rest_mass(bounds: tuple[Tensor, Tensor], log_p_rest: Tensor, dtype: torch.dtype) -> Tensor:
    """The rest mass [N, 1] that the coarse-grained KL lower bound uses: the value in ``bounds``
    (:func:`rest_mass_bounds`) that minimises the tail term q·log(q / p_rest). That term is convex, with its least
    value at q = p_rest / e. So the bound stays a lower bound whatever the rounding of the inputs was."""
    lo, hi = bounds
    target = log_p_rest.double().exp() / math.e
    return torch.minimum(torch.maximum(target, lo), hi).to(dtype)


class _Scratch:
    """Reusable ``[n, V]``-sized buffers: one allocation per name for the whole call, not one per chunk.

    Allocating and freeing tens of MB per chunk makes the C allocator keep freed blocks (the process RSS grows
    far beyond the live tensors) and pays a page fault per fresh page; reusing buffers avoids both.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, Tensor] = {}

    def get(self, name: str, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        return self.new(name, tuple(like.shape), dtype or like.dtype, like.device)

    def new(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        numel = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._bufs[name] = buf
        return buf[:numel].view(shape)


def _rollout_chunk(rollout: Tensor, cfg: _Config, dtype: torch.dtype, scratch: _Scratch) -> Tensor:
    if rollout.dtype == dtype and cfg.rollout_temperature == 1.0:
        return rollout  # read-only use: no copy needed
    out = scratch.get("rollout", rollout, dtype).copy_(rollout)
    return out.mul_(1.0 / cfg.rollout_temperature) if cfg.rollout_temperature != 1.0 else out


def _centred_kl(rollout_logits: Tensor, rollout_max: Tensor, rollout_exp: Tensor, rollout_sum_exp: Tensor,
                logits: Tensor, max_logit: Tensor, exp_shifted: Tensor, sum_exp: Tensor, scratch: _Scratch) -> Tensor:
    """KL(q‖p) of full rows from their shifted exponentials, in a form where a shift of the logits cancels exactly.

    With d = (r − max r) − (z − max z) per token: Σ q (r − z) − lse_r + lse = E_q[d] − log(S_r / S), and
    S_r − S = Σ e^{z − max z} expm1(d). A shift r = z + c gives d ≡ 0 (up to the rounding of z + c) and KL 0 to
    ~1e-12; the textbook Σ q (r − z) − lse_r + lse subtracts two normalisers of size |z| and keeps a float32
    floor of ~3e-5 nats on a real model's logits. 0·(−inf) where q = 0 reads 0; π(a) = 0 < μ(a) gives +inf.
    """
    d = torch.sub(rollout_logits, rollout_max, out=scratch.get("tmp", logits)).sub_(logits).add_(max_logit)
    q_zero = torch.eq(rollout_exp, 0, out=scratch.get("mask", logits, torch.bool))
    e_q_d = _rowdot(rollout_exp, d.masked_fill(q_zero, 0.0)) / rollout_sum_exp
    # e^{r − max r} − e^{z − max z}: through expm1 where the two are close (|d| < 1: the cancellation), directly
    # elsewhere (no cancellation; and e^{z − max z}·expm1(d) could read 0·inf where z is very negative)
    gap = torch.where(d.abs() < 1, exp_shifted * torch.expm1(d.clamp(-1, 1)), rollout_exp - exp_shifted)
    log_ratio = torch.log1p(gap.sum(dim=-1, keepdim=True) / sum_exp)
    return torch.where(torch.isinf(e_q_d), e_q_d, e_q_d - log_ratio)


def _forward_chunk(logits: Tensor, targets: Tensor, cfg: _Config, rollout: Tensor | None, topk_logp: Tensor | None,
                   topk_ids: Tensor | None, scratch: _Scratch) -> dict[str, Tensor]:
    """Statistics of one chunk of logits ``z`` [n, V] (owned; may be overwritten). Returns [n, 1] tensors."""
    want = cfg.want
    out: dict[str, Tensor] = {}
    zero = torch.zeros((), dtype=logits.dtype)
    max_logit = logits.amax(dim=-1, keepdim=True)
    exp_shifted = torch.sub(logits, max_logit, out=scratch.get("exp", logits)).exp_()  # e^{z − max}
    sum_exp = exp_shifted.sum(dim=-1, keepdim=True)
    log_z = max_logit + sum_exp.log()
    out["logsumexp"], out["max_logit"] = log_z, max_logit
    target_logit = logits.gather(1, targets)
    out["logp"] = target_logit - log_z
    if "entropy" in want:
        out["entropy"] = log_z - _rowdot(exp_shifted, logits) / sum_exp
    if "minp_logp" in want or "minp_mass" in want:
        threshold = max_logit + cfg.log_rho
        in_safe_set = torch.ge(logits, threshold, out=scratch.get("mask", logits, torch.bool))
        safe_sum_exp = torch.where(in_safe_set, exp_shifted, zero, out=scratch.get("tmp", logits)).sum(dim=-1,
                                                                                                        keepdim=True)
        safe_log_z = max_logit + safe_sum_exp.log()
        out["threshold"], out["lse_safe"] = threshold, safe_log_z
        out["minp_logp"] = target_logit - safe_log_z
        out["minp_mass"] = safe_sum_exp / sum_exp
        out["minp_inside"] = target_logit >= threshold
    if cfg.kl_source == "logits":
        assert rollout is not None  # kl_source="logits" is only set with rollout logits
        rollout_logits = _rollout_chunk(rollout, cfg, logits.dtype, scratch)
        rollout_max = rollout_logits.amax(dim=-1, keepdim=True)
        rollout_exp = torch.sub(rollout_logits, rollout_max, out=scratch.get("rollout_exp", logits)).exp_()
        rollout_sum_exp = rollout_exp.sum(dim=-1, keepdim=True)
        rollout_log_z = rollout_max + rollout_sum_exp.log()
        out["lse_rollout"] = rollout_log_z
        if "kl" in want:
            out["kl"] = _centred_kl(rollout_logits, rollout_max, rollout_exp, rollout_sum_exp, logits, max_logit,
                                    exp_shifted, sum_exp, scratch)
        if "tv" in want:
            probs = torch.div(exp_shifted, sum_exp, out=scratch.get("tmp", logits))
            diff = torch.div(rollout_exp, rollout_sum_exp, out=rollout_exp).neg_().add_(probs)  # p − q (q is done)
            sign = torch.sign(diff, out=scratch.get("tmp2", logits))
            out["tv"] = 0.5 * _rowdot(sign, diff)                   # ½ Σ |p − q|
            out["tv_sbar"] = _rowdot(sign, probs)                   # Σ sign(p − q) p, the TV gradient's baseline
    elif cfg.kl_source == "topk":
        assert topk_logp is not None and topk_ids is not None  # kl_source="topk" is only set with both
        topk_logq = topk_logp.to(logits.dtype)
        topk_q = topk_logq.exp()
        topk_logp_train = logits.gather(1, topk_ids) - log_z
        # log p_rest from the complement's own logsumexp, not log(1 − Σ p_ids) (cancellation when top-k ≈ all).
        rest_logits = logits.scatter_(1, topk_ids, float("-inf"))
        rest_max = rest_logits.amax(dim=-1, keepdim=True)
        rest_max = torch.where(torch.isfinite(rest_max), rest_max, zero)  # empty complement: lse_rest = −inf
        rest_log_z = rest_max + torch.sub(rest_logits, rest_max, out=exp_shifted).exp_().sum(dim=-1,
                                                                                             keepdim=True).log()
        log_p_rest = rest_log_z - log_z
        # 1 − Σ q_i, within the rounding of the given log-probs
        q_rest = topk_rest_mass(rest_mass_bounds(topk_logp, logits.shape[-1]), log_p_rest, logits.dtype)
        out["q_rest"], out["lse_rest"], out["p_ids"] = q_rest, rest_log_z, topk_logp_train.exp()
        if "kl" in want:
            head = torch.where(topk_q > 0, topk_q * (topk_logq - topk_logp_train), zero).sum(dim=-1, keepdim=True)
            tail = torch.where(q_rest > 0, q_rest * (q_rest.clamp(min=1e-45).log() - log_p_rest), zero)
            out["kl"] = head + tail
        if "tv" in want:
            out["tv"] = 0.5 * ((topk_q - topk_logp_train.exp()).abs().sum(dim=-1, keepdim=True)
                               + (q_rest - log_p_rest.exp()).abs())
    return out


def _scatter_in_tile(g: Tensor, ids: Tensor, vals: Tensor, c0: int) -> None:
    """g[:, ids − c0] += vals for the ids that fall inside the tile's columns [c0, c0 + width)."""
    width = g.shape[1]
    inside = (ids >= c0) & (ids < c0 + width)
    g.scatter_add_(1, (ids - c0).clamp(0, width - 1), torch.where(inside, vals, torch.zeros((), dtype=vals.dtype)))


def _tile_membership(ids: Tensor, c0: int, width: int) -> Tensor:
    """Bool [n, width]: column c0 + j is one of the row's ``ids`` (ids outside the tile go to a dropped column)."""
    inside = (ids >= c0) & (ids < c0 + width)
    col = torch.where(inside, ids - c0, torch.full((), width, dtype=ids.dtype))
    hit = torch.zeros(ids.shape[0], width + 1, dtype=torch.bool, device=ids.device)
    return hit.scatter_(1, col, True)[:, :width]


def _backward_tile(logits: Tensor, c0: int, targets: Tensor, cfg: _Config, stats: dict[str, Tensor],
                   grads: dict[str, Tensor], rollout: Tensor | None, topk_logp: Tensor | None, topk_ids: Tensor | None,
                   scratch: _Scratch) -> Tensor:
    """∂(Σ_o grad_o · o)/∂z on a tile of logits ``z`` [n, C] = columns [c0, c0 + C) of n rows.

    Only per-row statistics saved by the forward are needed (lse, entropy, threshold, Z, the rollout's lse, Σ s·p
    for TV, the top-k probabilities), so the tile need not span the vocabulary: the backward is tiled in 2-D, which
    writes each slice of ∂W once per row block instead of streaming the whole ∂W once per row chunk.
    ``grads`` holds [n, 1] incoming grads (already × valid / τ); ``rollout`` is the matching [n, C] tile. The result
    lives in a scratch buffer: use it before the next tile.

    The gradient is p ⊙ (element_coef + row_coef), plus target_coef at the target and the top-k corrections.
    """
    log_z = stats["logsumexp"]
    zero = torch.zeros((), dtype=logits.dtype)
    probs = torch.sub(logits, log_z, out=scratch.get("probs", logits)).exp_()
    row_coef = torch.zeros_like(log_z)     # per-row part of the multiplier of p
    target_coef = torch.zeros_like(log_z)  # added at the target's column
    element_coef = scratch.get("coef", logits)  # per-element multiplier of p, built in place when an output needs one
    per_element = bool(grads.keys() & {"entropy", "minp_logp", "minp_mass", "tv"}) or (
        cfg.kl_source == "topk" and "kl" in grads)
    if "entropy" in grads:
        grad_entropy = grads["entropy"]
        torch.mul(logits, -grad_entropy, out=element_coef)
        row_coef -= grad_entropy * (stats["entropy"] - log_z)
    elif per_element:
        element_coef.zero_()
    if "logp" in grads:
        row_coef -= grads["logp"]
        target_coef += grads["logp"]
    if "minp_logp" in grads or "minp_mass" in grads:
        safe_coef = torch.zeros_like(log_z)
        if "minp_logp" in grads:
            safe_coef -= grads["minp_logp"] / stats["minp_mass"]
            target_coef += grads["minp_logp"]
        if "minp_mass" in grads:
            safe_coef += grads["minp_mass"]
            row_coef -= grads["minp_mass"] * stats["minp_mass"]
        in_safe_set = torch.ge(logits, stats["threshold"], out=scratch.get("mask", logits, torch.bool))
        element_coef.add_(torch.where(in_safe_set, safe_coef, zero, out=scratch.get("tmp", logits)))
    rollout_probs: Tensor | None = None
    topk_coef: Tensor | None = None
    if cfg.kl_source == "logits" and ("kl" in grads or "tv" in grads):
        assert rollout is not None
        rollout_logits = _rollout_chunk(rollout, cfg, logits.dtype, scratch)
        rollout_probs = torch.sub(rollout_logits, stats["lse_rollout"], out=scratch.get("rollout_probs", logits)).exp_()
        if "kl" in grads:
            row_coef += grads["kl"]
        if "tv" in grads:
            half_grad_tv = 0.5 * grads["tv"]
            row_coef -= half_grad_tv * stats["tv_sbar"]
            element_coef.add_(torch.sub(probs, rollout_probs, out=scratch.get("tmp", logits)).sign_().mul_(half_grad_tv))
        if "kl" not in grads:
            rollout_probs = None
    elif cfg.kl_source == "topk" and ("kl" in grads or "tv" in grads):
        assert topk_logp is not None and topk_ids is not None
        topk_q = topk_logp.to(logits.dtype).exp()
        q_rest, topk_p = stats["q_rest"], stats["p_ids"]
        p_rest = torch.exp(stats["lse_rest"] - log_z)
        topk_coef = torch.zeros_like(topk_q)
        if "kl" in grads:
            # p − q̃ with q̃ = q_i on the ids and q_rest · p / p_rest on the rest. The rest-only factor can be huge
            # (p_rest ≈ 0): it goes on the rest columns only, never added on the ids and subtracted back (fp32
            # cancellation).
            grad_kl = grads["kl"]
            row_coef += grad_kl
            rest_coef = -grad_kl * torch.where(p_rest > 0, q_rest / p_rest, zero)
            in_topk = _tile_membership(topk_ids, c0, logits.shape[1])
            element_coef.add_(torch.where(in_topk, zero, rest_coef, out=scratch.get("tmp", logits)))
            topk_coef -= grad_kl * topk_q
        if "tv" in grads:
            half_grad_tv = 0.5 * grads["tv"]
            topk_sign = torch.sign(topk_p - topk_q)
            rest_sign = torch.sign(p_rest - q_rest)
            mean_sign = (topk_sign * topk_p).sum(dim=-1, keepdim=True) + rest_sign * p_rest
            row_coef += half_grad_tv * (rest_sign - mean_sign)
            topk_coef += half_grad_tv * (topk_sign - rest_sign) * topk_p
    grad = probs.mul_(element_coef.add_(row_coef)) if per_element else probs.mul_(row_coef)
    if rollout_probs is not None:
        grad.addcmul_(rollout_probs, -grads["kl"])
    if topk_coef is not None:
        assert topk_ids is not None
        _scatter_in_tile(grad, topk_ids, topk_coef, c0)
    _scatter_in_tile(grad, targets, target_coef, c0)
    return grad


def _tiles(n: int, vocab: int, cfg: _Config, itemsize: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Row blocks × column slices for the backward: square-ish tiles of ≤ budget / buffers elements."""
    elems = max(1, cfg.memory_budget_bytes // (itemsize * cfg.buffers()))
    rows = max(1, min(n, math.isqrt(elems)))
    cols = max(1, min(vocab, elems // rows))
    return row_chunks(n, rows), row_chunks(vocab, cols)


# ---------------------------------------------------------------------------------------------------------------
# Driver shared by both autograd functions.
# ---------------------------------------------------------------------------------------------------------------

_SAVED = ("logsumexp", "entropy", "threshold", "minp_mass", "lse_rollout", "tv_sbar", "q_rest", "lse_rest", "p_ids")


ROW_PATH_MIN_ROWS = 256  # full-row chunks at least this tall keep the matmul efficient; otherwise 2-D tiles


def _rows(x: Tensor | None, a: int, b: int) -> Tensor | None:
    return None if x is None else x[a:b]


def _run_forward(get_tile, n: int, vocab: int, targets: Tensor, cfg: _Config, rollout, topk_logp, topk_ids, dtype):
    """Per-row statistics of all N rows, chunk by chunk; returns (stats, valid, target_ids)."""
    valid = targets != cfg.ignore_index
    target_ids = torch.where(valid, targets, torch.zeros_like(targets)).unsqueeze(1)
    itemsize = torch.finfo(dtype).bits // 8
    parts: dict[str, list[Tensor]] = {}
    scratch = _Scratch()
    rows = chunk_rows(n, vocab, buffers=cfg.buffers(), itemsize=itemsize, memory_budget_bytes=cfg.memory_budget_bytes)
    if rows >= min(n, ROW_PATH_MIN_ROWS):
        # Full rows per chunk: one pass gives the max, then the min-p safe set and TV in the same chunk.
        for a, b in row_chunks(n, rows):
            stats_rows = _forward_chunk(get_tile(a, b, 0, vocab, scratch), target_ids[a:b], cfg, _rows(rollout, a, b),
                                        _rows(topk_logp, a, b), _rows(topk_ids, a, b), scratch)
            for k, v in stats_rows.items():
                parts.setdefault(k, []).append(v)
    else:
        # A row chunk of a 150k vocabulary within a small budget is a few dozen rows, and re-reading all of W per
        # chunk costs more than the matmul itself: stream over 2-D tiles with running max / rescaled sums instead.
        # min-p (needs the final max) and TV (needs both final normalisers) take a second pass over the tiles.
        row_blocks, col_slices = _tiles(n, vocab, cfg, itemsize)
        for a, b in row_blocks:
            def tile_fn(v0: int, v1: int, a: int = a, b: int = b) -> Tensor:  # rows a:b, columns v0:v1
                return get_tile(a, b, v0, v1, scratch)

            rollout_rows = _rows(rollout, a, b)
            stats_rows = _forward_online(tile_fn, col_slices, target_ids[a:b], cfg, rollout_rows, _rows(topk_logp, a, b),
                                         _rows(topk_ids, a, b), scratch)
            if cfg.want & {"minp_logp", "minp_mass"} or (cfg.kl_source == "logits" and "tv" in cfg.want):
                stats_rows.update(_forward_second_pass(tile_fn, col_slices, target_ids[a:b], cfg, rollout_rows,
                                                       stats_rows, scratch))
            for k, v in stats_rows.items():
                parts.setdefault(k, []).append(v)
    stats = {k: torch.cat(v) for k, v in parts.items()}  # [N, 1] per-row statistics ([N, K] for p_ids)
    return stats, valid, target_ids


def _finite(running_max: Tensor) -> Tensor:
    """A running maximum with −inf (nothing seen yet, or all −inf) read as 0, as :func:`_online_update` shifts."""
    return torch.where(torch.isfinite(running_max), running_max, torch.zeros((), dtype=running_max.dtype))


def _online_update(running_max: Tensor, running_sum: Tensor, tile: Tensor, exp_out: Tensor):
    """Merge a tile into a running (max, Σ e^{x − max}) pair; returns (max, sum, the factor rescaling other running
    sums to the new max, e^{tile − max})."""
    new_max = torch.maximum(running_max, tile.amax(dim=-1, keepdim=True))
    safe_max = torch.where(torch.isfinite(new_max), new_max, torch.zeros((), dtype=running_max.dtype))  # all −inf yet
    rescale = torch.exp(running_max - safe_max)
    tile_exp = torch.sub(tile, safe_max, out=exp_out).exp_()
    return new_max, running_sum * rescale + tile_exp.sum(dim=-1, keepdim=True), rescale, tile_exp


def _forward_online(tile_fn, col_slices, targets: Tensor, cfg: _Config, rollout: Tensor | None,
                    topk_logp: Tensor | None, topk_ids: Tensor | None, scratch: _Scratch) -> dict[str, Tensor]:
    """Same statistics as :func:`_forward_chunk` for logp / entropy / KL, streaming over vocabulary slices with
    running maxima and rescaled sums (the online softmax)."""
    n = targets.shape[0]
    col_slices = list(col_slices)
    first = tile_fn(*col_slices[0])  # its dtype and device start the running sums
    dtype, device = first.dtype, first.device

    def full(val: float) -> Tensor:
        return torch.full((n, 1), val, dtype=dtype, device=device)

    max_logit, sum_exp, sum_exp_logit, target_logit = full(float("-inf")), full(0.0), full(0.0), full(0.0)
    # Σ e^{z − max}·z is the entropy's; Σ e^{r − max_r}·d and S_r − S (see _centred_kl) are the KL's
    rollout_max, rollout_sum_exp = full(float("-inf")), full(0.0)
    kl_sum_q_d, kl_gap = full(0.0), full(0.0)
    # the logits outside the rollout's top-k, and those inside
    rest_max, rest_sum_exp = full(float("-inf")), full(0.0)
    topk_logits = torch.zeros(topk_ids.shape if topk_ids is not None else (n, 1), dtype=dtype, device=device)
    for i, (v0, v1) in enumerate(col_slices):
        logits = first if i == 0 else tile_fn(v0, v1)
        width = v1 - v0
        in_tile = (targets >= v0) & (targets < v1)
        target_logit = torch.where(in_tile, logits.gather(1, (targets - v0).clamp(0, width - 1)), target_logit)
        old_max, old_sum_exp = max_logit, sum_exp
        max_logit, sum_exp, rescale, tile_exp = _online_update(max_logit, sum_exp, logits, scratch.get("exp", logits))
        if "entropy" in cfg.want:
            sum_exp_logit = sum_exp_logit * rescale + _rowdot(tile_exp, logits)
        if cfg.kl_source == "logits" and cfg.want & {"kl", "tv"}:
            assert rollout is not None
            rollout_logits = _rollout_chunk(rollout[:, v0:v1], cfg, dtype, scratch)
            old_rollout_max, old_rollout_sum_exp = rollout_max, rollout_sum_exp
            rollout_max, rollout_sum_exp, rescale_rollout, rollout_exp = _online_update(
                rollout_max, rollout_sum_exp, rollout_logits, scratch.get("rollout_exp", logits))
            # the centred KL of _centred_kl, streamed: Σ q d and S_r − S, both relative to the running maxima;
            # when a maximum moves, d moves by the change of (max z − max r) and the gap is carried exactly
            shift = _finite(rollout_max) - _finite(old_rollout_max) - (_finite(max_logit) - _finite(old_max))
            kl_sum_q_d = torch.where(old_rollout_sum_exp > 0, (kl_sum_q_d - old_rollout_sum_exp * shift)
                                     * rescale_rollout, 0.0)
            carried = torch.where(old_sum_exp > 0, rescale * torch.expm1(
                (old_rollout_max - _finite(rollout_max)) - (old_max - _finite(max_logit))) * old_sum_exp, 0.0)
            kl_gap = kl_gap * rescale_rollout + torch.where(old_rollout_sum_exp > 0, carried,
                                                            -old_sum_exp * rescale)
            d = torch.sub(rollout_logits, _finite(rollout_max), out=scratch.get("tmp", logits)).sub_(logits).add_(
                _finite(max_logit))
            q_zero = torch.eq(rollout_exp, 0, out=scratch.get("mask", logits, torch.bool))
            kl_sum_q_d = kl_sum_q_d + _rowdot(rollout_exp, d.masked_fill(q_zero, 0.0))
            kl_gap = kl_gap + torch.where(d.abs() < 1, tile_exp * torch.expm1(d.clamp(-1, 1)),
                                          rollout_exp - tile_exp).sum(dim=-1, keepdim=True)
        elif cfg.kl_source == "topk" and cfg.want & {"kl", "tv"}:
            assert topk_ids is not None
            in_tile_ids = (topk_ids >= v0) & (topk_ids < v1)
            topk_logits = torch.where(in_tile_ids, logits.gather(1, (topk_ids - v0).clamp(0, width - 1)), topk_logits)
            rest_logits = torch.where(_tile_membership(topk_ids, v0, width),
                                      torch.full((), float("-inf"), dtype=dtype), logits, out=scratch.get("tmp", logits))
            rest_max, rest_sum_exp, _, _ = _online_update(rest_max, rest_sum_exp, rest_logits, tile_exp)
    log_z = max_logit + sum_exp.log()
    out = {"logsumexp": log_z, "max_logit": max_logit, "logp": target_logit - log_z}
    if "entropy" in cfg.want:
        out["entropy"] = log_z - sum_exp_logit / sum_exp
    if cfg.kl_source == "logits" and cfg.want & {"kl", "tv"}:
        rollout_log_z = rollout_max + rollout_sum_exp.log()
        out["lse_rollout"] = rollout_log_z
        e_q_d = kl_sum_q_d / rollout_sum_exp
        out["kl"] = torch.where(torch.isinf(e_q_d), e_q_d, e_q_d - torch.log1p(kl_gap / sum_exp))
    elif cfg.kl_source == "topk" and cfg.want & {"kl", "tv"}:
        assert topk_logp is not None
        topk_logq = topk_logp.to(dtype)
        topk_q = topk_logq.exp()
        zero = torch.zeros((), dtype=dtype)
        topk_logp_train = topk_logits - log_z
        rest_log_z = rest_max + rest_sum_exp.log()
        log_p_rest = rest_log_z - log_z
        q_rest = topk_rest_mass(rest_mass_bounds(topk_logp, col_slices[-1][1]), log_p_rest, dtype)  # as _forward_chunk
        out["q_rest"], out["lse_rest"], out["p_ids"] = q_rest, rest_log_z, topk_logp_train.exp()
        head = torch.where(topk_q > 0, topk_q * (topk_logq - topk_logp_train), zero).sum(dim=-1, keepdim=True)
        tail = torch.where(q_rest > 0, q_rest * (q_rest.clamp(min=1e-45).log() - log_p_rest), zero)
        out["kl"] = head + tail
        out["tv"] = 0.5 * ((topk_q - topk_logp_train.exp()).abs().sum(dim=-1, keepdim=True)
                           + (q_rest - log_p_rest.exp()).abs())
    return out


def _forward_second_pass(tile_fn, col_slices, targets: Tensor, cfg: _Config, rollout: Tensor | None,
                         stats: dict[str, Tensor], scratch: _Scratch) -> dict[str, Tensor]:
    """min-p safe-set sums and exact TV, once the row max, lse and the rollout's lse are known (tiled path)."""
    max_logit, log_z = stats["max_logit"], stats["logsumexp"]
    target_logit = stats["logp"] + log_z
    want_minp = bool(cfg.want & {"minp_logp", "minp_mass"})
    want_tv = cfg.kl_source == "logits" and "tv" in cfg.want
    threshold = max_logit + cfg.log_rho
    safe_sum_exp = torch.zeros_like(max_logit)
    tv = torch.zeros_like(max_logit)
    mean_sign = torch.zeros_like(max_logit)
    for v0, v1 in col_slices:
        logits = tile_fn(v0, v1)
        zero = torch.zeros((), dtype=logits.dtype)
        if want_minp:
            exp_shifted = torch.sub(logits, max_logit, out=scratch.get("exp", logits)).exp_()
            in_safe_set = torch.ge(logits, threshold, out=scratch.get("mask", logits, torch.bool))
            safe_sum_exp += torch.where(in_safe_set, exp_shifted, zero, out=scratch.get("tmp", logits)).sum(
                dim=-1, keepdim=True)
        if want_tv:
            probs = torch.sub(logits, log_z, out=scratch.get("exp", logits)).exp_()
            assert rollout is not None  # want_tv: kl_source="logits"
            rollout_logits = _rollout_chunk(rollout[:, v0:v1], cfg, logits.dtype, scratch)
            diff = torch.sub(rollout_logits, stats["lse_rollout"],
                             out=scratch.get("rollout_exp", logits)).exp_().neg_().add_(probs)  # p − q
            sign = torch.sign(diff, out=scratch.get("tmp2", logits))
            tv += 0.5 * _rowdot(sign, diff)
            mean_sign += _rowdot(sign, probs)
    out: dict[str, Tensor] = {}
    if want_minp:
        safe_log_z = max_logit + safe_sum_exp.log()
        out.update(threshold=threshold, lse_safe=safe_log_z, minp_logp=target_logit - safe_log_z,
                   minp_mass=torch.exp(safe_log_z - log_z), minp_inside=target_logit >= threshold)
    if want_tv:
        out.update(tv=tv, tv_sbar=mean_sign)
    return out


def _outputs(stats: dict[str, Tensor], valid: Tensor, cfg: _Config, n: int, device, dtype) -> tuple[Tensor, ...]:
    """Fixed-arity tuple: the six differentiable outputs then the three auxiliaries (zeros when not requested)."""
    res = []
    for name in DIFF_OUTPUTS + _AUX_OUTPUTS:
        v = stats.get(name)
        if v is None or (name in DIFF_OUTPUTS and name not in cfg.want):
            res.append(torch.zeros(n, device=device, dtype=torch.bool if name == "minp_inside" else dtype))
        else:
            res.append(torch.where(valid, v.squeeze(1), torch.zeros((), dtype=v.dtype, device=v.device)))
    return tuple(res)


def _grad_outputs(grads: tuple[Tensor | None, ...], valid: Tensor, cfg: _Config, dtype) -> dict[str, Tensor]:
    go = {}
    for name, grad in zip(DIFF_OUTPUTS, grads):
        if grad is not None and name in cfg.want:
            # Ignored rows get no gradient; 1/τ is folded in here because z = (W h + b) / τ.
            go[name] = (torch.where(valid, grad.to(dtype), torch.zeros((), dtype=dtype)) / cfg.temperature).unsqueeze(1)
    return go


class _FusedLinearStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rollout, topk_logp, topk_ids, cfg):
        dtype = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
        b = None if bias is None else bias.to(dtype)
        inv_t = 1.0 / cfg.temperature

        def get_tile(a: int, c: int, v0: int, v1: int, scratch: _Scratch) -> Tensor:
            h, weight_slice = hidden[a:c].to(dtype), weight[v0:v1].to(dtype)  # a 16-bit head: this slice up-cast
            logits_tile = scratch.new("logits", (c - a, v1 - v0), dtype, weight.device)
            if b is None:
                logits_tile = torch.mm(h, weight_slice.t(), out=logits_tile)
            else:  # a −inf bias entry (masked vocabulary) must not turn 0 · z into NaN
                logits_tile = torch.addmm(b[v0:v1], h, weight_slice.t(), out=logits_tile).clamp_(min=_NEG_LOGIT)
            return logits_tile.mul_(inv_t) if inv_t != 1.0 else logits_tile

        n, vocab = hidden.shape[0], weight.shape[0]
        stats, valid, target_ids = _run_forward(get_tile, n, vocab, targets, cfg, rollout, topk_logp, topk_ids, dtype)
        ctx.set_materialize_grads(False)
        ctx.cfg, ctx.dtype = cfg, dtype
        ctx.keys = [k for k in _SAVED if k in stats]
        ctx.save_for_backward(hidden, weight, bias, target_ids, valid, rollout, topk_logp, topk_ids,
                              *[stats[k] for k in ctx.keys])
        outs = _outputs(stats, valid, cfg, n, hidden.device, dtype)
        ctx.mark_non_differentiable(*outs[len(DIFF_OUTPUTS):])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        hidden, weight, bias, target_ids, valid, rollout, topk_logp, topk_ids, *saved = ctx.saved_tensors
        cfg, dtype = ctx.cfg, ctx.dtype
        go = _grad_outputs(grads[: len(DIFF_OUTPUTS)], valid, cfg, dtype)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if not go or not (need_h or need_w or need_b):
            return (None,) * 8
        stats = dict(zip(ctx.keys, saved))
        b = None if bias is None else bias.to(dtype)
        inv_t = 1.0 / cfg.temperature
        grad_hidden = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        grad_bias = (torch.zeros(weight.shape[0], dtype=dtype, device=weight.device) if need_b and bias is not None
                     else None)
        row_blocks, col_slices = _tiles(hidden.shape[0], weight.shape[0], cfg, torch.finfo(dtype).bits // 8)
        scratch = _Scratch()
        for a, c in row_blocks:
            h = hidden[a:c].to(dtype)
            stats_rows = {k: v[a:c] for k, v in stats.items()}
            grads_rows = {k: v[a:c] for k, v in go.items()}
            for v0, v1 in col_slices:
                weight_slice = weight[v0:v1].to(dtype)  # a 16-bit head: this slice up-cast, no [V, H] copy
                logits_tile = scratch.new("logits", (c - a, v1 - v0), dtype, hidden.device)
                if b is None:
                    logits_tile = torch.mm(h, weight_slice.t(), out=logits_tile)
                else:
                    logits_tile = torch.addmm(b[v0:v1], h, weight_slice.t(), out=logits_tile).clamp_(min=_NEG_LOGIT)
                if inv_t != 1.0:
                    logits_tile.mul_(inv_t)
                grad_logits = _backward_tile(logits_tile, v0, target_ids[a:c], cfg, stats_rows, grads_rows,
                                             None if rollout is None else rollout[a:c, v0:v1], _rows(topk_logp, a, c),
                                             _rows(topk_ids, a, c), scratch)
                if grad_hidden is not None:
                    grad_hidden[a:c].addmm_(grad_logits, weight_slice)
                if grad_weight is not None:
                    grad_weight[v0:v1].addmm_(grad_logits.t(), h)
                if grad_bias is not None:
                    grad_bias[v0:v1] += grad_logits.sum(dim=0)
        return (None if grad_hidden is None else grad_hidden.to(hidden.dtype),
                None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None, None)


class _LogitStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, rollout, topk_logp, topk_ids, cfg):
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        inv_t = 1.0 / cfg.temperature

        def get_tile(a: int, c: int, v0: int, v1: int, scratch: _Scratch) -> Tensor:
            # owned copy (the chunk math works in place); −inf logits (masked vocabulary) become _NEG_LOGIT so that
            # 0 · z terms (entropy, gradients) read 0, not NaN.
            logits_tile = scratch.new("logits", (c - a, v1 - v0), dtype, logits.device).copy_(logits[a:c, v0:v1])
            logits_tile.clamp_(min=_NEG_LOGIT)
            return logits_tile.mul_(inv_t) if inv_t != 1.0 else logits_tile

        n, vocab = logits.shape
        stats, valid, target_ids = _run_forward(get_tile, n, vocab, targets, cfg, rollout, topk_logp, topk_ids, dtype)
        ctx.set_materialize_grads(False)
        ctx.cfg, ctx.dtype = cfg, dtype
        ctx.keys = [k for k in _SAVED if k in stats]
        ctx.save_for_backward(logits, target_ids, valid, rollout, topk_logp, topk_ids, *[stats[k] for k in ctx.keys])
        outs = _outputs(stats, valid, cfg, n, logits.device, dtype)
        ctx.mark_non_differentiable(*outs[len(DIFF_OUTPUTS):])
        return outs

    @staticmethod
    def backward(ctx, *grads):
        logits, target_ids, valid, rollout, topk_logp, topk_ids, *saved = ctx.saved_tensors
        cfg, dtype = ctx.cfg, ctx.dtype
        go = _grad_outputs(grads[: len(DIFF_OUTPUTS)], valid, cfg, dtype)
        if not go or not ctx.needs_input_grad[0]:
            return (None,) * 6
        stats = dict(zip(ctx.keys, saved))
        inv_t = 1.0 / cfg.temperature
        grad = torch.empty_like(logits)
        row_blocks, col_slices = _tiles(logits.shape[0], logits.shape[1], cfg, torch.finfo(dtype).bits // 8)
        scratch = _Scratch()
        for a, c in row_blocks:
            stats_rows = {k: v[a:c] for k, v in stats.items()}
            grads_rows = {k: v[a:c] for k, v in go.items()}
            for v0, v1 in col_slices:
                logits_tile = scratch.new("logits", (c - a, v1 - v0), dtype, logits.device).copy_(logits[a:c, v0:v1])
                logits_tile.clamp_(min=_NEG_LOGIT)
                if inv_t != 1.0:
                    logits_tile.mul_(inv_t)
                grad[a:c, v0:v1] = _backward_tile(logits_tile, v0, target_ids[a:c], cfg, stats_rows, grads_rows,
                                                  None if rollout is None else rollout[a:c, v0:v1],
                                                  None if topk_logp is None else topk_logp[a:c],
                                                  None if topk_ids is None else topk_ids[a:c], scratch)
        return grad, None, None, None, None, None


# ---------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------

_WANT_ALIASES = {"minp": ("minp_logp", "minp_mass")}


def _resolve_want(want: Iterable[str] | None, min_p_rho: float | None, kl_source: str | None) -> frozenset[str]:
    if want is None:
        names = {"logp"}
        if min_p_rho is not None:
            names |= {"minp_logp", "minp_mass"}
        if kl_source is not None:
            names.add("kl")
    else:
        if isinstance(want, str):
            want = (want,)
        names = set()
        for w in want:
            names.update(_WANT_ALIASES.get(w, (w,)))
    unknown = names - set(DIFF_OUTPUTS)
    if unknown:
        raise ValueError(f"want has unknown outputs {sorted(unknown)}; choose from {DIFF_OUTPUTS} (or 'minp')")
    if names & {"minp_logp", "minp_mass"} and min_p_rho is None:
        raise ValueError("want asks for minp_logp/minp_mass but min_p_rho is None")
    if names & {"kl", "tv"} and kl_source is None:
        raise ValueError("want asks for kl/tv but neither rollout_logits nor rollout_topk_logp/ids is given")
    return frozenset(names)


def _check_common(n: int, vocab: int, targets: Tensor, temperature: float, min_p_rho: float | None,
                  rollout_logits: Tensor | None, rollout_topk_logp: Tensor | None, rollout_topk_ids: Tensor | None,
                  rollout_temperature: float, memory_budget_bytes: int) -> str | None:
    if not isinstance(targets, Tensor) or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError("targets must be an integer tensor of token ids")
    if targets.shape != (n,):
        raise ValueError(f"targets must have shape ({n},), got {tuple(targets.shape)}")
    for name, t in (("temperature", temperature), ("rollout_temperature", rollout_temperature)):
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {t!r}")
    if min_p_rho is not None and not (isinstance(min_p_rho, (int, float)) and 0 < min_p_rho <= 1):
        raise ValueError(f"min_p_rho must be in (0, 1], got {min_p_rho!r}")
    if memory_budget_bytes <= 0:
        raise ValueError(f"memory_budget_bytes must be > 0, got {memory_budget_bytes}")
    if rollout_logits is not None and (rollout_topk_logp is not None or rollout_topk_ids is not None):
        raise ValueError("give either rollout_logits or rollout_topk_logp/rollout_topk_ids, not both")
    if rollout_logits is not None:
        if rollout_logits.shape != (n, vocab):
            raise ValueError(f"rollout_logits must have shape ({n}, {vocab}), got {tuple(rollout_logits.shape)}")
        return "logits"
    if (rollout_topk_logp is None) != (rollout_topk_ids is None):
        raise ValueError("rollout_topk_logp and rollout_topk_ids must be given together")
    if rollout_topk_logp is not None:
        if rollout_topk_logp.dim() != 2 or rollout_topk_logp.shape[0] != n or not rollout_topk_logp.is_floating_point():
            raise ValueError(f"rollout_topk_logp must be a float [{n}, K] tensor, got {tuple(rollout_topk_logp.shape)}")
        assert rollout_topk_ids is not None  # given together (checked above)
        if rollout_topk_ids.shape != rollout_topk_logp.shape or rollout_topk_ids.dtype.is_floating_point:
            raise ValueError("rollout_topk_ids must be an integer tensor with rollout_topk_logp's shape")
        if rollout_topk_logp.shape[1] > vocab:
            raise ValueError(f"rollout_topk_logp has K={rollout_topk_logp.shape[1]} > vocabulary {vocab}")
        return "topk"
    return None


def _to_stats(outs: tuple[Tensor, ...], cfg: _Config, shape: tuple[int, ...]) -> TokenStats:
    named = dict(zip(DIFF_OUTPUTS + _AUX_OUTPUTS, outs))
    keep = set(cfg.want) | {"max_logit", "logsumexp"}
    if cfg.want & {"minp_logp", "minp_mass"}:
        keep.add("minp_inside")
    fields = {k: (v.reshape(shape) if k in keep else None) for k, v in named.items()}
    return TokenStats(**fields, kl_kind=None if cfg.kl_source is None else ("exact" if cfg.kl_source == "logits" else "topk"))


def fused_token_stats(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None,
                      temperature: float = 1.0, want: Iterable[str] | None = None, min_p_rho: float | None = None,
                      rollout_logits: Tensor | None = None, rollout_topk_logp: Tensor | None = None,
                      rollout_topk_ids: Tensor | None = None, rollout_temperature: float = 1.0,
                      ignore_index: int = IGNORE_INDEX,
                      memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> TokenStats:
    """Per-token log-prob, entropy, DVP min-p statistics and KL/TV to the rollout, from hidden states, chunked.

    Shapes: ``hidden`` [N, H], ``weight`` [V, H] (lm_head), ``targets`` [N] (sampled ids; ``ignore_index`` rows give
    0 and no gradient), ``bias`` [V]. Rollout μ: ``rollout_logits`` [N, V] (divided by ``rollout_temperature``; pass
    processed logits/log-probs with the default 1.0), or ``rollout_topk_logp`` [N, K] normalised log-probs with
    ``rollout_topk_ids`` [N, K] (unique per row). ``want`` picks outputs from ``DIFF_OUTPUTS`` (``"minp"`` = both
    min-p outputs); default: logp, plus min-p outputs if ``min_p_rho`` is set, plus kl if a rollout is given.
    Implements: "Dynamic Vocabulary Pruning" (arXiv 2512.23087) Defs 5.1–5.2 and Prop 5.6 for the min-p outputs; the exact token KL
    of Trust Region Masking (arXiv 2512.23075) and its top-k lower bound (:mod:`offpolicy.divergence`) for ``kl``.
    No ``[N, V]`` tensor is kept; at most ``memory_budget_bytes`` of chunk scratch is alive at once.

    >>> _ = torch.manual_seed(0); h, w = torch.randn(4, 8), torch.randn(11, 8); y = torch.tensor([1, 2, -100, 3])
    >>> s = fused_token_stats(h, w, y, want=("logp", "entropy"))
    >>> ref = torch.log_softmax(h @ w.T, -1).gather(1, y.clamp(min=0)[:, None])[:, 0]
    >>> bool(torch.allclose(s.logp[[0, 1, 3]], ref[[0, 1, 3]], atol=1e-5)), s.logp[2].item()
    (True, 0.0)
    """
    if not isinstance(hidden, Tensor) or hidden.dim() != 2 or not hidden.is_floating_point():
        raise ValueError(f"hidden must be a float [N, H] tensor, got {getattr(hidden, 'shape', type(hidden))}")
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, {hidden.shape[1]}], got {getattr(weight, 'shape', type(weight))}")
    if bias is not None and (not isinstance(bias, Tensor) or bias.shape != (weight.shape[0],)):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {getattr(bias, 'shape', type(bias))}")
    n, vocab = hidden.shape[0], weight.shape[0]
    source = _check_common(n, vocab, targets, temperature, min_p_rho, rollout_logits, rollout_topk_logp,
                           rollout_topk_ids, rollout_temperature, memory_budget_bytes)
    cfg = _Config(_resolve_want(want, min_p_rho, source), float(temperature),
                  math.log(min_p_rho) if min_p_rho is not None else 0.0, float(rollout_temperature), source,
                  int(ignore_index), int(memory_budget_bytes))
    def detach(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.detach()

    outs = _FusedLinearStats.apply(hidden, weight, bias, targets, detach(rollout_logits), detach(rollout_topk_logp),
                                   detach(rollout_topk_ids), cfg)
    return _to_stats(outs, cfg, (n,))


def fused_logp(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None,
               temperature: float = 1.0, ignore_index: int = IGNORE_INDEX,
               memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> Tensor:
    """log π(y_n) [N] from hidden states [N, H] and lm_head [V, H], chunked (see :func:`fused_token_stats`).

    >>> h, w = torch.zeros(2, 3), torch.zeros(4, 3)           # uniform policy over 4 tokens: log(1/4)
    >>> fused_logp(h, w, torch.tensor([0, 3]))
    tensor([-1.3863, -1.3863])
    """
    logp = fused_token_stats(hidden, weight, targets, bias=bias, temperature=temperature, want=("logp",),
                             ignore_index=ignore_index, memory_budget_bytes=memory_budget_bytes).logp
    assert logp is not None  # requested
    return logp


def token_stats_from_logits(logits: Tensor, targets: Tensor, *, temperature: float = 1.0,
                            want: Iterable[str] | None = None, min_p_rho: float | None = None,
                            rollout_logits: Tensor | None = None, rollout_topk_logp: Tensor | None = None,
                            rollout_topk_ids: Tensor | None = None, rollout_temperature: float = 1.0,
                            ignore_index: int = IGNORE_INDEX,
                            memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> TokenStats:
    """Same statistics as :func:`fused_token_stats` from logits that already exist, ``[..., V]`` → ``[...]``.

    Row-chunked, so the only ``[..., V]`` tensors are the inputs (and, in backward, their gradient). Rollout tensors
    have the logits' leading shape: ``rollout_logits`` [..., V], ``rollout_topk_logp``/``ids`` [..., K].

    >>> z = torch.tensor([[[2.0, 0.0, -30.0]]])                    # [B=1, T=1, V=3]
    >>> s = token_stats_from_logits(z, torch.tensor([[1]]), min_p_rho=1e-6)
    >>> round(s.logp.item(), 4), round(s.minp_logp.item(), 4), bool(s.minp_inside)   # token 2 is pruned
    (-2.1269, -2.1269, True)
    """
    if not isinstance(logits, Tensor) or logits.dim() < 1 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float [..., V] tensor, got {getattr(logits, 'shape', type(logits))}")
    lead, vocab = tuple(logits.shape[:-1]), logits.shape[-1]
    if not isinstance(targets, Tensor) or tuple(targets.shape) != lead:
        raise ValueError(f"targets must have shape {lead}, got {getattr(targets, 'shape', type(targets))}")
    n = math.prod(lead)
    def flat(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.detach().reshape(n, t.shape[-1])

    roll, tkl, tki = flat(rollout_logits), flat(rollout_topk_logp), flat(rollout_topk_ids)
    for name, orig in (("rollout_logits", rollout_logits), ("rollout_topk_logp", rollout_topk_logp)):
        if orig is not None and tuple(orig.shape[:-1]) != lead:
            raise ValueError(f"{name} must have leading shape {lead}, got {tuple(orig.shape)}")
    source = _check_common(n, vocab, targets.reshape(n), temperature, min_p_rho, roll, tkl, tki,
                           rollout_temperature, memory_budget_bytes)
    cfg = _Config(_resolve_want(want, min_p_rho, source), float(temperature),
                  math.log(min_p_rho) if min_p_rho is not None else 0.0, float(rollout_temperature), source,
                  int(ignore_index), int(memory_budget_bytes))
    outs = _LogitStats.apply(logits.reshape(n, vocab), targets.reshape(n), roll, tkl, tki, cfg)
    return _to_stats(outs, cfg, lead)
