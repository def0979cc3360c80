"""TRL 1.16's loss terms beside the policy objective, for ``OffPolicyGRPOTrainer``: the importance weight at TRL's
level, the KL to the reference model, the per-step coefficient corrections (TRL's masks and loss-type weights) and TRL's
metrics computed as TRL computes them.

TRL's ``_compute_loss`` (1.16) builds one per-token loss [B, T]::

    L_t = ℓ_t(objective) · m^opsm_i · m^H_t · w^IS_t  +  β · KL_t          (then its loss_type aggregation)
    loss = agg(L) − c_H · H̄ + c_aux · aux

The masks and the vLLM importance weight only *multiply* the objective's term, so each is a detached coefficient —
an offpolicy correction (:func:`coefficient`) that composes with the user's by multiplication; the KL term is added
after them and aggregated the same way (:func:`kl_to_reference`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import Correction, CorrectionResult
from offpolicy.ratios import per_sequence


def trl_log_weight(logp: Tensor, old_logp: Tensor, mask: Tensor, level: str) -> Tensor:
    """TRL's log importance weight log r: ``[B, T]`` log π_θ − log π_old at ``"token"`` level, or ``[B, 1]`` the
    length-normalised sequence mean (1/|y|) Σ_t m_t (log π_θ − log π_old) at ``"sequence"`` level (GSPO, arXiv
    2507.18071, eq. 7). The gradient flows through ``logp``.

    >>> trl_log_weight(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.5]]), torch.ones(1, 2), "sequence")
    tensor([[0.]])
    """
    log_ratio = logp - old_logp
    if level == "token":
        return log_ratio
    if level != "sequence":
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {level!r}")
    return per_sequence(log_ratio, mask, "mean", keepdim=True)


def kl_to_reference(logp: Tensor, ref_logp: Tensor, weight: Tensor | None = None) -> Tensor:
    """Per-token KL(π_θ ‖ π_ref) estimate [B, T], Schulman's k3 (the one TRL's ``beta`` term uses):

        KL_t = exp(log π_ref − log π_θ) − (log π_ref − log π_θ) − 1  ≥ 0,

    times ``weight`` (TRL's ``use_bias_correction_kl``: the importance weight r, with its gradient) when given.

    >>> kl_to_reference(torch.tensor([[0.0, -1.0]]), torch.tensor([[0.0, 0.0]]))   # e − 1 − 1 = 0.7183
    tensor([[0.0000, 0.7183]])
    """
    d = ref_logp - logp
    kl = torch.exp(d) - d - 1
    return kl if weight is None else kl * weight


def coefficient(name: str, weights: Tensor | None = None, keep: Tensor | None = None, *,
                weight_level: str | None = None) -> Correction:
    """A correction that multiplies each token's loss by this step's ``weights`` ([B, T], [B, 1] or [B]; detached)
    and drops the tokens where ``keep`` is False (same shapes, broadcast to the batch). TRL's masks and loss-type
    weights enter the offpolicy loss this way, composing with the user's correction by multiplication.

    >>> b = LogProbBatch(logp=torch.zeros(2, 2), mask=torch.ones(2, 2), advantages=torch.ones(2))
    >>> r = coefficient("m", torch.tensor([[2.0], [3.0]]), torch.tensor([[True], [False]]))(b)
    >>> r.coefficient
    tensor([[2., 2.],
            [0., 0.]])
    """

    def shaped(x: Tensor, like: Tensor) -> Tensor:
        x = x.detach()
        return (x.unsqueeze(-1) if x.dim() == 1 else x).expand_as(like)

    def apply(batch: LogProbBatch) -> CorrectionResult:
        valid = batch.bool_mask
        w = torch.ones_like(batch.logp, dtype=torch.float32) if weights is None else shaped(weights, batch.logp).float()
        k = valid if keep is None else valid & shaped(keep, batch.logp).bool()
        return CorrectionResult(w, k, {}, weight_level=weight_level)

    # TRL's factors do not say which weights they truncate: no <name>/kept_frac … that would count a capped one as kept
    return Correction(name, apply, {}, logs_drops=False)


def masked_stats(x: Tensor, mask: Tensor) -> Tensor:
    """``[Σ m x, Σ m]`` (2,) float32 of ``x`` [B, T] over ``mask``, or over the rows when ``x`` is ``[B, 1]`` (one
    value per sequence, as TRL counts its sequence-level metrics): what a global masked mean reduces across ranks.

    >>> masked_stats(torch.tensor([[1.0, 3.0], [5.0, 7.0]]), torch.tensor([[1, 1], [1, 0]]))
    tensor([9., 3.])
    """
    x = x.detach().float()
    if x.shape[-1] == 1 and mask.shape[-1] != 1:
        return torch.stack([x.sum(), torch.tensor(float(x.shape[0]), device=x.device)])
    m = mask.bool()
    return torch.stack([torch.where(m, x, 0.0).sum(), m.sum().float()])


def sequence_means(x: Tensor, mask: Tensor) -> Tensor:
    """``[B]`` each sequence's mean of ``x`` [B, T] over ``mask`` (the value itself for ``[B, 1]``); NaN for an
    empty sequence, as TRL's ``clip_ratio/low_min`` / ``high_max`` read them (with nan-aware min / max)."""
    x = x.detach().float()
    if x.shape[-1] == 1 and mask.shape[-1] != 1:
        return x.squeeze(-1)
    m = mask.float()
    return (x * m).sum(-1) / m.sum(-1)


def clip_fractions(log_weight: Tensor, advantages: Tensor, loss_type: str, eps_low: float,
                   eps_high: float) -> dict[str, Tensor]:
    """The tokens TRL counts as clipped, bool ``[B, T]`` (or ``[B, 1]``), from r = exp(``log_weight``) and A
    (``[B, 1]`` or ``[B, T]``): the PPO family's ``low`` (r < 1 − ε_low, A < 0), ``high`` (r > 1 + ε_high, A > 0)
    and ``region`` (either); CISPO's ``cispo`` (r > ε_high, A > 0: TRL's ε_high is CISPO's absolute cap).

    >>> f = clip_fractions(torch.log(torch.tensor([[0.5, 1.5]])), torch.tensor([[-1.0]]), "grpo", 0.2, 0.2)
    >>> f["low"].tolist(), f["high"].tolist()
    ([[True, False]], [[False, False]])
    """
    r = torch.exp(log_weight.detach())
    if loss_type == "cispo":
        return {"cispo": (r > eps_high) & (advantages > 0)}
    low = (r < 1 - eps_low) & (advantages < 0)
    high = (r > 1 + eps_high) & (advantages > 0)
    return {"low": low, "high": high, "region": low | high}
