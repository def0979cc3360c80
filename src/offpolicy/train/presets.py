"""Named presets, as data: each method is a list of correction specs, an objective and what the trainer must compute.

=========  =============================================================================  ==========================
preset     corrections (on the mismatch ratio π_old/μ unless said)                        objective / extras
=========  =============================================================================  ==========================
naive      none — the mismatch is ignored (GRPO as if μ = π_old)                          ppo
tis        ``tis``: token-level truncated IS, w = min(ρ, 2)   (Yao et al. 2025)            ppo (= decoupled + TIS)
mis        ``mis``: token-level masked IS, w = ρ·1[ρ ≤ 2]     (Liu et al. 2025)            ppo
geo_mask   ``geo_mask``: geometric-mean sequence mask (ms-swift / verl)                   ppo
icepop     ``icepop``: two-sided token mask [0.5, 5]        (arXiv 2510.18855)            ppo
opsm       ``opsm``: off-policy sequence mask, δ = opsm_delta (arXiv 2512.02556)         ppo
trm        ``trm``: trust-region mask (arXiv 2512.23075): drop sequences with max_t KL >   ppo
           0.05 or mean_t KL > 0.001 (trm_max_kl / trm_avg_kl; null turns that test off); exact KL(μ‖π_old) from
           logits, once per step (= the paper's KL(μ‖π_θ) on the first minibatch; without logits the
           k-estimators on the current π_θ/μ)
dvp        min-p constrained log-probs for π_θ, π_old, μ, ρ = e^-13 (arXiv 2512.23087)   ppo
dvp_mis    dvp + ``mis`` (the paper's best)                                              ppo
alp        learnable layerwise noise, unified ratio π_{θ,σ}/μ (arXiv 2603.19470)         bypass, dual-clip 10
m2po       ``m2po``: drop the largest (log π_θ/μ)² among PPO's active quadrants until     ppo
           the batch second moment ≤ 0.04 (arXiv 2510.01161, Alg. 1)
ipo        none: prime-rl's IPO loss, mask |π_θ(y) − μ(y)| > 0.1 + 1e-3·(log π_θ/μ)²        ipo
score_     the centred score ∇log p(y) − E_q[∇log p] from the sampler's full distribution   ppo
centering  q (arXiv 2609.20807); ``score_centering_topk``: q's top-20 + proportional tail
score_     no correction chain: the sampled token's IS weight w(π_θ/μ) and the weighted    ppo
centering  centre E_q[w ∇log p] are both in the log-prob's gradient, NeMo-RL's coefficients
_tis …     on q's top-20 (``_tis``: w = clamp(r, 0, 2); ``_icepop``: r·1[0.5 ≤ r ≤ 5];
           ``_replay``: π_θ renormalised on the sampler's recorded support, exact there)
=========  =============================================================================  ==========================

``algorithm.corrections: [{name: icepop}, {name: opsm, delta: 0.5}]`` replaces a preset's corrections by any registered
ones (:func:`offpolicy.register_correction`), ``algorithm.objective`` its objective. The older ``algorithm.*`` keys
tune a preset's own corrections (:data:`PRESET_PARAMETERS`: ``is_upper`` is the ``upper`` of its ``tis`` / ``mis`` /
``geo_mask`` / ``icepop`` …); ``veto_threshold`` adds the DVP paper's token veto to any chain. DVP presets also drop
the sampled tokens outside the trainer's safe set (``dvp_keep``, first in the chain).

>>> sorted(PRESETS)[:4]
['alp', 'alp_score_centering', 'alp_score_centering_topk', 'dvp']
>>> PRESETS["alp"].objective, PRESETS["dvp"].minp
('bypass', True)
>>> PRESETS["tis"].correction_specs(AlgorithmDefaults(is_upper=3.0))
[{'name': 'tis', 'level': 'token', 'upper': 3.0}]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from offpolicy.corrections.base import Correction

# algorithm.<key> → (the parameter it sets, the preset corrections it applies to). None leaves the correction's own
# default, except for the two trm tests, where None turns that test off (the config holds the paper's values).
PRESET_PARAMETERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "is_level": ("level", ("tis", "mis")),
    "is_lower": ("lower", ("tis", "mis", "geo_mask", "icepop")),
    "is_upper": ("upper", ("tis", "mis", "geo_mask", "icepop")),
    "opsm_delta": ("delta", ("opsm",)),
    "trm_max_kl": ("max_kl", ("trm",)),
    "trm_avg_kl": ("avg_kl", ("trm",)),
}
NONE_TURNS_OFF = ("trm_max_kl", "trm_avg_kl")
SCORE_CENTERING_TOPK = 20  # the sampler's head size for score_centering_topk (vLLM's default max_logprobs is 20)


@dataclass(frozen=True)
class AlgorithmDefaults:
    """The ``algorithm.*`` values a preset reads (the config's defaults; :class:`~offpolicy.train.config.AlgorithmConfig`
    has the same fields)."""

    is_level: str = "token"
    is_lower: float | None = None
    is_upper: float | None = None
    opsm_delta: float = 1e-4
    trm_max_kl: float | None = 0.05
    trm_avg_kl: float | None = 0.001
    veto_threshold: float | None = None


@dataclass(frozen=True)
class Preset:
    """What a method needs: its correction specs (registered names + parameters), its objective and the trainer-side
    extras.

    ``minp``: compute min-p constrained log-probs (DVP) for all three policies; ``divergence``: compute the per-token
    KL(μ‖π_old) from logits for the trust region (exact when the rollout's full logits exist, else the correction
    falls back to k-estimators); ``alp``: the layerwise perturbation must be on; ``score_centering``: centre the
    score on the sampler's distribution (``"exact"`` or ``"topk"``, :data:`SCORE_CENTERING_TOPK` ids).
    """

    name: str
    description: str
    corrections: tuple[str, ...] = ()
    objective: str = "ppo"
    minp: bool = False
    divergence: bool = False
    alp: bool = False
    dual_clip: float | None = None
    score_centering: str | None = None  # "exact" (the sampler's full q) | "topk" (its top-k head, proportional tail)
    # the IS rule the centre's coefficients follow (a key of objectives.score_centering_is.PRESET_RULES: "tis" |
    # "icepop" | "replay"); None: the plain centring on q
    score_weighting: str | None = None

    def correction_specs(self, algorithm: Any) -> list[dict[str, Any]]:
        """The preset's corrections as specs, tuned by the ``algorithm.*`` keys of :data:`PRESET_PARAMETERS`."""
        specs = []
        for name in self.corrections:
            spec: dict[str, Any] = {"name": name}
            for key, (parameter, applies_to) in PRESET_PARAMETERS.items():
                value = getattr(algorithm, key)
                if name in applies_to and (value is not None or key in NONE_TURNS_OFF):
                    spec[parameter] = value
            specs.append(spec)
        return specs

    def correction(self, algorithm: Any) -> Correction | None:
        """The preset's own correction chain for these settings, plus the optional token veto (None = nothing)."""
        from offpolicy.registry import build_correction

        veto = [{"name": "veto", "threshold": algorithm.veto_threshold}] if algorithm.veto_threshold is not None else []
        return build_correction(self.correction_specs(algorithm) + veto)


def chain_specs(preset: Preset, algorithm: Any) -> list[dict[str, Any]]:
    """Every correction the trainer applies, as specs: DVP's ``dvp_keep`` (min-p presets), then
    ``algorithm.corrections`` or else the preset's own, then the token veto when ``algorithm.veto_threshold`` is set.

    >>> chain_specs(PRESETS["dvp_mis"], AlgorithmDefaults(veto_threshold=1e-4))
    [{'name': 'dvp_keep'}, {'name': 'mis', 'level': 'token'}, {'name': 'veto', 'threshold': 0.0001}]
    """
    own = getattr(algorithm, "corrections", None)
    specs = [dict(s) if isinstance(s, dict) else {"name": s} for s in own] if own is not None else \
        preset.correction_specs(algorithm)
    if preset.minp:  # a sampled token outside the trainer's safe set has DVP ratio 0: dropped from the numerator
        specs = [{"name": "dvp_keep"}, *specs]
    if algorithm.veto_threshold is not None:
        specs.append({"name": "veto", "threshold": algorithm.veto_threshold})
    return specs


def build_chain(preset: Preset, algorithm: Any) -> Correction | None:
    """The trainer's correction (None when there is nothing to correct), from :func:`chain_specs`."""
    from offpolicy.registry import build_correction

    return build_correction(chain_specs(preset, algorithm))


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("naive", "no correction: GRPO/PPO that treats μ as π_old"),
        Preset("tis", "token truncated importance sampling on π_old/μ (cap 2)", ("tis",)),
        Preset("mis", "token masked importance sampling on π_old/μ (drop ρ > 2)", ("mis",)),
        Preset("geo_mask", "sequence mask on the geometric-mean ratio π_old/μ", ("geo_mask",)),
        Preset("icepop", "token mask outside the band [0.5, 5] (IcePop)", ("icepop",)),
        Preset("opsm", "off-policy sequence mask: drop A<0 sequences with mean log(μ/π) > δ", ("opsm",)),
        Preset("trm", "trust-region mask: drop sequences with max token KL(μ‖π) > 0.05 or mean token KL > 0.001",
               ("trm",), divergence=True),
        Preset("dvp", "dynamic vocabulary pruning: min-p (ρ=e^-13) constrained log-probs", minp=True),
        Preset("dvp_mis", "DVP + token masked importance sampling", ("mis",), minp=True),
        Preset("alp", "adaptive layerwise perturbation, unified ratio π_{θ,σ}/μ", objective="bypass", alp=True,
               dual_clip=10.0),
        Preset("m2po", "second-moment trust region: drop the largest (log π_θ/μ)² until their mean ≤ 0.04 (M2PO)",
               ("m2po",)),
        Preset("ipo", "prime-rl's IPO: mask |π_θ(y) − μ(y)| > 0.1, penalty 1e-3·(log π_θ/μ)²", objective="ipo"),
        Preset("score_centering", "centre the score on the sampler's full distribution: ∇log p(y) − E_q[∇log p]",
               score_centering="exact"),
        Preset("score_centering_topk", "score centering from the sampler's top-20 log-probs, proportional tail",
               score_centering="topk"),
        Preset("score_centering_tis", "token TIS w = clamp(π_θ/μ, 0, 2) with the centre E_q[w ∇log p] (NeMo-RL's "
               "coefficients on the top-20)", score_centering="topk", score_weighting="tis"),
        Preset("score_centering_icepop", "IcePop w = r·1[0.5 ≤ r ≤ 5] with the centre E_q[w ∇log p] (NeMo-RL's "
               "coefficients on the top-20)", score_centering="topk", score_weighting="icepop"),
        Preset("score_centering_replay", "score centering on the sampler's recorded support, π_θ renormalised on "
               "it (exact, no tail)", score_centering="topk", score_weighting="replay"),
        Preset("alp_score_centering", "ALP's unified ratio with the score centred on the sampler's full "
               "distribution, the centre from the same noisy forward", objective="bypass", alp=True, dual_clip=10.0,
               score_centering="exact"),
        Preset("alp_score_centering_topk", "ALP's unified ratio with the score centred on the sampler's top-20, the "
               "centre from the same noisy forward", objective="bypass", alp=True, dual_clip=10.0,
               score_centering="topk"),
    )
}


def list_presets() -> list[tuple[str, str, str]]:
    """``(name, objective, description)`` for every preset, in definition order.

    >>> list_presets()[0]
    ('naive', 'ppo', 'no correction: GRPO/PPO that treats μ as π_old')
    """
    return [(p.name, p.objective, p.description) for p in PRESETS.values()]
