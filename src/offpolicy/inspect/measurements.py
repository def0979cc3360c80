"""What an inspection measured, as plain data: per-token tensors, vocabulary-wide aggregates, the DVP grid, layers.

``offpolicy inspect`` fills every part from two engines on one model; ``offpolicy diagnose`` fills the per-token part
from a dump (this project's schema, or verl's / TRL's tensors) and leaves the parts that need a model as None. The
report (:mod:`offpolicy.inspect.report`) shows what is there and says what is missing.

Notation (DVP — Li et al., "Dynamic Vocabulary Pruning: Stable LLM-RL by Taming the Tail", §4): π = the trainer
(π_train, π_old), μ = the rollout engine (π_infer); for the sampled token a at a response position the log-ratio is
r = log π(a) − log μ(a) = Δ_a.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

# Probability bins (log10 edges) for |Δ| against p over the vocabulary and for the sampled-token plots.
# 12 bins [1e-12, 1e-11), …, [1e-1, 1]; p < 1e-12 joins the first.
P_BIN_EDGES: tuple[float, ...] = tuple(float(e) for e in range(-12, 1))
N_P_BINS = len(P_BIN_EDGES) - 1
TAIL_P = 1e-3  # "tail" tokens: p < 1e-3 …
HEAD_P = 0.5  # … against "head" tokens: p > 0.5 (the README's tail/head ratio)


def pad_time(x: Tensor, t: int, value: float | int = 0) -> Tensor:
    """Right-pad dim 1 (time) of ``x`` to length ``t`` with ``value``."""
    if x.shape[1] == t:
        return x
    pad = torch.full((x.shape[0], t - x.shape[1], *x.shape[2:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=1)


@dataclass
class TokenData:
    """Per-token measurements, ``B`` sequences × ``T`` response positions (padding: mask False, values 0).

    * ``completion_ids`` [B, T] long, ``mask`` [B, T] bool.
    * ``rollout_logp`` [B, T]: log μ of the sampled token as the rollout engine reported it (processed: temperature,
      truncation). ``trainer_logp`` [B, T]: log π of the same token from the trainer's forward, processed the same way.
    * ``kl`` [B, T]: KL(μ‖π) between the full tempered next-token distributions (exact), or its top-k lower bound
      (``kl_kind = "topk"``); ``kl_upper`` the top-k upper bound (top-k only); ``kl_reverse`` KL(π‖μ); ``tv`` total
      variation; ``topk_overlap`` |top-k(μ) ∩ top-k(π)| / k; ``eps_max`` [B, T] the centred logit perturbation
      ½ (max_k ε_k − min_k ε_k), ε = z_μ/τ − z_π/τ (softmax ignores a common shift, so this is the smallest ε_max of
      DVP Prop. 4.2 that describes the position).
    * ``topk_ids`` [B, T, K]: the rollout's K most likely tokens; ``rollout_topk_logp`` / ``trainer_topk_logp`` [B, T, K]
      their tempered log-probs under μ and π (what a top-k KL bound needs).
    * ``advantages`` [B] (optional): OPSM masks only sequences with a negative advantage; without them every
      sequence is treated as negative (the worst case).
    """

    completion_ids: Tensor
    mask: Tensor
    rollout_logp: Tensor
    trainer_logp: Tensor
    kl: Tensor | None = None
    kl_kind: str | None = None
    kl_upper: Tensor | None = None
    kl_reverse: Tensor | None = None
    tv: Tensor | None = None
    topk_overlap: Tensor | None = None
    eps_max: Tensor | None = None
    topk_ids: Tensor | None = None
    rollout_topk_logp: Tensor | None = None
    trainer_topk_logp: Tensor | None = None
    advantages: Tensor | None = None
    prompt_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        shape = tuple(self.mask.shape)
        if len(shape) != 2:
            raise ValueError(f"mask must be [B, T], got {shape}")
        for name in ("completion_ids", "rollout_logp", "trainer_logp", "kl", "kl_upper", "kl_reverse", "tv",
                     "topk_overlap", "eps_max"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, mask has {shape}")
        for name in ("topk_ids", "rollout_topk_logp", "trainer_topk_logp"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape[:2]) != shape:
                raise ValueError(f"{name} must be [B, T, K] with [B, T] = {shape}, got {tuple(t.shape)}")
        if self.kl is not None and self.kl_kind not in ("exact", "topk"):
            raise ValueError(f"kl_kind must be 'exact' or 'topk' when kl is given, got {self.kl_kind!r}")
        if self.advantages is not None and tuple(self.advantages.shape) != shape[:1]:
            raise ValueError(f"advantages must be [B={shape[0]}], got {tuple(self.advantages.shape)}")

    @property
    def log_ratio(self) -> Tensor:
        """r = log π − log μ per sampled token [B, T] (0 at padding)."""
        return torch.where(self.mask, self.trainer_logp - self.rollout_logp, torch.zeros_like(self.trainer_logp))

    @property
    def lengths(self) -> Tensor:
        """Valid tokens per sequence [B]."""
        return self.mask.sum(-1)


@dataclass
class VocabStats:
    """Aggregates over every (position, vocabulary token) pair — the full distributions, not only sampled tokens.

    Δ_a = log π(a) − log μ(a), p_a = π(a) (tempered). ``bin_abs_delta`` / ``bin_count``: Σ|Δ| and count per
    probability bin (:data:`P_BIN_EDGES`). ``paper_violations``: pairs with |Δ| > 2 ε_max (1 − p) (DVP Prop. 4.2 as
    printed); ``corrected_violations``: pairs with |Δ| > 2 ε_max (1 − p) e^{2 ε_max} (the form that always holds,
    :func:`offpolicy.bounds.mismatch_envelope` with ``rigorous=True``) — any there is a bug, not a finding.
    ``scatter_*``: a random subsample of pairs for the plots (half drawn from π, half uniform over the vocabulary).
    """

    pairs: int = 0
    skipped_rows: int = 0  # positions with a non-finite logit on either side: no envelope, left out
    paper_violations: int = 0
    corrected_violations: int = 0
    bin_abs_delta: list[float] = field(default_factory=lambda: [0.0] * N_P_BINS)
    bin_count: list[int] = field(default_factory=lambda: [0] * N_P_BINS)
    head_abs_delta: float = 0.0
    head_count: int = 0
    tail_abs_delta: float = 0.0
    tail_count: int = 0
    scatter_p: list[float] = field(default_factory=list)
    scatter_abs_delta: list[float] = field(default_factory=list)
    scatter_eps_max: list[float] = field(default_factory=list)

    def merge(self, other: VocabStats) -> VocabStats:
        """The sum of two partial aggregates (micro-batches)."""
        return VocabStats(
            pairs=self.pairs + other.pairs, skipped_rows=self.skipped_rows + other.skipped_rows,
            paper_violations=self.paper_violations + other.paper_violations,
            corrected_violations=self.corrected_violations + other.corrected_violations,
            bin_abs_delta=[a + b for a, b in zip(self.bin_abs_delta, other.bin_abs_delta)],
            bin_count=[a + b for a, b in zip(self.bin_count, other.bin_count)],
            head_abs_delta=self.head_abs_delta + other.head_abs_delta, head_count=self.head_count + other.head_count,
            tail_abs_delta=self.tail_abs_delta + other.tail_abs_delta, tail_count=self.tail_count + other.tail_count,
            scatter_p=self.scatter_p + other.scatter_p,
            scatter_abs_delta=self.scatter_abs_delta + other.scatter_abs_delta,
            scatter_eps_max=self.scatter_eps_max + other.scatter_eps_max,
        )

    @property
    def tail_head_ratio(self) -> float | None:
        """mean |Δ| over pairs with p < 1e-3 ÷ mean |Δ| over pairs with p > 0.5 (None when either set is empty)."""
        if not self.head_count or not self.tail_count:
            return None
        head = self.head_abs_delta / self.head_count
        return math.inf if head == 0 else (self.tail_abs_delta / self.tail_count) / head


@dataclass
class DvpGrid:
    """DVP's min-p safe sets (Li et al., Defs 5.1–5.2) evaluated at a grid of ρ, on every valid position.

    ``rhos`` [G]; ``mass`` [N, G]: the trainer's retained mass Z = π(V_S) per valid position; ``inside_trainer`` /
    ``inside_rollout`` [N, G] bool: the sampled token lies in the trainer's / the rollout's safe set (DVP's ratio is 0
    otherwise, so the token is dropped). The grid is one bucketing pass; ``check`` holds the recommended ρ applied
    through :func:`offpolicy.constrained_logp` — the correction's own kernel — on the same logits.
    """

    rhos: list[float]
    mass: Tensor
    inside_trainer: Tensor
    inside_rollout: Tensor | None
    check: dict[str, Any] | None = None  # the recommended ρ re-applied with constrained_logp (compare._dvp_summary)


@dataclass
class LayerError:
    """Relative error ‖h_μ − h_π‖_F / ‖h_π‖_F of one hooked point over all non-padding positions."""

    name: str
    rel_error: float


@dataclass
class Measurements:
    """Everything one inspection measured; ``meta`` holds the specs, sampling settings, timings and checks."""

    tokens: TokenData
    vocab: VocabStats | None = None
    dvp: DvpGrid | None = None
    layers: list[LayerError] | None = None
    layer_threshold: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    routing: Any = None  # mixture-of-experts models: offpolicy.inspect.routing_flips.RoutingFlips
