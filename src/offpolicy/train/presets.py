"""Named presets: each method of the seeds as a correction chain + objective (+ what the trainer must compute).

=========  =============================================================================  ==========================
preset     correction chain (on the mismatch ratio π_old/μ unless said)                  objective / extras
=========  =============================================================================  ==========================
naive      none — the mismatch is ignored (GRPO as if μ = π_old)                          ppo
tis        token-level truncated IS, w = min(ρ, 2)   (Yao et al. 2025; seed 002)          ppo (= decoupled + TIS)
mis        token-level masked IS, w = ρ·1[ρ ≤ 2]     (Liu et al. 2025; seed 002)          ppo
geo_mask   geometric-mean sequence mask (ms-swift/verl geo_mask; seed 002)               ppo
icepop     two-sided token mask [0.5, 5]             (Ring-1T, arXiv 2510.18855)          ppo
opsm       off-policy sequence mask, δ = opsm_delta  (DeepSeek-V3.2; seed 004)            ppo
trm        trust-region mask (seed 003): drop sequences with max_t KL > 0.05 or           ppo
           mean_t KL > 0.001 (trm_max_kl / trm_avg_kl; null turns that test off); exact KL(μ‖π_old) from
           logits, once per step (= the paper's KL(μ‖π_θ) on the first minibatch; without logits the
           k-estimators on the current π_θ/μ)
dvp        min-p constrained log-probs for π_θ, π_old, μ, ρ = e^-13 (seed 000)            ppo
dvp_mis    dvp + token MIS (the paper's best)                                            ppo
alp        learnable layerwise noise, unified ratio π_{θ,σ}/μ (seed 001)                  bypass, dual-clip 10
=========  =============================================================================  ==========================

``algorithm.*`` fields override the defaults (``is_upper``, ``opsm_delta``, ``trm_max_kl`` …); ``veto_threshold``
adds the DVP paper's token veto to any preset.

>>> sorted(PRESETS)[:4]
['alp', 'dvp', 'dvp_mis', 'geo_mask']
>>> PRESETS["alp"].objective, PRESETS["dvp"].minp
('bypass', True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from offpolicy.corrections.base import Correction
    from offpolicy.train.config import AlgorithmConfig


def _kw(**kwargs: object) -> dict[str, object]:
    """Drop None so the correction's own defaults apply."""
    return {k: v for k, v in kwargs.items() if v is not None}


def _tis(a: "AlgorithmConfig") -> "Correction":
    from offpolicy.corrections.importance import tis

    return tis(**_kw(level=a.is_level, lower=a.is_lower, upper=a.is_upper if a.is_upper is not None else 2.0))


def _mis(a: "AlgorithmConfig") -> "Correction":
    from offpolicy.corrections.importance import mis

    return mis(**_kw(level=a.is_level, lower=a.is_lower, upper=a.is_upper if a.is_upper is not None else 2.0))


def _geo_mask(a: "AlgorithmConfig") -> "Correction":
    from offpolicy.corrections.importance import geo_mask

    return geo_mask(**_kw(lower=a.is_lower, upper=a.is_upper))


def _icepop(a: "AlgorithmConfig") -> "Correction":
    from offpolicy.corrections.importance import icepop

    return icepop(**_kw(lower=a.is_lower, upper=a.is_upper))


def _opsm(a: "AlgorithmConfig") -> "Correction":
    from offpolicy.corrections.sequence_masks import opsm

    return opsm(delta=a.opsm_delta)


def _trm(a: "AlgorithmConfig") -> "Correction":
    from offpolicy.corrections.trust_region import trm

    # Passed as they are, not through _kw: None means "this test off" (the config holds the paper's defaults,
    # 0.05 and 0.001); dropping None let trm()'s own avg_kl=0.001 apply to a config that said null.
    return trm(max_kl=a.trm_max_kl, avg_kl=a.trm_avg_kl)


@dataclass(frozen=True)
class Preset:
    """What a method needs: its correction (or None), its objective and the trainer-side extras.

    ``minp``: compute min-p constrained log-probs (DVP) for all three policies; ``divergence``: compute the per-token
    KL(μ‖π_old) from logits for the trust region (exact when the rollout's full logits exist, else the correction
    falls back to k-estimators); ``alp``: the layerwise perturbation must be on.
    """

    name: str
    description: str
    objective: str = "ppo"
    build: Callable[["AlgorithmConfig"], "Correction"] | None = None
    minp: bool = False
    divergence: bool = False
    alp: bool = False
    dual_clip: float | None = None

    def correction(self, algorithm: "AlgorithmConfig") -> "Correction | None":
        """The preset's correction chain for these settings (None = no correction), plus the optional token veto."""
        from offpolicy.corrections.base import chain

        parts = []
        if self.build is not None:
            parts.append(self.build(algorithm))
        if algorithm.veto_threshold is not None:
            from offpolicy.corrections.sequence_masks import veto

            parts.append(veto(threshold=algorithm.veto_threshold))
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else chain(*parts)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("naive", "no correction: GRPO/PPO that treats μ as π_old"),
        Preset("tis", "token truncated importance sampling on π_old/μ (cap 2)", build=_tis),
        Preset("mis", "token masked importance sampling on π_old/μ (drop ρ > 2)", build=_mis),
        Preset("geo_mask", "sequence mask on the geometric-mean ratio π_old/μ", build=_geo_mask),
        Preset("icepop", "token mask outside the band [0.5, 5] (IcePop)", build=_icepop),
        Preset("opsm", "off-policy sequence mask: drop A<0 sequences with mean log(μ/π) > δ", build=_opsm),
        Preset("trm", "trust-region mask: drop sequences with max token KL(μ‖π) > 0.05 or mean token KL > 0.001",
               build=_trm, divergence=True),
        Preset("dvp", "dynamic vocabulary pruning: min-p (ρ=e^-13) constrained log-probs", minp=True),
        Preset("dvp_mis", "DVP + token masked importance sampling", build=_mis, minp=True),
        Preset("alp", "adaptive layerwise perturbation, unified ratio π_{θ,σ}/μ", objective="bypass", alp=True,
               dual_clip=10.0),
    )
}


def list_presets() -> list[tuple[str, str, str]]:
    """``(name, objective, description)`` for every preset, in definition order.

    >>> list_presets()[0]
    ('naive', 'ppo', 'no correction: GRPO/PPO that treats μ as π_old')
    """
    return [(p.name, p.objective, p.description) for p in PRESETS.values()]
