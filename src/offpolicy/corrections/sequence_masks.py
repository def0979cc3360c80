"""Whole-sequence masks: DeepSeek-V3.2 Off-Policy Sequence Masking (OPSM) and the token veto.

* OPSM (DeepSeek-V3.2, arXiv 2512.02556 §3.1): drop sequence i iff A_i < 0 and (1/|y_i|) Σ_t (log μ − log π_θ) > δ.
  It is a one-sided geometric mask ρ_geo(π_θ/μ) < e^{−δ} restricted to negative advantages (the blog post "a lens for
  deepseek off policy sequence masking", 2025), and its statistic splits into a training–inference term
  (mean log μ − log π_old, fixed per rollout) and a staleness term (mean log π_old − log π_θ, changes every step) —
  logged so a run shows which one triggers the mask.
* Token veto (Dynamic Vocabulary Pruning, arXiv 2512.23087 App. A): drop the whole sequence if any token has
  π_train/π_infer < 1e-4 — an irreparable mismatch no weight can fix.

Both return keep masks ``[B, T]`` (bool); the padding mask keeps deciding the loss denominator.
"""

from __future__ import annotations

import math

import torch  # noqa: F401  (the doctests below use it)
from torch import Tensor

from offpolicy.batch import (
    LogProbBatch,
    check_advantages,
    check_mask,
    check_same_shape,
    check_token_tensor,
    token_advantages,
)
from offpolicy.corrections.base import Correction, CorrectionResult
from offpolicy.corrections.importance import behaviour_log_ratio, check_source, check_threshold
from offpolicy.ratios import (
    as_mask,
    broadcast_rows,
    count,
    float_mask,
    is_finite,
    mean_over_sequences,
    nonfinite_rows,
    per_sequence,
    zero_outside,
)
from offpolicy.registry import register_correction


def _check_veto_threshold(threshold: object) -> float:
    t = check_threshold("threshold", threshold)
    assert t is not None
    if t > 1.0:
        raise ValueError(f"threshold must be in (0, 1] (a ratio below which a token is irreparable), got {threshold!r}")
    return t


# ---------------------------------------------------------------------------------------------------------------------
# Token veto
# ---------------------------------------------------------------------------------------------------------------------


def token_veto(log_ratio: Tensor, mask: Tensor, *, threshold: float = 1e-4) -> Tensor:
    """Keep mask ``[B, T]``: a sequence is dropped if any valid token has ρ_t = exp(log ρ_t) < ``threshold``
    (arXiv 2512.23087 App. A, threshold 1e-4; verl ``rollout_token_veto_threshold``).

    ``log_ratio`` is per-token log(π_train/π_infer) ``[B, T]``; it is *not* clamped first (a threshold below e^{−20}
    must still work). A NaN or −inf log-ratio in a valid position vetoes its sequence (the ratio is undefined or 0);
    padding is ignored whatever it holds. ``threshold`` must be in (0, 1].

    >>> r = torch.tensor([[0.0, -10.0, 0.0], [0.1, -0.1, -99.0]]); m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    >>> token_veto(r, m)  # exp(-10) = 4.5e-5 < 1e-4 vetoes row 0; row 1's -99 is padding
    tensor([[False, False, False],
            [ True,  True, False]])
    """
    check_token_tensor("log_ratio", log_ratio)
    check_mask(mask, log_ratio, "log_ratio")
    t = _check_veto_threshold(threshold)
    m = as_mask(mask)
    # `~(r >= log t)` is True for NaN as well as for r < log t: an undefined ratio is never kept silently
    bad = m & ~(log_ratio.detach().float() >= math.log(t))
    return broadcast_rows(m, count(bad, dim=-1) == 0)


@register_correction("veto")
def veto(threshold: float = 1e-4, source: str = "mismatch") -> Correction:
    """Token-veto preset on log(π_old/μ) (``source="mismatch"``) or log(π_θ/μ) (``"total"``); see :func:`token_veto`.

    Metrics: every correction's (:func:`~offpolicy.corrections.base.drop_metrics`): ``veto/masked_seq_frac`` the
    vetoed share of sequences with ≥ 1 valid token, ``veto/masked_frac`` their tokens' share.

    >>> mu = torch.tensor([[0.0, 0.0], [0.0, 12.0]])
    >>> b = LogProbBatch(logp=torch.zeros(2, 2), rollout_logp=mu, mask=torch.ones(2, 2))
    >>> r = veto()(b); r.keep, r.metrics["veto/masked_seq_frac"]  # ρ = e^-12 = 6e-6 < 1e-4 vetoes row 1
    (tensor([[ True,  True],
            [False, False]]), tensor(0.5000))
    """
    _check_veto_threshold(threshold)
    check_source(source)
    t = float(threshold)

    def apply(batch: LogProbBatch) -> CorrectionResult:
        keep = token_veto(behaviour_log_ratio(batch, source, "veto"), batch.mask, threshold=t)
        return CorrectionResult(float_mask(batch.bool_mask), keep, {}, weight_level=None)

    return Correction("veto", apply, {"threshold": t, "source": source})


# ---------------------------------------------------------------------------------------------------------------------
# OPSM
# ---------------------------------------------------------------------------------------------------------------------


def opsm_decomposition(logp: Tensor, old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """OPSM statistic per sequence ``[B]`` and its three-policy split (the decoupled-PPO decomposition, arXiv 2110.00641).

    Returns ``{"statistic", "mismatch", "staleness"}`` (float32, detached):

    * ``statistic`` = (1/|y|) Σ_t m_t (log μ − log π_θ)  — DeepSeek-V3.2's OPSM divergence;
    * ``mismatch``  = (1/|y|) Σ_t m_t (log μ − log π_old) — training–inference term (= −log ρ_geo^TI), fixed per
      rollout;
    * ``staleness`` = (1/|y|) Σ_t m_t (log π_old − log π_θ) — how far π_θ moved since the rollout.

    statistic == mismatch + staleness (up to float rounding; no clamping is applied). |y| is the number of valid
    tokens; a valid token where any of the three log-probs is non-finite contributes 0 to all three; an empty
    sequence gives 0.

    >>> d = opsm_decomposition(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.2, -2.0]]),
    ...                        torch.tensor([[-1.5, -1.7]]), torch.ones(1, 2))
    >>> # (-0.5 + 0.3)/2, (-0.3 + 0.3)/2, (-0.2 + 0)/2
    >>> [round(d[k].item(), 4) for k in ("statistic", "mismatch", "staleness")]
    [-0.1, 0.0, -0.1]
    """
    check_token_tensor("logp", logp)
    for name, x in (("old_logp", old_logp), ("rollout_logp", rollout_logp)):
        check_token_tensor(name, x)
        check_same_shape(name, x, "logp", logp)
    check_mask(mask, logp)
    m = as_mask(mask)
    pi, old, mu = (x.detach().float() for x in (logp, old_logp, rollout_logp))
    use = m & is_finite(pi) & is_finite(old) & is_finite(mu)

    def per_sequence_mean(x: Tensor) -> Tensor:  # over the valid tokens: a token not finite in all three adds 0
        return per_sequence(zero_outside(x, use), m, "mean")

    return {"statistic": per_sequence_mean(mu - pi), "mismatch": per_sequence_mean(mu - old),
            "staleness": per_sequence_mean(old - pi)}


def _sequence_advantage_sign_negative(advantages: Tensor, like: Tensor, m: Tensor) -> Tensor:
    """[B] bool: A_i < 0, with per-token advantages reduced to their mean over valid tokens."""
    a = token_advantages(advantages, like)
    seq = advantages.float() if advantages.dim() == 1 else per_sequence(a, m, "mean")
    return seq < 0


def opsm_mask(
    logp: Tensor,
    rollout_logp: Tensor | None,
    mask: Tensor,
    advantages: Tensor,
    *,
    delta: float,
    old_logp: Tensor | None = None,
) -> Tensor:
    """DeepSeek-V3.2 Off-Policy Sequence Masking keep mask ``[B, T]`` (arXiv 2512.02556 §3.1).

    Drop sequence i iff A_i < 0 and (1/|y_i|) Σ_t m_t (log μ − log π_θ) > δ, π_θ detached — equivalently
    iff A_i < 0 and ρ_geo(π_θ/μ) < e^{−δ}. ``advantages`` is ``[B]`` or ``[B, T]`` (then the sign of the mean over
    valid tokens decides). ``rollout_logp`` None falls back to ``old_logp`` (ms-swift); both None → ``ValueError``.
    A negative-advantage sequence with a non-finite log-prob in a valid position is dropped. ``delta`` ≥ 0, finite
    (DeepSeek gives no value; TRL suggests 0.5, slime defaults to 1e-4).

    >>> logp = torch.tensor([[-2.0, -2.0], [-2.0, -2.0], [-1.0, -1.0]]); mu = torch.full((3, 2), -1.0)
    >>> opsm_mask(logp, mu, torch.ones(3, 2), torch.tensor([-1.0, 1.0, -1.0]), delta=0.5)  # stat = 1, 1, 0
    tensor([[False, False],
            [ True,  True],
            [ True,  True]])
    """
    check_token_tensor("logp", logp)
    behaviour = rollout_logp if rollout_logp is not None else old_logp
    if behaviour is None:
        raise ValueError("opsm_mask needs rollout_logp (log μ) or, as a fallback, old_logp; both are None")
    name = "rollout_logp" if rollout_logp is not None else "old_logp"
    check_token_tensor(name, behaviour)
    check_same_shape(name, behaviour, "logp", logp)
    check_mask(mask, logp)
    check_advantages(advantages, logp)
    d = check_threshold("delta", delta, allow_zero=True)
    assert d is not None
    m = as_mask(mask)
    divergence = behaviour.detach().float() - logp.detach().float()  # log μ − log π_θ per token
    statistic = per_sequence(divergence, m, "mean")  # a non-finite token adds 0 to the sum and 1 to the length
    unknown = nonfinite_rows(divergence, m)
    # A negative sample whose divergence is unknown (non-finite log-probs) is dropped too: never kept silently.
    drop = _sequence_advantage_sign_negative(advantages, logp, m) & ((statistic > d) | unknown)
    return broadcast_rows(m, ~drop)


@register_correction("opsm")
def opsm(delta: float = 1e-4) -> Correction:
    """OPSM preset (see :func:`opsm_mask`): μ = ``rollout_logp``, else ``old_logp``; advantages required.

    Metrics (over sequences with ≥ 1 valid token): ``opsm/stat_mean`` and its split
    ``opsm/mismatch_term_mean`` + ``opsm/staleness_term_mean`` (:func:`opsm_decomposition`; with no ``old_logp`` the
    staleness term is 0, with no ``rollout_logp`` the mismatch term is 0), beside every correction's
    ``opsm/masked_seq_frac`` (the dropped share of sequences), ``opsm/masked_frac`` … (:func:`~offpolicy.corrections.base.drop_metrics`).

    >>> b = LogProbBatch(logp=torch.tensor([[-2.0], [-2.0]]), rollout_logp=torch.tensor([[-1.0], [-1.0]]),
    ...                  mask=torch.ones(2, 1), advantages=torch.tensor([-1.0, 1.0]))
    >>> r = opsm(delta=0.5)(b); r.keep, r.metrics["opsm/masked_seq_frac"]
    (tensor([[False],
            [ True]]), tensor(0.5000))
    """
    d = check_threshold("delta", delta, allow_zero=True)
    assert d is not None

    def apply(batch: LogProbBatch) -> CorrectionResult:
        if batch.rollout_logp is None and batch.old_logp is None:
            raise ValueError("opsm needs rollout_logp (log μ) or, as a fallback, old_logp; the batch has neither")
        if batch.advantages is None:
            raise ValueError("opsm needs advantages (it only masks negative-advantage sequences); the batch has none")
        keep = opsm_mask(batch.logp, batch.rollout_logp, batch.mask, batch.advantages, delta=d, old_logp=batch.old_logp)
        parts = opsm_decomposition(batch.logp, batch.anchor_logp, batch.behaviour_logp, batch.mask)
        valid = batch.bool_mask
        nonempty = count(valid, dim=-1) > 0
        metrics = {
            "opsm/stat_mean": mean_over_sequences(parts["statistic"], nonempty),
            "opsm/mismatch_term_mean": mean_over_sequences(parts["mismatch"], nonempty),
            "opsm/staleness_term_mean": mean_over_sequences(parts["staleness"], nonempty),
        }
        return CorrectionResult(float_mask(valid), keep, metrics, weight_level=None)

    return Correction("opsm", apply, {"delta": d})
