"""The fused kernel's two ``torch.autograd.Function`` s — hidden states × lm_head, and given logits — and the driver
they share: full-row chunks (one pass) or 2-D tiles with running max / rescaled sums (plus a second pass for min-p and
exact TV) in the forward, 2-D tiles in the backward. :mod:`offpolicy.kernels.fused` has the equations and the public
functions; :mod:`offpolicy.kernels.fused_tiles` the per-tile mathematics.
"""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.kernels.chunking import chunk_rows, row_chunks
from offpolicy.kernels.fused_tiles import (
    _AUX_OUTPUTS,
    _NEG_LOGIT,
    DIFF_OUTPUTS,
    _backward_tile,
    _Config,
    _forward_chunk,
    _rollout_chunk,
    _rowdot,
    _Scratch,
    _tile_membership,
    _tiles,
    rest_mass_bounds,
    topk_rest_mass,
)

# ---------------------------------------------------------------------------------------------------------------
# Driver shared by both autograd functions.
# ---------------------------------------------------------------------------------------------------------------

_SAVED = ("logsumexp", "entropy", "threshold", "minp_mass", "lse_rollout", "tv_sbar", "q_rest", "lse_rest", "p_ids")


ROW_PATH_MIN_ROWS = 256  # full-row chunks at least this tall keep the matmul efficient; otherwise 2-D tiles


def _rows(x: Tensor | None, a: int, b: int) -> Tensor | None:
    return None if x is None else x[a:b]


def _linear_tile(h: Tensor, w: Tensor, bias: Tensor | None, v0: int, inv_t: float, scratch: _Scratch) -> Tensor:
    """z = (h wᵀ + b) / τ of rows ``h`` and the vocabulary slice ``w`` starting at ``v0`` (both in compute dtype)."""
    tile = scratch.new("logits", (h.shape[0], w.shape[0]), h.dtype, h.device)
    if bias is None:
        tile = torch.mm(h, w.t(), out=tile)
    else:  # a −inf bias entry (masked vocabulary) must not turn 0 · z into NaN
        tile = torch.addmm(bias[v0:v0 + w.shape[0]], h, w.t(), out=tile).clamp_(min=_NEG_LOGIT)
    return tile.mul_(inv_t) if inv_t != 1.0 else tile


def _logit_tile(logits: Tensor, a: int, c: int, v0: int, v1: int, dtype, inv_t: float, scratch: _Scratch) -> Tensor:
    """z / τ of a tile of given logits, an owned copy (the chunk math works in place); −inf logits (masked
    vocabulary) become _NEG_LOGIT so that 0 · z terms (entropy, gradients) read 0, not NaN."""
    tile = scratch.new("logits", (c - a, v1 - v0), dtype, logits.device).copy_(logits[a:c, v0:v1])
    tile.clamp_(min=_NEG_LOGIT)
    return tile.mul_(inv_t) if inv_t != 1.0 else tile


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
            # a 16-bit head: this slice up-cast
            return _linear_tile(hidden[a:c].to(dtype), weight[v0:v1].to(dtype), b, v0, inv_t, scratch)

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
                logits_tile = _linear_tile(h, weight_slice, b, v0, inv_t, scratch)
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
            return _logit_tile(logits, a, c, v0, v1, dtype, inv_t, scratch)

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
                logits_tile = _logit_tile(logits, a, c, v0, v1, dtype, inv_t, scratch)
                grad[a:c, v0:v1] = _backward_tile(logits_tile, v0, target_ids[a:c], cfg, stats_rows, grads_rows,
                                                  None if rollout is None else rollout[a:c, v0:v1],
                                                  _rows(topk_logp, a, c), _rows(topk_ids, a, c), scratch)
        return grad, None, None, None, None, None
