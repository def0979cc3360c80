"""Thresholds that fit the measured mismatch, each re-applied to the same data with the correction itself.

For each correction the threshold is an order statistic of the correction's own per-sequence (or per-token)
statistic, chosen to reach a target kept fraction; the function then applies the correction with that threshold
(:func:`offpolicy.trust_region_mask`, :func:`offpolicy.importance_weights`, :func:`offpolicy.opsm_mask`,
:func:`offpolicy.token_veto`, :func:`offpolicy.constrained_logp`) and reports the fraction it actually kept — so a
recommendation never claims what the correction does not do. Targets:

==========  ==========================================  =================================================================
correction  threshold                                   target
==========  ==========================================  =================================================================
trm_max     δ on max_t KL(μ‖π)                          ≥ 70 % of sequences accepted (TRM, arXiv 2512.23075, Remark 4.3)
trm_avg     δ on mean_t KL(μ‖π)                         ≥ 70 % of sequences accepted
mis         band [lower, upper] on ρ_t = π/μ            ≤ 5 % of tokens masked (equal tails, the band always holds 1)
opsm        δ on mean_t log(μ/π)                        ≥ 95 % of negative-advantage sequences kept (DeepSeek-V3.2)
veto        τ on min_t ρ_t                              ≥ 99 % of sequences kept (a veto is for the irreparable few)
dvp         ρ = e^-k of the min-p safe set              retained mass Z ≥ 0.999 at every position (DVP Prop. 5.5)
==========  ==========================================  =================================================================

A threshold is the smallest (largest, for a lower bound) value that meets the target; it is nudged outward by a
relative 1e-6 so that a correction summing in another order still keeps the boundary sequence.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

import offpolicy as op
from offpolicy.inspect.measurements import DvpGrid, Measurements, TokenData

TRM_ACCEPTANCE = 0.70
MIS_MAX_MASKED = 0.05
OPSM_KEEP = 0.95
VETO_KEEP = 0.99
_NUDGE = 1e-6
_NONFINITE = 1e6  # a non-finite divergence fails any δ (offpolicy.divergence.NONFINITE_DIVERGENCE)


def _order_statistic(values: Tensor, fraction: float) -> float:
    """The smallest v among ``values`` with |{x ≤ v}| ≥ fraction · n (n ≥ 1).

    >>> _order_statistic(torch.tensor([0.3, 0.1, 0.2, 0.4]), 0.7)   # ceil(0.7 · 4) = 3rd smallest
    0.30000001192092896
    """
    k = max(1, math.ceil(fraction * values.numel() - 1e-9))
    return float(values.flatten().sort().values[k - 1])


def _up(x: float) -> float:
    return x + _NUDGE * max(abs(x), 1e-12)


def _down(x: float) -> float:
    return x - _NUDGE * max(abs(x), 1e-12)


def trm_divergence(tokens: TokenData) -> tuple[Tensor, Tensor, str]:
    """TRM's per-token divergences for the max and the avg test, and what they are.

    With a measured KL(μ‖π) (exact, or the top-k lower bound) both tests use it; without one, the paper's fallback on
    r = log π − log μ: k2(r) for the max test, k3(r) for the avg test (arXiv 2512.23075 §4).
    """
    if tokens.kl is not None:
        d = torch.nan_to_num(tokens.kl.float(), nan=_NONFINITE, posinf=_NONFINITE).clamp(max=_NONFINITE)
        d = torch.where(tokens.mask, d, torch.zeros_like(d))
        return d, d, tokens.kl_kind or "exact"
    r = tokens.log_ratio
    return op.k2(r), op.k3(r), "k2/k3 of the sampled token"


def _nonempty(tokens: TokenData) -> Tensor:
    return tokens.mask.any(-1)


def _seq_fraction(keep: Tensor, rows: Tensor) -> float:
    """Fraction of the sequences in ``rows`` [B] that keep at least one token."""
    n = int(rows.sum())
    return float((keep.any(-1) & rows).sum()) / n if n else 1.0


def recommend_trm(tokens: TokenData, test: str, target: float = TRM_ACCEPTANCE) -> dict[str, Any]:
    """δ for TRM-Max (``test="max"``) or TRM-Avg (``"avg"``) accepting ≥ ``target`` of the sequences, verified with
    :func:`offpolicy.trust_region_mask`."""
    if test not in ("max", "avg"):
        raise ValueError(f"test must be 'max' or 'avg', got {test!r}")
    d_max, d_avg, kind = trm_divergence(tokens)
    rows = _nonempty(tokens)
    m = tokens.mask
    if test == "max":
        stat = torch.where(m, d_max, torch.full_like(d_max, -math.inf)).amax(-1)
    else:
        stat = (d_avg * m).sum(-1) / m.sum(-1).clamp(min=1)
    delta = max(0.0, _up(_order_statistic(stat[rows], target))) if bool(rows.any()) else 0.0
    kwargs = {"max_kl": delta} if test == "max" else {"avg_kl": delta}
    keep = op.trust_region_mask(d_max if test == "max" else d_avg, m, **kwargs)
    return {"threshold": delta, f"{test}_kl": delta, "target": f">= {target:.0%} of sequences accepted",
            "kept_fraction": _seq_fraction(keep, rows), "unit": "sequences", "divergence": kind}


def recommend_mis(tokens: TokenData, max_masked: float = MIS_MAX_MASKED) -> dict[str, Any]:
    """Token-level band [lower, upper] on ρ = π/μ masking ≤ ``max_masked`` of valid tokens (½ per tail), verified
    with :func:`offpolicy.importance_weights` (mode "mask")."""
    r = tokens.log_ratio[tokens.mask]
    r = r[torch.isfinite(r)]
    if r.numel() == 0:
        lo, hi = 0.0, 0.0
    else:
        s = r.sort().values
        k = int(math.floor(max_masked / 2 * s.numel()))  # at most k tokens strictly outside on each side
        lo, hi = min(float(s[k]), 0.0), max(float(s[s.numel() - 1 - k]), 0.0)
    lower, upper = math.exp(_down(lo)), math.exp(_up(hi))
    _, keep, _ = op.importance_weights(tokens.log_ratio, tokens.mask, level="token", mode="mask", lower=lower,
                                       upper=upper)
    n = int(tokens.mask.sum())
    masked = float((tokens.mask & ~keep).sum()) / n if n else 0.0
    return {"threshold": [lower, upper], "lower": lower, "upper": upper,
            "target": f"<= {max_masked:.0%} of tokens masked", "kept_fraction": 1.0 - masked, "unit": "tokens"}


def _advantages(tokens: TokenData) -> tuple[Tensor, str]:
    if tokens.advantages is not None:
        return tokens.advantages.float(), "the sequences with A < 0"
    return -torch.ones(tokens.mask.shape[0]), "all sequences, taken as A < 0 (no advantages given: the worst case)"


def recommend_opsm(tokens: TokenData, target: float = OPSM_KEEP) -> dict[str, Any]:
    """OPSM δ keeping ≥ ``target`` of the negative-advantage sequences, verified with :func:`offpolicy.opsm_mask`."""
    adv, who = _advantages(tokens)
    m = tokens.mask
    rows = _nonempty(tokens) & (adv < 0)
    stat = -(tokens.log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1)  # mean_t log μ − log π
    stat = torch.nan_to_num(stat, nan=math.inf)
    delta = max(0.0, _up(_order_statistic(stat[rows], target))) if bool(rows.any()) else 0.0
    if not math.isfinite(delta):
        delta = 1e30
    keep = op.opsm_mask(tokens.trainer_logp, tokens.rollout_logp, m, adv, delta=delta)
    return {"threshold": delta, "delta": delta, "target": f">= {target:.0%} of negative-advantage sequences kept",
            "kept_fraction": _seq_fraction(keep, rows), "unit": f"sequences ({who})"}


def recommend_veto(tokens: TokenData, target: float = VETO_KEEP) -> dict[str, Any]:
    """Token-veto threshold τ ∈ (0, 1] keeping ≥ ``target`` of the sequences, verified with :func:`offpolicy.token_veto`."""
    m = tokens.mask
    rows = _nonempty(tokens)
    r = torch.nan_to_num(tokens.log_ratio, nan=-math.inf)
    row_min = torch.where(m, r, torch.full_like(r, math.inf)).amin(-1)[rows]
    if row_min.numel():
        k = int(math.floor((1 - target) * row_min.numel()))  # at most k sequences strictly below log τ
        log_tau = min(_down(float(row_min.sort().values[k])), 0.0)
    else:
        log_tau = 0.0
    tau = min(1.0, max(math.exp(log_tau) if math.isfinite(log_tau) else 0.0, 1e-300))
    keep = op.token_veto(tokens.log_ratio, m, threshold=tau)
    return {"threshold": tau, "target": f">= {target:.0%} of sequences kept", "kept_fraction": _seq_fraction(keep, rows),
            "unit": "sequences"}


def choose_dvp_rho(grid: DvpGrid, coverage: float) -> dict[str, Any]:
    """The largest ρ of the grid whose retained mass is ≥ ``coverage`` at every position (``met``); when none is,
    the smallest ρ of the grid (``met`` False).

    >>> g = DvpGrid(rhos=[0.1, 0.01], mass=torch.tensor([[0.99, 0.9995], [0.998, 1.0]]),
    ...             inside_trainer=torch.ones(2, 2, dtype=torch.bool), inside_rollout=None)
    >>> choose_dvp_rho(g, 0.999)   # ρ = 0.1 leaves 0.99 at position 0; ρ = 0.01 keeps ≥ 0.9995
    {'rho': 0.01, 'met': True}
    """
    best = None
    for j, rho in enumerate(grid.rhos):
        col = grid.mass[:, j]
        if col.numel() == 0 or float(col.min()) >= coverage:
            best = rho if best is None else max(best, rho)
    if best is None:
        return {"rho": min(grid.rhos), "met": False}
    return {"rho": best, "met": True}


def recommend_dvp(grid: DvpGrid | None) -> dict[str, Any] | None:
    """The DVP recommendation as measured by :mod:`offpolicy.inspect.compare` (None without full logits)."""
    if grid is None or grid.check is None:
        return None
    c = grid.check
    return {"threshold": c["rho"], "rho": c["rho"], "log_rho": c["log_rho"],
            "target": f"retained mass >= {c['coverage_target']} at every position"
                      + ("" if c["met"] else " (not reached on the grid: the smallest ρ is shown)"),
            "kept_fraction": c["kept_fraction"], "unit": c["kept_unit"], "mass_min": c["mass_min"],
            "mass_mean": c["mass_mean"]}


def recommend(measured: Measurements) -> dict[str, dict[str, Any]]:
    """Every recommendation that the measurements allow, keyed by correction (module table)."""
    t = measured.tokens
    out = {
        "trm_max": recommend_trm(t, "max"),
        "trm_avg": recommend_trm(t, "avg"),
        "mis": recommend_mis(t),
        "opsm": recommend_opsm(t),
        "veto": recommend_veto(t),
    }
    dvp = recommend_dvp(measured.dvp)
    if dvp is not None:
        out["dvp"] = dvp
    return out


# The corrections at their published defaults: what each would do to this data.
PRESET_DEFAULTS: dict[str, str] = {
    "tis": "token TIS, w = min(ρ, 2)",
    "mis": "token MIS, drop ρ > 2",
    "icepop": "token mask outside [0.5, 5]",
    "geo_mask": "geometric sequence mask [0.999, 1.001]",
    "opsm": "OPSM δ = 1e-4 (A < 0)",
    "veto": "token veto τ = 1e-4",
    "trm": "TRM max 0.05 / avg 0.001",
}


def preset_effects(tokens: TokenData) -> list[dict[str, Any]]:
    """For each correction at its default setting (:data:`PRESET_DEFAULTS`): the fraction of valid tokens it masks,
    of sequences it drops whole, and of kept tokens whose weight it truncates (via :func:`offpolicy.offpolicy_metrics`).
    """
    adv, _ = _advantages(tokens)
    d_max, _, kind = trm_divergence(tokens)
    batch = op.LogProbBatch(
        logp=tokens.trainer_logp, old_logp=tokens.trainer_logp, rollout_logp=tokens.rollout_logp,
        mask=tokens.mask, advantages=adv,
        token_divergence=d_max if tokens.kl is not None else None,
        token_divergence_kind="topk" if kind == "topk" else "exact",
    )
    corrections = {"tis": op.tis(upper=2.0), "mis": op.mis(upper=2.0), "icepop": op.icepop(), "geo_mask": op.geo_mask(),
                   "opsm": op.opsm(), "veto": op.veto(), "trm": op.trm()}
    rows = _nonempty(tokens)
    out = []
    for name, correction in corrections.items():
        result = correction(batch)
        metrics = op.offpolicy_metrics(tokens.trainer_logp, tokens.rollout_logp, tokens.mask, result, prefix="")
        keep = result.keep & tokens.mask
        masked = float(metrics["masked_frac"])
        out.append({
            "preset": name, "setting": PRESET_DEFAULTS[name], "masked_tokens": masked,
            "dropped_sequences": 1.0 - _seq_fraction(keep, rows),
            "truncated_tokens": max(0.0, float(metrics["clipped_frac"]) - masked),
        })
    return out
