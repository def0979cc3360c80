"""The delight gate (Delightful Distributed Policy Gradient, arXiv 2603.20521, the gate of its §2): each token's term
is weighed by a sigmoid of its *delight*, the advantage times the token's surprisal under the learner,

    χ_t = A_t · ℓ_t,    ℓ_t = −log π(y_t),    w_t = σ(χ_t / η).

A rare token that failed (A < 0, ℓ large) gets χ ≪ 0 and w → 0: a stale, buggy or mismatched actor's surprising
failures cannot dominate the update. A rare success (A > 0) gets w → 1. It reads no behaviour probability — no μ, no
ratio — so it works on hosts without engine log-probs (it is not in
:data:`offpolicy.losses.NEEDS_ROLLOUT_CORRECTIONS`), and is chained with a ratio correction when μ exists.

Choices, and why:

* the gate is the paper's sigmoid σ(χ/η), not a hard threshold 1[χ > τ]. A hard gate at τ = 0 drops *every*
  negative-advantage token (any surprisal > 0 makes χ < 0), leaving only positive updates; a threshold below 0 makes
  the step jump discontinuously in A. The sigmoid suppresses failures in proportion to how surprising they are.
  Weights lie in (0, 1), ½ at zero delight: the paper's form, kept as is so that η means what it means there (the
  step is about half of the ungated one; with Adam that is a rescaling of little consequence).
* η = 1 by default: χ is in nats × advantage units, and group-normalised advantages are O(1), so a failure one nat
  more surprising than a success of the same |A| is weighed e times less in odds.
* π is the trainer's π_old (``policy="old"``; π_θ detached when the batch has none), fixed over the step's
  minibatches so the gate does not move with the gradient; ``policy="current"`` takes π_θ, detached (the learner's
  policy at the update, as the paper's single-update setting has it). Either way the weight is detached: the gradient
  is the gated objective's, never through the gate.

A token with a non-finite surprisal or advantage is dropped (keep False). Needs ``advantages``.
"""

from __future__ import annotations

import torch

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import Correction, CorrectionResult
from offpolicy.corrections.importance import check_threshold
from offpolicy.ratios import count, is_finite, keep_only, zero_outside
from offpolicy.registry import register_correction

POLICIES: tuple[str, ...] = ("old", "current")
TEMPERATURE = 1.0  # η


def delight_gate(logp: torch.Tensor, advantages: torch.Tensor, temperature: float = TEMPERATURE) -> torch.Tensor:
    """w = σ(A · (−log π) / η) per token, ``[B, T]`` float32, detached; ``logp`` and ``advantages`` ``[B, T]``.

    >>> delight_gate(torch.log(torch.tensor([[0.5, 0.5, 1.0]])), torch.tensor([[1.0, -1.0, -3.0]]))
    tensor([[0.6667, 0.3333, 0.5000]])
    """
    chi = advantages.detach().float() * -logp.detach().float()
    return torch.sigmoid(chi / temperature)


@register_correction("delight")
def delight(temperature: float = TEMPERATURE, policy: str = "old") -> Correction:
    """The delight gate w_t = σ(A_t · (−log π(y_t)) / η) (arXiv 2603.20521; module docstring): ``temperature`` η > 0,
    ``policy`` ``"old"`` (π_old) or ``"current"`` (π_θ, detached). Needs no μ.

    Metrics (prefix ``delight/``, over valid tokens): ``weight_mean`` (0 where dropped), ``suppressed_frac`` (tokens with negative delight, w < ½: the gated failures), ``delight_mean`` (mean χ),
    ``surprisal_mean`` (mean ℓ) and ``nonfinite_frac`` (dropped for a non-finite surprisal or advantage), beside every
    correction's ``kept_frac`` … (:func:`~offpolicy.corrections.base.drop_metrics`: a gated token is reweighted, not
    capped, so it counts as kept).

    >>> b = LogProbBatch(logp=torch.log(torch.tensor([[0.5, 0.5]])), mask=torch.ones(1, 2),
    ...                  advantages=torch.tensor([[1.0, -1.0]]))
    >>> delight()(b).weights   # χ = ±log 2: σ(log 2) = 2/3, σ(−log 2) = 1/3
    tensor([[0.6667, 0.3333]])
    """
    eta = check_threshold("temperature", temperature)
    assert eta is not None
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")

    def apply(batch: LogProbBatch) -> CorrectionResult:
        if batch.advantages is None:
            raise ValueError("advantages: delight gates by A · surprisal, but the batch has no advantages")
        valid = batch.bool_mask
        log_p = (batch.anchor_logp if policy == "old" else batch.logp).detach().float()
        a = batch.token_advantages().detach().float()
        defined = valid & is_finite(log_p) & is_finite(a)
        surprisal = -zero_outside(log_p, defined)
        advantages = zero_outside(a, defined)
        weights = keep_only(delight_gate(-surprisal, advantages, eta), defined)
        chi = advantages * surprisal
        n_valid = count(valid)
        n = n_valid.clamp(min=1)
        n_defined = count(defined)
        metrics = {
            "delight/weight_mean": weights.sum() / n,
            "delight/suppressed_frac": count(defined & (chi < 0)) / n,
            "delight/delight_mean": chi.sum() / n_defined.clamp(min=1),
            "delight/surprisal_mean": surprisal.sum() / n_defined.clamp(min=1),
            "delight/nonfinite_frac": (n_valid - n_defined) / n,
        }
        # no ratio in these weights: the diagnostics' clipped_frac must not compare them with ρ (alone it counts the
        # dropped tokens; chained with a ratio correction the chain's level is that correction's)
        return CorrectionResult(weights, defined, metrics, weight_level=None)

    return Correction("delight", apply, {"temperature": eta, "policy": policy})
