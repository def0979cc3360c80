"""The per-tile mathematics of the fused kernel (:mod:`offpolicy.kernels.fused` has the equations): one chunk or
tile of logits → the per-row statistics of the forward, and the gradient w.r.t. the logits of every requested output
in the backward; the top-k rest-mass bounds; the tiling of ``[N, V]`` under a memory budget. Shared by the
hidden-state path and the logits path (:mod:`offpolicy.kernels.fused_autograd`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from offpolicy.kernels.chunking import row_chunks

IGNORE_INDEX = -100
_NEG_LOGIT = -1e30  # stands in for −inf logits on the logits path (finite: 0 · z stays 0)
DIFF_OUTPUTS: tuple[str, ...] = ("logp", "entropy", "minp_logp", "minp_mass", "kl", "tv")
_AUX_OUTPUTS: tuple[str, ...] = ("minp_inside", "max_logit", "logsumexp")


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
