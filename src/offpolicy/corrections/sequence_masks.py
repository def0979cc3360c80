"""Whole-sequence masks: DeepSeek-V3.2 Off-Policy Sequence Masking (OPSM) and the token veto.

* OPSM (DeepSeek-V3.2 §3, seeds 002/004): drop sequence i iff A_i < 0 and (1/|y_i|) Σ_t (log μ − log π_θ) > δ.
  It is a one-sided geometric mask ρ_geo(π_θ/μ) < e^{−δ} restricted to negative advantages (seed 004), and its
  statistic splits into a training–inference term (mean log μ − log π_old, fixed per rollout) and a staleness term
  (mean log π_old − log π_θ, changes every step) — logged so a run shows which one triggers the mask.
* Token veto (seed 000, App. A): drop the whole sequence if any token has π_train/π_infer < 1e-4 — an irreparable
  mismatch no weight can fix.

Both return keep masks ``[B, T]`` (bool); the padding mask keeps deciding the loss denominator.
"""

from __future__ import annotations

import math

import torch
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
from offpolicy.corrections.importance import (
    RatioTerms,
    batch_float_mask,
    check_source,
    check_threshold,
    ratio_terms,
    source_terms,
)
from offpolicy.ratios import as_mask, broadcast_rows, masked_mean, nan_to_num, sequence_means


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
    (seed 000 App. A, threshold 1e-4; verl ``rollout_token_veto_threshold``).

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
    return m & ~bad.any(dim=-1, keepdim=True)


_FLOAT_MIN = float(torch.finfo(torch.float32).min)


def _vetoed_rows(terms: RatioTerms, threshold: float) -> Tensor:
    """[B] True where a valid token has ¬(log ρ_t ≥ log threshold) — :func:`token_veto` on a row minimum: NaN and −inf
    map below any log-threshold, +inf and padding (0 ≥ log threshold, threshold ≤ 1) never veto."""
    low = nan_to_num(terms.raw, _FLOAT_MIN, 0.0, _FLOAT_MIN).mul_(terms.mf)
    return low.amin(dim=-1) < math.log(threshold)


def veto(threshold: float = 1e-4, source: str = "mismatch") -> Correction:
    """Token-veto preset on log(π_old/μ) (``source="mismatch"``) or log(π_θ/μ) (``"total"``); see :func:`token_veto`.

    Metrics: ``veto/vetoed_seq_frac`` (of sequences with ≥ 1 valid token).

    >>> mu = torch.tensor([[0.0, 0.0], [0.0, 12.0]])
    >>> b = LogProbBatch(logp=torch.zeros(2, 2), rollout_logp=mu, mask=torch.ones(2, 2))
    >>> r = veto()(b); r.keep, r.metrics["veto/vetoed_seq_frac"]  # ρ = e^-12 = 6e-6 < 1e-4 vetoes row 1
    (tensor([[ True,  True],
            [False, False]]), tensor(0.5000))
    """
    _check_veto_threshold(threshold)
    check_source(source)
    t = float(threshold)

    def apply(batch: LogProbBatch) -> CorrectionResult:
        terms = source_terms(batch, source, "veto")
        vetoed_row = _vetoed_rows(terms, t)
        nonempty = terms.n_row > 0
        keep = broadcast_rows(terms.mask, ~vetoed_row)
        (vetoed_frac,) = sequence_means(nonempty, vetoed_row)
        return CorrectionResult(terms.mf.clone(), keep, {"veto/vetoed_seq_frac": vetoed_frac}, weight_level=None)

    return Correction("veto", apply, {"threshold": t, "source": source})


# ---------------------------------------------------------------------------------------------------------------------
# OPSM
# ---------------------------------------------------------------------------------------------------------------------


def opsm_decomposition(logp: Tensor, old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """OPSM statistic per sequence ``[B]`` and its three-policy split (seed 004, "opsm is geometric sequence masking").

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
    stat, mism, stale, _ = _decompose(logp, old_logp, rollout_logp, as_mask(mask))
    return {"statistic": stat, "mismatch": mism, "staleness": stale}


def _decompose(
    logp: Tensor, old_logp: Tensor, rollout_logp: Tensor, m: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-sequence means of μ−π_θ, μ−π_old, π_old−π_θ (0 where any is non-finite) and the rows holding one."""
    lp, lo, lm = (x.detach().float() for x in (logp, old_logp, rollout_logp))
    finite = torch.isfinite(lp) & torch.isfinite(lo) & torch.isfinite(lm)
    use = m & finite
    n = m.float().sum(dim=-1).clamp(min=1.0)

    def mean(x: Tensor) -> Tensor:
        return torch.where(use, x, torch.zeros_like(x)).sum(dim=-1) / n

    nonfinite_row = (m & ~finite).any(dim=-1)
    return mean(lm - lp), mean(lm - lo), mean(lo - lp), nonfinite_row


def _sequence_advantage_sign_negative(advantages: Tensor, like: Tensor, m: Tensor) -> Tensor:
    """[B] bool: A_i < 0, with per-token advantages reduced to their mean over valid tokens."""
    a = token_advantages(advantages, like)
    seq = advantages.float() if advantages.dim() == 1 else masked_mean(a, m, dim=-1)
    return seq < 0


def _opsm_keep(stat: Tensor, nonfinite_row: Tensor, negative: Tensor, m: Tensor, delta: float) -> Tensor:
    # A negative sample whose divergence is unknown (non-finite log-probs) is dropped too: never kept silently.
    drop = negative & ((stat > delta) | nonfinite_row)
    return m & ~drop.unsqueeze(-1)


def opsm_mask(
    logp: Tensor,
    rollout_logp: Tensor | None,
    mask: Tensor,
    advantages: Tensor,
    *,
    delta: float,
    old_logp: Tensor | None = None,
) -> Tensor:
    """DeepSeek-V3.2 Off-Policy Sequence Masking keep mask ``[B, T]`` (arXiv 2512.02556; seeds 002, 004).

    Drop sequence i iff A_i < 0 and (1/|y_i|) Σ_t m_t (log μ − log π_θ) > δ, π_θ detached — equivalently (seed 004)
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
    stat, _, _, nonfinite_row = _decompose(logp, behaviour, behaviour, m)
    return _opsm_keep(stat, nonfinite_row, _sequence_advantage_sign_negative(advantages, logp, m), m, d)


def _memo_terms(batch: LogProbBatch, numerator: str, denominator: str) -> RatioTerms:
    """Shared :class:`RatioTerms` of log(numerator) − log(denominator), memoised on the batch. Names resolve as
    ``batch.logp`` / ``batch.anchor_logp`` / ``batch.behaviour_logp``; a pair that *is* a correction source
    (π_θ or π_old over μ) reuses that memo."""
    if batch.rollout_logp is not None and denominator == "behaviour":
        return source_terms(batch, "total" if numerator == "logp" else "mismatch", "opsm")
    num = batch.logp if numerator == "logp" else batch.anchor_logp
    return batch.memo(
        ("opsm_terms", numerator, denominator),
        lambda b: ratio_terms(num.detach().float() - b.behaviour_logp.detach().float(), b.mask, batch_float_mask(b)),
    )


def opsm(delta: float = 1e-4) -> Correction:
    """OPSM preset (see :func:`opsm_mask`): μ = ``rollout_logp``, else ``old_logp``; advantages required.

    Metrics (over sequences with ≥ 1 valid token): ``opsm/masked_seq_frac``, ``opsm/stat_mean`` and its split
    ``opsm/mismatch_term_mean`` + ``opsm/staleness_term_mean`` (:func:`opsm_decomposition`; with no ``old_logp`` the
    staleness term is 0, with no ``rollout_logp`` the mismatch term is 0).

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
        # the mask reads only π_θ and μ (exactly opsm_mask); the split also reads π_old, for the metrics
        stat_t = _memo_terms(batch, "logp", "behaviour")  # log π_θ − log μ
        mis_t = _memo_terms(batch, "anchor", "behaviour")  # log π_old − log μ
        n = stat_t.n_row.clamp(min=1.0)
        stat = -stat_t.sum_row / n  # mean(log μ − log π_θ): negation is exact, so this is _decompose's number
        nonfinite_row = stat_t.ok_row < stat_t.n_row
        negative = _sequence_advantage_sign_negative(batch.advantages, batch.logp, stat_t.mask)
        drop = negative & ((stat > d) | nonfinite_row)
        keep = broadcast_rows(stat_t.mask, ~drop)
        # split over the tokens where all three log-probs are finite (as _decompose). Each cleaned log-ratio is 0
        # where its own pair is not finite, so multiplying it by the *other* pair's validity restricts it to those
        # tokens; there log π_old − log π_θ = (log π_old − log μ) − (log π_θ − log μ) (equal up to rounding).
        buf = torch.mul(mis_t.clean, stat_t.ok)
        mism_sum = buf.sum(dim=-1)
        stale_sum = mism_sum - torch.mul(stat_t.clean, mis_t.ok, out=buf).sum(dim=-1)
        mism, stale = -mism_sum / n, stale_sum / n
        nonempty = stat_t.n_row > 0
        masked_frac, stat_mean, mism_mean, stale_mean = sequence_means(nonempty, drop, stat, mism, stale)
        metrics = {
            "opsm/masked_seq_frac": masked_frac,
            "opsm/stat_mean": stat_mean,
            "opsm/mismatch_term_mean": mism_mean,
            "opsm/staleness_term_mean": stale_mean,
        }
        return CorrectionResult(stat_t.mf.clone(), keep, metrics, weight_level=None)

    return Correction("opsm", apply, {"delta": d})
