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

Metrics (0-d float32, detached; fractions are over valid tokens): ``loss/clipfrac_low`` — A < 0 and r < 1−ε_low
(the clip is active: no gradient); ``loss/clipfrac_high`` — A > 0 and r > 1+ε_high; ``loss/dual_clip_frac`` — A < 0
and r > c; ``loss/ratio_mean|max|min`` — of the objective's r (at its level; π_θ/π_old for ``reinforce``);
``loss/empty_batch`` — 1.0 iff no token is valid; ``loss/nonfinite_tokens`` — count of mask=1 tokens dropped as
non-finite.

Robustness: a token whose log-prob (under any policy given) or advantage is NaN/±inf at a *valid* position contributes
exactly 0 (it still counts in the denominator, like any padding-mask token) and is counted in
``loss/nonfinite_tokens``; values are replaced (``nan_to_num`` · float mask) *before* any arithmetic, so the backward
pass is finite too. A non-finite correction weight counts as 0. Masked positions never matter. A batch without a valid
token gives loss 0.0 with an all-zero gradient (``loss/empty_batch`` = 1). Everything is computed in float32 and nothing
syncs to the host, so the function compiles with ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import Correction, CorrectionResult
from offpolicy.ratios import LEVELS, LOG_RATIO_BOUND, Level, float_mask

Objective = Literal["ppo", "decoupled", "bypass", "gspo", "reinforce"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
OBJECTIVES: tuple[str, ...] = ("ppo", "decoupled", "bypass", "gspo", "reinforce")
AGGREGATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


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
        aggregation: ``token_mean`` | ``seq_mean_token_mean`` | ``seq_mean_token_sum_norm``.
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
    if objective == "gspo":
        level = "geometric"

    # Float masks and nan_to_num instead of torch.where / isfinite: same NaN-safety (a non-finite value is replaced
    # *before* any arithmetic, and nan_to_num's backward is grad·isfinite, never NaN·0), several times fewer memory
    # passes — a bool-mask where is ~15× slower than a float multiply on CPU.
    mask = batch.bool_mask
    mf = float_mask(mask)  # = mask.float(), via the fast uint8 path (a bool→float cast is ~8× slower on CPU)
    logp = batch.logp.float()
    adv = batch.advantages.float()  # type: ignore[union-attr]
    adv_t = adv.unsqueeze(-1) if adv.dim() == 1 else adv  # broadcasts against [B, T] without materialising

    # A token is usable only if every quantity it touches is finite. One test on the sum of all of them (a NaN or
    # ±inf anywhere propagates; only magnitudes beyond ~1e37, meaningless as log-probs, could overflow the float32
    # sum and would then also count as non-finite): x·0 is 0 if x is finite, NaN otherwise.
    # On CPU every fresh [B, T] temporary costs about as much as the arithmetic, so the no-grad parts work in place.
    probe = logp.detach() + adv_t
    for other in (batch.old_logp, batch.rollout_logp):
        if other is not None:
            probe.add_(other.detach())
    bad = probe.mul_(0.0).nan_to_num_(1.0, 1.0, 1.0)  # 0.0 where finite, 1.0 where not
    vf = bad.mul_(mf).neg_().add_(mf)  # mf · (1 − bad): 1.0 on valid finite tokens, else 0.0
    n_mask = mf.sum()
    n_valid = vf.sum()

    lp = logp.nan_to_num(0.0, 0.0, 0.0).mul_(vf)  # 0 at invalid positions; nan_to_num's backward is grad·isfinite
    neg_a = (-adv_t).nan_to_num(0.0, 0.0, 0.0) * vf  # −A, 0 at invalid positions

    # ---- per-token loss (exactly 0 at invalid positions: lp = neg_a = 0 there) --------------------------------------
    ratio = None
    if objective == "reinforce":
        per_token = neg_a * lp
    else:
        denom = batch.rollout_logp if objective == "bypass" else batch.old_logp
        if denom is None:  # π_old = π_θ detached: r = 1 in value, gradient of log π_θ
            log_r = lp - lp.detach()
        else:
            log_r = lp - denom.detach().float().nan_to_num(0.0, 0.0, 0.0).mul_(vf)
        if level != "token":
            # Sequence ratio in value, per-token gradient: log s_it = sg[log s_i] + log π_t − sg[log π_t] (GSPO-token).
            seq = log_r.detach().sum(dim=-1, keepdim=True)
            if level == "geometric":
                seq = seq / vf.sum(dim=-1, keepdim=True).clamp(min=1.0)
            seq = seq.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND) * vf  # keep log r = 0 at invalid positions
            log_r = seq + (lp - lp.detach())
        log_r = log_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        ratio = torch.exp(log_r)
        # −min(rA, clip(r)A) is −A·min(r, 1+ε_high) for A > 0 and −A·max(r, 1−ε_low) for A < 0, and dual-clip's
        # min(L, c|A|) for A < 0 is −A·min(max(r, 1−ε_low), c): one clamp with per-sign bounds (cheaper forward and
        # backward than max of two products). The bounds are constants picked by where on A, never NaN.
        big = math.exp(LOG_RATIO_BOUND) * 2.0  # above any ratio: "no bound"
        upper = big if dual_clip is None else float(dual_clip)
        lo_b = torch.where(adv_t < 0, 1.0 - eps_low, 0.0)
        hi_b = torch.where(adv_t > 0, 1.0 + eps_high, torch.where(adv_t < 0, upper, big))
        clipped_ratio = torch.clamp(ratio, min=lo_b, max=hi_b)
        per_token = neg_a * clipped_ratio

    # ---- correction coefficient: detached and finite everywhere (a NaN·0 in backward would poison the gradient) ----
    coef = None
    if result is not None:
        keep = result.keep.view(torch.uint8) if result.keep.dtype == torch.bool else result.keep  # uint8: fast mul_
        coef = result.weights.detach().float().nan_to_num(0.0, 0.0, 0.0).mul_(keep)
    elif objective == "decoupled":
        w_log = (batch.anchor_logp.detach().float() - batch.rollout_logp.detach().float()).nan_to_num(0.0, 0.0, 0.0)  # type: ignore[union-attr]
        coef = torch.exp((w_log * vf).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    if coef is not None:
        per_token = per_token * coef

    # ---- aggregation: denominators come from the padding mask ---------------------------------------------------
    if aggregation == "token_mean":
        loss = per_token.sum() / n_mask.clamp(min=1.0)
    elif aggregation == "seq_mean_token_mean":
        tokens = mf.sum(dim=-1)
        seq_loss = per_token.sum(dim=-1) / tokens.clamp(min=1.0)
        loss = seq_loss.sum() / torch.count_nonzero(tokens).clamp(min=1).float()
    else:
        t_max = max_tokens if max_tokens is not None else logp.shape[-1]
        loss = per_token.sum() / float(max(logp.shape[0] * t_max, 1))

    # ---- metrics (detached, no host sync; float arithmetic on values that are exactly 0 / 1 at invalid positions) ----
    denom_valid = n_valid.clamp(min=1.0)
    has_valid = n_valid > 0
    one = torch.ones((), dtype=torch.float32, device=logp.device)
    zero0 = torch.zeros((), dtype=torch.float32, device=logp.device)
    if ratio is None:
        clip_low_frac = clip_high_frac = dual_frac = zero0
        if batch.old_logp is None:
            r_log = torch.zeros_like(lp)
        else:
            r_log = (lp.detach() - batch.old_logp.float().nan_to_num(0.0, 0.0, 0.0) * vf).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        r_excess = torch.expm1(r_log).sum()
    else:
        r = ratio.detach()
        r_log = log_r.detach()
        # sign(clamped − r): +1 where the clamp moved r up (A < 0, r < 1−ε_low), −1 where it moved it down (A > 0,
        # r > 1+ε_high; or dual clip: A < 0, r > c), 0 elsewhere — invalid positions hold r = 1, inside every band.
        moved = (clipped_ratio.detach() - r).sign_()
        net = moved.sum()
        n_moved = moved.abs_().sum()
        n_up, n_down = (n_moved + net) / 2.0, (n_moved - net) / 2.0
        if dual_clip is not None:  # neg_a > 0 ⇔ A < 0 on a valid token
            n_dual = (neg_a.sign().clamp(min=0.0) * (r - dual_clip).sign().clamp(min=0.0)).sum()
        else:
            n_dual = zero0
        clip_low_frac = n_up / denom_valid
        clip_high_frac = (n_down - n_dual) / denom_valid
        dual_frac = n_dual / denom_valid
        r_excess = (r - 1.0).sum()  # Σ (r − 1) is exactly 0 at invalid positions (r = 1): no padding in the sum
    r_mean = 1.0 + r_excess / denom_valid
    # push invalid positions (log r = 0) out of reach of max/min: |log r| ≤ 20 < 1e4
    push = (vf - 1.0).mul_(1.0e4)
    r_max = torch.exp((r_log + push).amax())
    r_min = torch.exp(push.neg_().add_(r_log).amin())
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
    if result is not None:
        metrics = {**result.metrics, **metrics}
    return loss, metrics
