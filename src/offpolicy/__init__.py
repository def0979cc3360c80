"""offpolicy: stable RL for LLMs when the rollout engine and the training engine disagree.

The public API, grouped by family. ``import offpolicy`` needs torch only; the trainer (``offpolicy.train``), the CLI
and the integrations (``offpolicy.integrations.trl`` / ``.verl``) live in subpackages that need the ``cli`` extra.

>>> import torch, offpolicy as op
>>> batch = op.LogProbBatch(logp=torch.zeros(1, 2), rollout_logp=torch.tensor([[0.0, -2.0]]), mask=torch.ones(1, 2),
...                         advantages=torch.tensor([1.0]))
>>> op.chain(op.tis(upper=2.0), op.icepop())(batch).keep   # ρ = (1, e² = 7.39): icepop drops the second token
tensor([[ True, False]])
"""

# Batch, ratios, composition, registries
# Losses, advantages, diagnostics
from offpolicy.advantages import dr_grpo_advantages, grpo_advantages, rloo_advantages
from offpolicy.batch import LogProbBatch

# Binary (sampled-token) divergences
from offpolicy.binary import bernoulli_kl, bernoulli_tv

# Full-distribution methods: divergences, fused kernels, bounds
from offpolicy.bounds import dvp_bias_bound, mismatch_envelope, trm_bounds
from offpolicy.corrections.base import Correction, CorrectionResult, chain, drop_metrics

# Calibrated importance sampling (a cap tighter for confident tokens)
from offpolicy.corrections.calibrated import calibrated_is

# The delight gate (advantage × surprisal, no behaviour probabilities)
from offpolicy.corrections.delight import delight

# Divergence-gated importance sampling (OpenRLHF's is_correction_*)
from offpolicy.corrections.gated import gate, gated_is

# Importance-sampling corrections (TIS / MIS / IcePop)
from offpolicy.corrections.importance import geo_mask, icepop, importance_correction, importance_weights, mis, tis

# Second-moment trust region for stale data (M2PO)
from offpolicy.corrections.m2po import m2po, m2po_keep

# Sequence masks (OPSM, token veto)
from offpolicy.corrections.sequence_masks import opsm, opsm_decomposition, opsm_mask, token_veto, veto

# Trust Region Masking
from offpolicy.corrections.trust_region import (
    KL_REJECTION_MODES,
    k1,
    k2,
    k3,
    kl_rejection,
    ln_trm,
    ln_trm_mask,
    ser,
    ser_mask,
    trm,
    trust_region_mask,
)

# Dynamic Vocabulary Pruning and sampling-support replay
from offpolicy.corrections.vocabulary import (
    DEFAULT_RHO,
    ConstrainedLogProbs,
    constrained_logp,
    coverage_metrics,
    dvp_fields,
    dvp_keep,
    minp_mask_logits,
    minp_safe_set,
    replay_support_logp,
    sampling_support_mask,
)
from offpolicy.divergence import (
    divergence_fields,
    divergence_kind,
    token_kl,
    token_tv,
    topk_kl_lower_bound,
    topk_kl_upper_bound,
)
from offpolicy.kernels import TokenStats, fused_logp, fused_token_stats, token_stats_from_logits
from offpolicy.losses import needs_rollout_logp, policy_loss
from offpolicy.metrics import METRIC_NAMES, NAMINGS, metric_names, offpolicy_metrics
from offpolicy.objectives import TokenInputs, TokenLoss
from offpolicy.objectives.calibrated_clip import calibrated_clip
from offpolicy.objectives.ipo import ipo
from offpolicy.objectives.proximal import approximate_proximal, loglinear_proximal_logp
from offpolicy.objectives.score_centering import (
    centered_logp,
    sampler_topk,
    score_center,
    score_center_topk,
    topk_drift_tv,
    topk_tail_gap,
)
from offpolicy.objectives.score_centering_is import (
    sampled_is_weight,
    score_center_weighted,
    score_center_weighted_topk,
    weighted_centered_logp,
)

# Adaptive Layerwise Perturbation
from offpolicy.perturbation import LayerwisePerturbation, alp_policy_loss, find_decoder_layers

# The mismatch by position in the sequence
from offpolicy.position import mismatch_by_position, position_bin_edges, position_metrics
from offpolicy.ratios import (
    LEVELS,
    LOG_RATIO_BOUND,
    aggregate_log_ratio,
    decompose_log_ratio,
    log_ratio,
    masked_mean,
    masked_sum,
    nonfinite_rows,
    per_sequence,
    sequence_log_ratio,
)
from offpolicy.registry import (
    AGGREGATIONS,
    CORRECTIONS,
    NEEDS,
    OBJECTIVES,
    TRANSFORMS,
    Transform,
    build_correction,
    build_transform,
    register_aggregation,
    register_correction,
    register_objective,
    register_transform,
)

# Rollout engines: one spec, one factory, a registry of backends (hf, vllm, llamacpp, server, and any registered)
from offpolicy.rollout.factory import build_engine, register_engine
from offpolicy.rollout.spec import EngineSpec
from offpolicy.topk_advice import TopKAdvice, topk_advice

# The built-in log-prob transforms (DVP, sampling replay, score centering, π_prox, ALP, top-K bounds), described
from offpolicy.transforms import BUILTIN_TRANSFORMS as _BUILTIN_TRANSFORMS  # noqa: F401 - registers them
from offpolicy.transforms import apply_transforms, fetch_plan

__version__ = "0.1.0"

__all__ = [
    "AGGREGATIONS",
    "CORRECTIONS",
    "KL_REJECTION_MODES",
    "ConstrainedLogProbs",
    "Correction",
    "CorrectionResult",
    "DEFAULT_RHO",
    "EngineSpec",
    "LEVELS",
    "LOG_RATIO_BOUND",
    "LayerwisePerturbation",
    "LogProbBatch",
    "METRIC_NAMES",
    "NAMINGS",
    "NEEDS",
    "OBJECTIVES",
    "Recipe",
    "TRANSFORMS",
    "TokenInputs",
    "TokenLoss",
    "TokenStats",
    "TopKAdvice",
    "Transform",
    "aggregate_log_ratio",
    "alp_policy_loss",
    "apply_transforms",
    "approximate_proximal",
    "bernoulli_kl",
    "bernoulli_tv",
    "build_correction",
    "build_engine",
    "build_transform",
    "calibrated_clip",
    "calibrated_is",
    "centered_logp",
    "chain",
    "constrained_logp",
    "coverage_metrics",
    "decompose_log_ratio",
    "delight",
    "divergence_fields",
    "divergence_kind",
    "dr_grpo_advantages",
    "drop_metrics",
    "dvp_bias_bound",
    "dvp_fields",
    "dvp_keep",
    "fetch_plan",
    "find_decoder_layers",
    "gate",
    "gated_is",
    "fused_logp",
    "fused_token_stats",
    "geo_mask",
    "grpo_advantages",
    "icepop",
    "importance_correction",
    "importance_weights",
    "ipo",
    "k1",
    "k2",
    "k3",
    "kl_rejection",
    "ln_trm",
    "ln_trm_mask",
    "log_ratio",
    "loglinear_proximal_logp",
    "m2po",
    "m2po_keep",
    "masked_mean",
    "masked_sum",
    "metric_names",
    "minp_mask_logits",
    "minp_safe_set",
    "mis",
    "mismatch_by_position",
    "mismatch_envelope",
    "offpolicy_metrics",
    "opsm",
    "opsm_decomposition",
    "opsm_mask",
    "needs",
    "needs_rollout_logp",
    "nonfinite_rows",
    "per_sequence",
    "policy_loss",
    "position_bin_edges",
    "position_metrics",
    "register_aggregation",
    "register_correction",
    "register_engine",
    "register_objective",
    "register_transform",
    "replay_support_logp",
    "rloo_advantages",
    "sampled_is_weight",
    "sampler_topk",
    "sampling_support_mask",
    "score_center",
    "score_center_topk",
    "score_center_weighted",
    "score_center_weighted_topk",
    "sequence_log_ratio",
    "ser",
    "ser_mask",
    "tis",
    "token_kl",
    "token_stats_from_logits",
    "token_tv",
    "token_veto",
    "topk_advice",
    "topk_kl_lower_bound",
    "topk_kl_upper_bound",
    "topk_drift_tv",
    "topk_tail_gap",
    "trm",
    "trm_bounds",
    "trust_region_mask",
    "veto",
    "weighted_centered_logp",
]


def __getattr__(name: str) -> object:
    """:class:`~offpolicy.recipe.Recipe` and :func:`~offpolicy.recipe.needs` on first access: the recipe schema
    needs pydantic, which ``import offpolicy`` does not."""
    if name in ("Recipe", "needs"):
        from offpolicy import recipe

        return getattr(recipe, name)
    raise AttributeError(f"module 'offpolicy' has no attribute {name!r}")
