"""Policy-gradient losses: PPO clip (asymmetric, dual-clip), decoupled PPO, bypass, GSPO, REINFORCE; aggregation modes.

One function, :func:`policy_loss`, turns a :class:`~offpolicy.batch.LogProbBatch` (+ an optional correction) into a
scalar loss to *minimise* and a dict of 0-d metric tensors. Losses only aggregate; corrections only weight: a
correction's per-token coefficient ``weights · keep`` (detached) multiplies each token's loss term.

Objectives (L_t is the per-token loss, A the advantage, ``sg`` stop-gradient):

* ``ppo``        r = π_θ/π_old;  L_t = −min(r A, clip(r, 1−ε_low, 1+ε_high) A)  (Schulman et al. 2017, eq. 7;
                 ε_high > ε_low is DAPO's clip-higher, arXiv 2503.14476). ``dual_clip=c`` (Ye et al. 2020,
                 arXiv 1912.09729, eq. 5) additionally bounds the loss of A<0 tokens: L_t = min(L_t, c·|A|).
* ``decoupled``  PPO with a leading π_old/μ weight (seed 004; Hilton et al. 2021): J = (π_old/μ) · PPO term. With a
                 ``correction`` this is exactly ``ppo`` + that correction (you normally want ``tis``/``mis``/``icepop`` on
                 the mismatch ratio: the untruncated weight has unbounded variance). Without one, the raw detached weight
                 exp(log π_old − log μ) (clamped log-ratio ±20) is applied.
* ``bypass``     r = π_θ/μ directly (no π_old; seed 001 §3.1 and ALP's unified ratio), clipped like PPO.
* ``gspo``       GSPO (arXiv 2507.18071, "GSPO-token" eq.): s_i = exp(mean_t log(π_θ/π_old)) and per token
                 s_{i,t} = sg[s_i] · π_t / sg[π_t], so the value is the geometric sequence ratio but the gradient flows
                 per token; clipped like PPO (the paper uses ε ≈ 3e-4 / 4e-4 — pass them as ``clip_low``/``clip_high``).
* ``reinforce``  L_t = −A · log π_θ (the correction's weight multiplies it, like every objective).

``level`` generalises the ratio of ``ppo``/``bypass``/``decoupled`` the same way GSPO does (``gspo`` ≡ ``ppo`` at
``level="geometric"``): ``sequence`` uses the product ratio, ``geometric`` the length-normalised one — e.g. ALP's
sequence-level objective (seed 001, eq. 3) is ``objective="bypass", level="geometric"``.

Aggregations (the denominators use the *padding* mask, never the correction's keep mask, so a dropped token still
counts — TRM's "normalise by the total batch", arXiv 2512.23075):

* ``token_mean``               Σ m L / Σ m                                   (DAPO)
* ``seq_mean_token_mean``      mean over sequences with ≥1 valid token of Σ_t m L / Σ_t m   (GRPO)
* ``seq_mean_token_sum_norm``  Σ m L / (B · T_max), T_max = ``max_tokens`` or T             (Dr.GRPO, arXiv 2503.20783)
* ``token_sum``                Σ m L, no denominator (verl's ``token-sum``: the caller owns the scale)

Metrics (0-d float32, detached; fractions are over valid tokens): ``loss/clipfrac_low`` — clamped from below: A < 0
and r < 1−ε_low (the clip is active: no gradient), or r < e^−20 (the ±20 bound, any A); ``loss/clipfrac_high`` — clamped
from above other than by the dual clip: A > 0 and r > 1+ε_high, or r > e^20; ``loss/dual_clip_frac`` — A < 0
and r > c; ``loss/ratio_mean|max|min`` — of the objective's r (at its level; π_θ/π_old for ``reinforce``);
``loss/empty_batch`` — 1.0 iff no token is valid; ``loss/nonfinite_tokens`` — count of mask=1 tokens dropped as
non-finite.

Robustness: a token whose log-prob (under a policy the objective reads: π_θ, π_old for the ratio objectives, μ for
``bypass`` and for ``decoupled`` without a correction) or advantage is NaN/±inf at a *valid* position contributes
exactly 0 (it still counts in the denominator, like any padding-mask token) and is counted in
``loss/nonfinite_tokens``; values are replaced (``nan_to_num`` · float mask) *before* any arithmetic, so the backward
pass is finite too. A non-finite correction weight counts as 0. Masked positions never matter. A batch without a valid
token gives loss 0.0 with an all-zero gradient (``loss/empty_batch`` = 1). Everything is computed in float32 and nothing
syncs to the host, so the function compiles with ``torch.compile(fullgraph=True)``.

Gradient: the loss is piecewise (clamps, masks), so d loss / d logp has a closed form (see :func:`_loss_and_gradient`)
that the forward pass computes from terms it already has; the returned loss carries it through a one-line autograd
function. Autograd therefore records no graph through the loss: one saved [B, T] buffer instead of ~10, and a
backward of one multiply. First-order only (no double backward through the loss). It is tested against autograd on a
textbook implementation of every objective, level, aggregation and dual clip (``tests/test_losses_gradient.py``).
At ``sequence``/``geometric`` level the gradient is GSPO-token's (log r_t = sg[log s_i] + lp_t − sg[lp_t]): each
token gets −A·s_i·∇log π_t, the sequence-level policy gradient, while the value is the sequence ratio's loss. So a
finite-difference check of the value (``gradcheck``) does not apply there, as for any stop-gradient objective.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import Correction, CorrectionResult
from offpolicy.ratios import LEVELS, LOG_RATIO_BOUND, Level, float_mask, mask_factor, nan_to_num, pad_nonempty

Objective = Literal["ppo", "decoupled", "bypass", "gspo", "reinforce"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "token_sum"]
OBJECTIVES: tuple[str, ...] = ("ppo", "decoupled", "bypass", "gspo", "reinforce")
AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "token_sum")


def _check_epsilon(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _validate(
    batch: LogProbBatch,
    objective: str,
    aggregation: str,
    clip_low: float,
    clip_high: float | None,
    dual_clip: float | None,
    max_tokens: int | None,
    level: str,
    has_correction: bool,
) -> tuple[float, float]:
    if not isinstance(batch, LogProbBatch):
        raise ValueError(f"batch must be a LogProbBatch, got {type(batch).__name__}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if objective == "gspo" and level == "sequence":
        raise ValueError("level='sequence' contradicts objective='gspo' (GSPO is the geometric ratio); use objective='ppo'")
    if objective == "reinforce" and level != "token":
        raise ValueError("level only applies to ratio objectives; objective='reinforce' has no ratio")
    eps_low = _check_epsilon("clip_low", clip_low)
    eps_high = eps_low if clip_high is None else _check_epsilon("clip_high", clip_high)
    if dual_clip is not None:
        if isinstance(dual_clip, bool) or not isinstance(dual_clip, (int, float)) or not math.isfinite(dual_clip):
            raise ValueError(f"dual_clip must be a finite number > 1 or None, got {dual_clip!r}")
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (it bounds the loss of negative-advantage tokens at c·|A|), got {dual_clip}")
        if objective == "reinforce":
            raise ValueError("dual_clip only applies to clipped objectives, not objective='reinforce'")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive int or None, got {max_tokens!r}")
    if batch.advantages is None:
        raise ValueError("advantages: policy_loss needs batch.advantages ([B] or [B, T]); the batch has none")
    if objective == "bypass" and batch.rollout_logp is None:
        raise ValueError("rollout_logp: objective='bypass' uses r = π_θ/μ and needs batch.rollout_logp")
    if objective == "decoupled" and not has_correction and batch.rollout_logp is None:
        raise ValueError("rollout_logp: objective='decoupled' without a correction needs batch.rollout_logp for π_old/μ")
    return eps_low, eps_high


def _resolve_correction(batch: LogProbBatch, correction: Correction | CorrectionResult | None) -> CorrectionResult | None:
    if correction is None:
        return None
    if isinstance(correction, Correction):
        correction = correction(batch)
    if not isinstance(correction, CorrectionResult):
        raise ValueError(f"correction must be a Correction, a CorrectionResult or None, got {type(correction).__name__}")
    if correction.weights.shape != batch.logp.shape or correction.keep.shape != batch.logp.shape:
        raise ValueError(
            f"correction weights/keep have shapes {tuple(correction.weights.shape)}/{tuple(correction.keep.shape)}, "
            f"expected {tuple(batch.logp.shape)}"
        )
    return correction


def policy_loss(
    batch: LogProbBatch,
    *,
    correction: Correction | CorrectionResult | None = None,
    objective: Objective = "ppo",
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    aggregation: Aggregation = "token_mean",
    max_tokens: int | None = None,
    level: Level = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar policy loss (to minimise, float32) and metrics for a ``[B, T]`` batch. See the module docstring.

    Args:
        batch: ``logp`` [B, T] (carries grad), ``mask`` [B, T], ``advantages`` [B] or [B, T] (required), ``old_logp``
            (π_old; ``logp.detach()`` when absent, i.e. r = 1 on a single update), ``rollout_logp`` (μ; needed by
            ``bypass`` and by ``decoupled`` without a correction).
        correction: a :class:`Correction` (called on ``batch``) or its :class:`CorrectionResult`; its detached
            ``weights · keep`` multiplies each token's loss and its metrics are merged into the returned dict.
        objective: ``ppo`` | ``decoupled`` | ``bypass`` | ``gspo`` | ``reinforce``.
        clip_low, clip_high: ε_low, ε_high ≥ 0 of the clip range [1−ε_low, 1+ε_high]; ``clip_high`` defaults to
            ``clip_low`` (symmetric PPO).
        dual_clip: c > 1 — dual-clip PPO bound c·|A| on the loss of negative-advantage tokens (None = off).
        aggregation: ``token_mean`` | ``seq_mean_token_mean`` | ``seq_mean_token_sum_norm`` | ``token_sum``.
        max_tokens: T_max for ``seq_mean_token_sum_norm`` (defaults to T; ignored by the other aggregations).
        level: ratio level of the clipped objectives (``token``; ``geometric`` = GSPO-style; ``sequence`` = product).

    Returns:
        ``(loss, metrics)``: 0-d float32 loss; metrics ``loss/clipfrac_low``, ``loss/clipfrac_high``,
        ``loss/dual_clip_frac``, ``loss/ratio_mean``, ``loss/ratio_max``, ``loss/ratio_min``, ``loss/empty_batch``,
        ``loss/nonfinite_tokens`` (+ the correction's), all 0-d detached tensors.

    >>> logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    >>> b = LogProbBatch(logp=logp, mask=torch.ones(1, 2), old_logp=torch.tensor([[-1.0, -2.0]]), advantages=torch.tensor([1.0]))
    >>> loss, m = policy_loss(b)   # r = (1, e): the second token is clipped at 1.2 -> L = -(1 + 1.2)/2
    >>> round(loss.item(), 4), m["loss/clipfrac_high"].item()
    (-1.1, 0.5)
    """
    eps_low, eps_high = _validate(
        batch, objective, aggregation, clip_low, clip_high, dual_clip, max_tokens, level, correction is not None
    )
    result = _resolve_correction(batch, correction)
    if batch.logp.numel() == 0:  # B = 0 or T = 0 (a filtered-out batch): the all-masked result; the padded logp keeps
        batch = batch.nonempty()  # the graph, so the gradient reaching the empty logp has its (empty) shape
        if result is not None:
            result = CorrectionResult(pad_nonempty(result.weights), pad_nonempty(result.keep, False), result.metrics,
                                      weight_level=result.weight_level)
    if objective == "gspo":
        level = "geometric"
    with torch.no_grad():
        loss, grad, metrics = _loss_and_gradient(
            batch, result, objective, aggregation, eps_low, eps_high, dual_clip, max_tokens, level
        )
    if batch.logp.requires_grad:
        loss = _WithGradient.apply(batch.logp, loss, grad)
    if result is not None:
        metrics = {**result.metrics, **metrics}
    return loss, metrics


class _WithGradient(torch.autograd.Function):
    """Attach a precomputed gradient to a loss value: forward returns ``loss``, backward returns g · ``grad`` for
    ``logp``. Why: the per-token loss is piecewise (clamps, masks), so its derivative is a closed form the forward
    pass already has every term of; autograd would instead record and replay ~10 [B, T] operations and keep their
    inputs alive (under ``torch.compile`` dozens of saved buffers). First-order only (no double backward)."""

    @staticmethod
    def forward(ctx, logp: Tensor, loss: Tensor, grad: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(grad)
        ctx.logp_dtype = logp.dtype
        return loss.clone()

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        return (grad * g).to(ctx.logp_dtype), None, None


def _loss_and_gradient(
    batch: LogProbBatch,
    result: CorrectionResult | None,
    objective: str,
    aggregation: str,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
    max_tokens: int | None,
    level: str,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Loss value, d loss / d logp ``[B, T]`` float32 and metrics, computed without an autograd graph.

    Per token (invalid positions have lp = A = 0, see below), with c_t the correction coefficient and a_t the
    aggregation weight (1/Σm, or 1/(|y_i|·#non-empty sequences), or 1/(B·T_max), or 1):

    * ratio objectives: L_t = −A·exp(clamp(log r_t, lo_t, hi_t))·c_t, where the bounds are log(1−ε_low) below for
      A < 0, log(1+ε_high) above for A > 0, log(dual_clip) above for A < 0, and ±20 everywhere (verl's bound).
      dL_t/dlp_t = −A·r_t·c_t where the clamp is inactive and 0 where it is active — the clamp's (inclusive)
      derivative; at ``sequence``/``geometric`` level log r_t = sg[log s_i] + lp_t − sg[lp_t] has the same form.
    * ``reinforce``: L_t = −A·lp_t·c_t, dL_t/dlp_t = −A·c_t.

    The gradient returned is a_t·dL_t/dlp_t; the loss is Σ_t a_t·L_t.
    """
    # Float masks and nan_to_num instead of torch.where / isfinite / comparisons: the same NaN-safety (a non-finite
    # value is replaced *before* any arithmetic) at a fraction of the memory passes — on CPU a bool-producing
    # comparison costs ~4× a float multiply and a bool-mask where ~20×. Work is done in place where the buffer is ours.
    mask = batch.bool_mask
    mf = float_mask(mask)  # = mask.float(), via the fast uint8 path (a bool→float cast is ~8× slower on CPU)
    logp = batch.logp.detach().float()
    adv = batch.advantages.detach().float()  # type: ignore[union-attr]
    adv_t = adv.unsqueeze(-1) if adv.dim() == 1 else adv  # [B, 1] or [B, T]: broadcasts without materialising

    # A token is usable only if every quantity it touches is finite. One test on the sum of all of them (a NaN or
    # ±inf anywhere propagates; only magnitudes beyond ~1e37, meaningless as log-probs, could overflow the float32
    # sum and would then also count as non-finite): x·0 + m is m if x is finite, NaN otherwise.
    # Only what the objective reads counts: a NaN μ must not drop a token from a ppo loss that never uses μ (TRL stores
    # missing vLLM log-probs as NaN), nor a NaN π_old from reinforce.
    probe = logp + adv_t
    for other in _loss_inputs(batch, objective, result is not None):
        probe.add_(other.detach())
    probe = torch.add(mf, probe, alpha=0.0, out=probe)  # m + 0·x, in one pass: m where x is finite, NaN elsewhere
    vf = nan_to_num(probe, 0.0, 0.0, 0.0, out=probe)  # 1.0 on valid finite tokens, else 0.0
    n_mask = mf.sum()
    n_valid = vf.sum()

    lp = nan_to_num(logp, 0.0, 0.0, 0.0).mul_(vf)  # log π_θ, 0 at invalid positions
    neg_a = nan_to_num(adv_t, 0.0, 0.0, 0.0).neg() * vf  # −A [B, T], 0 at invalid positions

    # ---- correction coefficient c_t: detached and finite everywhere ----------------------------------------------
    coef = None
    if result is not None:
        coef = nan_to_num(result.weights.detach().float(), 0.0, 0.0, 0.0).mul_(result.keep_multiplicand())
    elif objective == "decoupled":
        w_log = batch.anchor_logp.detach().float() - batch.rollout_logp.detach().float()  # type: ignore[union-attr]
        coef = nan_to_num(w_log, 0.0, 0.0, 0.0, out=w_log).mul_(vf).clamp_(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp_()

    # ---- aggregation weight a_t: denominators come from the padding mask -----------------------------------------
    if aggregation == "token_mean":
        agg_w: Tensor = 1.0 / n_mask.clamp(min=1.0)
    elif aggregation == "seq_mean_token_mean":
        tokens = mf.sum(dim=-1, keepdim=True)
        agg_w = 1.0 / (tokens.clamp(min=1.0) * torch.count_nonzero(tokens).clamp(min=1).float())  # [B, 1]
    elif aggregation == "token_sum":
        agg_w = torch.ones((), device=logp.device)
    else:
        t_max = max_tokens if max_tokens is not None else logp.shape[-1]
        agg_w = torch.full((), 1.0 / float(max(logp.shape[0] * t_max, 1)), device=logp.device)

    zero0 = torch.zeros((), dtype=torch.float32, device=logp.device)
    if objective == "reinforce":
        d_token = neg_a if coef is None else neg_a.mul_(coef)  # dL_t/dlp_t = −A·c_t
        per_token_sum = (d_token * lp).sum(dim=-1, keepdim=True)
        grad = d_token.mul_(agg_w)
        log_r = _log_ratio(lp, batch.old_logp, vf)  # π_θ/π_old, for the ratio metrics
        clip_low_frac = clip_high_frac = dual_frac = zero0
    else:
        log_r = _log_ratio(lp, batch.rollout_logp if objective == "bypass" else batch.old_logp, vf)
        if level != "token":
            # GSPO-token: log s_it = sg[log s_i] + lp_t − sg[lp_t]: the sequence value on every valid token
            seq = log_r.sum(dim=-1, keepdim=True)
            if level == "geometric":
                seq = seq / vf.sum(dim=-1, keepdim=True).clamp(min=1.0)
            # bounded at ±2·20, not ±20: beyond ±20 the ±20 bound of _clamp_ratio must see the ratio as clamped (no
            # gradient, counted as clipped), as at token level; still finite, so · vf cannot make 0·inf = NaN
            log_r = seq.clamp(-2.0 * LOG_RATIO_BOUND, 2.0 * LOG_RATIO_BOUND) * vf
        log_c, active, n_up, n_down, n_dual = _clamp_ratio(log_r, adv_t, eps_low, eps_high, dual_clip)
        d_token = log_c.exp_().mul_(neg_a)  # −A·clip(r)
        if coef is not None:
            d_token = d_token.mul_(coef)
        per_token_sum = d_token.sum(dim=-1, keepdim=True)
        grad = d_token.mul_(mask_factor(active)).mul_(agg_w)  # the clamp's derivative is 0 where it is active
        denom_valid = n_valid.clamp(min=1.0)
        clip_low_frac = n_up / denom_valid
        clip_high_frac = (n_down - n_dual) / denom_valid
        dual_frac = n_dual / denom_valid

    loss = (per_token_sum * agg_w).sum() if agg_w.dim() else per_token_sum.sum() * agg_w

    # ---- ratio statistics over valid tokens (log r is 0 at invalid positions) -------------------------------------
    log_r = log_r.clamp_(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    has_valid = n_valid > 0
    one = torch.ones((), dtype=torch.float32, device=logp.device)
    r_mean = 1.0 + torch.expm1(log_r).sum() / n_valid.clamp(min=1.0)  # expm1(0) = 0 at invalid positions
    push = (vf - 1.0).mul_(1.0e4)  # moves invalid positions out of reach of max/min: |log r| ≤ 20 < 1e4
    r_max = torch.exp((log_r + push).amax())
    r_min = torch.exp(push.neg_().add_(log_r).amin())
    metrics = {
        "loss/clipfrac_low": clip_low_frac,
        "loss/clipfrac_high": clip_high_frac,
        "loss/dual_clip_frac": dual_frac,
        "loss/ratio_mean": torch.where(has_valid, r_mean, one),
        "loss/ratio_max": torch.where(has_valid, r_max, one),
        "loss/ratio_min": torch.where(has_valid, r_min, one),
        "loss/empty_batch": (n_mask == 0).float(),
        "loss/nonfinite_tokens": n_mask - n_valid,
    }
    return loss, grad, metrics


def _loss_inputs(batch: LogProbBatch, objective: str, has_correction: bool) -> list[Tensor]:
    """The log-prob tensors besides π_θ that ``objective``'s loss value reads (π_old for the ratio objectives, μ for
    bypass and for decoupled without a correction)."""
    used = []
    if objective in ("ppo", "gspo", "decoupled") and batch.old_logp is not None:
        used.append(batch.old_logp)
    if (objective == "bypass" or (objective == "decoupled" and not has_correction)) and batch.rollout_logp is not None:
        used.append(batch.rollout_logp)
    return used


def _log_ratio(lp: Tensor, denominator_logp: Tensor | None, vf: Tensor) -> Tensor:
    """Detached log(π_θ / denominator) ``[B, T]``, 0 at invalid positions (``vf`` = 0); a missing denominator is
    π_θ itself (π_old = π_θ on a single update), so log r = 0. ``lp`` is log π_θ, already 0 at invalid positions."""
    if denominator_logp is None:
        return torch.zeros_like(lp)
    return nan_to_num(denominator_logp.detach().float(), 0.0, 0.0, 0.0).mul_(vf).neg_().add_(lp)


def _clamp_ratio(
    log_r: Tensor, adv_t: Tensor, eps_low: float, eps_high: float, dual_clip: float | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """log r clamped to its per-sign bounds (see :func:`_loss_and_gradient`), where the clamp is inactive, and the
    counts of valid tokens clamped up (A < 0, r < 1−ε_low), down (A > 0, r > 1+ε_high, or A < 0, r > c) and down by
    the dual clip.

    Invalid positions hold log r = 0 and A = 0, inside every band. Returns (log_c [B, T], active [B, T] bool —
    True where log_c == log r, the clamp's inclusive derivative —, n_up, n_down, n_dual).
    The ±20 bound also applies (so a clamped |log r| > 20 counts as clipped, which it is: no gradient)."""
    bound = LOG_RATIO_BOUND
    lo_neg = max(math.log(1.0 - eps_low), -bound) if eps_low < 1.0 else -bound
    hi_pos = min(math.log1p(eps_high), bound)
    hi_neg = bound if dual_clip is None else min(math.log(dual_clip), bound)
    # per-sign bounds as [B, 1] (or [B, T]) constants: where() on the advantages only, never on a [B, T] ratio
    pos, neg = adv_t > 0, adv_t < 0
    lo = torch.where(neg, lo_neg, -bound)
    hi = torch.where(pos, hi_pos, torch.where(neg, hi_neg, bound))
    log_c = torch.clamp(log_r, min=lo, max=hi)
    moved = log_c - log_r  # > 0 clamped up, < 0 clamped down
    active = moved == 0  # one bool pass (a float 0/1 from sign/abs costs four, sign alone ~6× a multiply on CPU)
    n_up = torch.count_nonzero(moved.clamp(min=0.0)).float()
    n_moved = float(active.numel()) - torch.count_nonzero(active).float()
    n_down = n_moved - n_up
    if dual_clip is None:
        n_dual = torch.zeros((), dtype=torch.float32, device=log_r.device)
    else:  # clamped down on an A < 0 token: only the dual clip bounds those from above
        n_dual = torch.count_nonzero(moved.clamp_(max=0.0).mul_(neg)).float()
    return log_c, active, n_up, n_down, n_dual
