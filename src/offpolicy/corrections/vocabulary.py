"""Dynamic Vocabulary Pruning (DVP, arXiv 2512.23087) and sampling-support replay.

DVP replaces both policies by their min-p constrained versions (Defs 5.1–5.2):

* safe set V_S(s) = {a : π(a|s) ≥ ρ · max_k π(k|s)}, in logit space z_a ≥ z_max + log ρ, computed without
  gradient (the set is fixed during backpropagation, §5.5); ρ = e^{−13} by default;
* π^mp(a|s) = π(a|s) / Z(s) on V_S, with Z(s) = Σ_{a∈V_S} π(a|s) the retained (coverage) mass;
* the training policy uses its own safe set V_S, the inference policy its own V'_S; when the sampled token is
  outside the *training* safe set the importance ratio is 0 — expressed here as a keep mask (``inside``), never as
  a −inf log-prob (``ratios.log_ratio`` would read a non-finite value as 0, i.e. ratio 1).

DVP changes the log-probs, not the weights, so there is no ``dvp`` weight preset: :func:`dvp_fields` builds the
batch fields (constrained ``logp``/``rollout_logp`` and ``extras["dvp_keep"]``) and :func:`dvp_keep` is the tiny
correction that turns that keep mask into ``CorrectionResult.keep`` (the token leaves the loss numerator and stays
in the denominator, the library's convention). Chain it with MIS for the paper's best configuration. The token veto
of App. A lives in ``corrections.sequence_masks``.

Generalisation (DeepSeek-V3.2 "keep sampling mask"): when the rollout engine sampled with top-k / top-p / min-p,
the distribution that produced the token is π restricted to that *sampling support*. :func:`sampling_support_mask`
replays the engine's filters on any logits and :func:`replay_support_logp` gives π_θ renormalised on the same
support, which removes the bias that truncated sampling puts into every ratio π_θ / μ.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import Correction, CorrectionResult
from offpolicy.kernels.chunking import DEFAULT_MEMORY_BUDGET_BYTES
from offpolicy.kernels.fused import token_stats_from_logits
from offpolicy.ratios import as_mask, masked_mean, masked_min
from offpolicy.registry import register_correction
from offpolicy.rollout.sampling import TRUNCATION_ORDER, apply_history_processors

DEFAULT_RHO = math.exp(-13)
DEFAULT_MASK_VALUE = -50.0
SUPPORT_ORDER: tuple[str, ...] = ("min_p", "top_k", "top_p")  # vLLM (v1) order; HF: ("top_k", "top_p", "min_p")


def _check_rho(rho: float) -> None:
    if not (isinstance(rho, (int, float)) and 0 < rho <= 1):
        raise ValueError(f"rho must be in (0, 1], got {rho!r}")


def _check_logits(logits: object) -> Tensor:
    if not isinstance(logits, Tensor) or logits.dim() < 1 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float [..., V] tensor, got {getattr(logits, 'shape', type(logits))}")
    return logits


@torch.no_grad()
def minp_safe_set(logits: Tensor, rho: float = DEFAULT_RHO) -> Tensor:
    """Bool ``[..., V]``: a ∈ V_S ⇔ z_a ≥ z_max + log ρ (DVP Def 5.1), computed without gradient.

    >>> minp_safe_set(torch.tensor([0.0, -1.0, -3.0]), rho=math.exp(-2))    # threshold 0 − 2 = −2
    tensor([ True,  True, False])
    """
    _check_logits(logits)
    _check_rho(rho)
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays float64, as constrained_logp's
    return z >= z.amax(dim=-1, keepdim=True) + math.log(rho)


def minp_mask_logits(logits: Tensor, rho: float = DEFAULT_RHO, mask_value: float = DEFAULT_MASK_VALUE) -> Tensor:
    """DVP App. A ``apply_minp_masking``: logits outside V_S replaced by the finite ``mask_value``.

    softmax of the result is π^mp up to terms e^{mask_value − z} (Prop 5.6, exact with −inf); the finite value keeps
    bf16 backward free of NaN. Gradient flows to the kept logits only. Note: ``mask_value`` is absolute, as in the
    paper; it is only "very negative" if the kept logits are well above it (use :func:`constrained_logp` for exact
    renormalisation regardless of the logits' scale).

    >>> minp_mask_logits(torch.tensor([0.0, -1.0, -3.0]), rho=math.exp(-2))
    tensor([  0.,  -1., -50.])
    """
    keep = minp_safe_set(logits, rho)
    return torch.where(keep, logits, torch.full((), mask_value, dtype=logits.dtype, device=logits.device))


class ConstrainedLogProbs(NamedTuple):
    """``logp`` log π^mp(y) (a finite stand-in where y ∉ V_S), ``inside`` y ∈ V_S, ``mass`` Z; all ``[...]``."""

    logp: Tensor
    inside: Tensor
    mass: Tensor


def constrained_logp(logits: Tensor, targets: Tensor, rho: float = DEFAULT_RHO, *, temperature: float = 1.0,
                     memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> ConstrainedLogProbs:
    """log π^mp(y) = z_y − logsumexp_{a∈V_S} z_a for one policy over its own safe set (DVP Defs 5.1–5.2).

    ``logits`` [..., V] (divided by ``temperature``), ``targets`` [...] sampled ids. Apply it to the training logits
    (V_S) and, separately, to the inference logits (V'_S). Row-chunked; differentiable w.r.t. ``logits`` with the
    contrastive gradient ∇z_y − E_{π^mp}[∇z] (Prop 5.4). Where ``inside`` is False the DVP ratio is 0: use it as a
    keep mask. ``mass`` is the retained mass Z (Prop 5.5's bias bound uses its minimum).

    >>> # z = (2, 0, −30), ρ = 1e−6 prunes token 2: log π^mp(1) = −log(e² + 1) = −2.1269, Z = 1 − e^{−32}/(e²+1)
    >>> c = constrained_logp(torch.tensor([[2.0, 0.0, -30.0]]), torch.tensor([1]), rho=1e-6)
    >>> c.logp, c.inside, c.mass
    (tensor([-2.1269]), tensor([True]), tensor([1.]))
    """
    _check_logits(logits)
    _check_rho(rho)
    s = token_stats_from_logits(logits, targets, temperature=temperature, want=("minp_logp", "minp_mass"),
                                min_p_rho=rho, memory_budget_bytes=memory_budget_bytes)
    assert s.minp_logp is not None and s.minp_inside is not None and s.minp_mass is not None  # requested
    return ConstrainedLogProbs(s.minp_logp, s.minp_inside, s.minp_mass)


def coverage_metrics(mass: Tensor, mask: Tensor, inside: Tensor | None = None, *,
                     prefix: str = "dvp/") -> dict[str, Tensor]:
    """Retained-mass diagnostics over valid tokens: ``mass_mean``, ``mass_min`` (Z_min) and ``outside_frac``.

    >>> m = coverage_metrics(torch.tensor([[1.0, 0.98, 0.5]]), torch.tensor([[1, 1, 0]]), torch.tensor([[True, False, True]]))
    >>> {k: round(v.item(), 3) for k, v in m.items()}
    {'dvp/mass_mean': 0.99, 'dvp/mass_min': 0.98, 'dvp/outside_frac': 0.5}
    """
    out = {f"{prefix}mass_mean": masked_mean(mass, mask), f"{prefix}mass_min": masked_min(mass, mask)}
    if inside is not None:
        out[f"{prefix}outside_frac"] = masked_mean((~as_mask(inside)).float(), mask)
    return out


def dvp_fields(logits: Tensor, targets: Tensor, mask: Tensor, *, rho: float = DEFAULT_RHO,
               rollout_logits: Tensor | None = None, temperature: float = 1.0,
               memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> dict[str, object]:
    """Batch fields for DVP: ``{"logp", "rollout_logp"?, "extras": {"dvp_keep", "dvp_mass"}}`` ([B, T] each).

    ``logits`` [B, T, V] are π_θ's (gradient flows into ``logp``); ``rollout_logits`` [B, T, V] the inference
    engine's, constrained over their own safe set V'_S (both divided by ``temperature``). Without rollout logits
    keep your engine's ``rollout_logp`` (exact if it sampled with min-p = ρ, since then μ = π_infer^mp).
    ``dvp_keep`` = y ∈ V_S (ratio 0 otherwise, Thm 5.3) and, when rollout logits are given, y ∈ V'_S (a token
    π_infer^mp could not have sampled makes the estimator undefined). Feed the fields to ``LogProbBatch`` and chain
    :func:`dvp_keep` with your weight correction.

    >>> z = torch.tensor([[[2.0, 0.0, -30.0], [0.0, 0.0, 0.0]]])
    >>> f = dvp_fields(z, torch.tensor([[2, 0]]), torch.ones(1, 2), rho=1e-6)
    >>> f["extras"]["dvp_keep"], f["logp"].shape
    (tensor([[False,  True]]), torch.Size([1, 2]))
    """
    train = constrained_logp(logits, targets, rho, temperature=temperature, memory_budget_bytes=memory_budget_bytes)
    keep = train.inside & as_mask(mask)
    out: dict[str, object] = {"logp": train.logp}
    if rollout_logits is not None:
        with torch.no_grad():
            roll = constrained_logp(rollout_logits, targets, rho, temperature=temperature,
                                    memory_budget_bytes=memory_budget_bytes)
        out["rollout_logp"] = roll.logp
        keep = keep & roll.inside
    out["extras"] = {"dvp_keep": keep, "dvp_mass": train.mass.detach()}
    return out


@register_correction("dvp_keep")
def dvp_keep(*, key: str = "dvp_keep") -> Correction:
    """Correction that drops tokens outside the DVP safe set (``batch.extras[key]``, from :func:`dvp_fields`).

    Weights are 1; ``keep = mask & extras[key]``; metrics every correction's — ``dvp_keep/masked_frac`` is the share
    of valid tokens outside the safe set — and ``dvp/mass_mean``, ``dvp/mass_min`` if ``extras["dvp_mass"]`` exists
    (:func:`coverage_metrics`). The batch has no such key → identity (nothing to drop).

    >>> b = LogProbBatch(logp=torch.zeros(1, 3), mask=torch.ones(1, 3), extras={"dvp_keep": torch.tensor([[True, False, True]])})
    >>> dvp_keep()(b).keep
    tensor([[ True, False,  True]])
    """

    def apply(batch: LogProbBatch) -> CorrectionResult:
        ident = CorrectionResult.identity(batch)
        if key not in batch.extras:
            return ident
        inside = as_mask(batch.extras[key])
        if inside.shape != batch.logp.shape:
            raise ValueError(f"extras[{key!r}] has shape {tuple(inside.shape)} but logp has {tuple(batch.logp.shape)}")
        metrics = coverage_metrics(batch.extras["dvp_mass"], batch.mask) if "dvp_mass" in batch.extras else {}
        return CorrectionResult(ident.weights, ident.keep & inside, metrics, weight_level=None)

    return Correction("dvp_keep", apply, {"key": key})


# ---------------------------------------------------------------------------------------------------------------
# Sampling-support replay
# ---------------------------------------------------------------------------------------------------------------

def _apply_top_k(z: Tensor, keep: Tensor, k: int) -> Tensor:
    if k >= z.shape[-1]:
        return keep
    masked = torch.where(keep, z, torch.full((), float("-inf"), dtype=z.dtype))
    kth = masked.topk(k, dim=-1).values[..., -1:]
    return keep & (z >= kth)  # ties with the k-th value are kept (vLLM and HF do the same)


def _apply_top_p(z: Tensor, keep: Tensor, p: float, k: int | None = None) -> Tensor:
    masked = torch.where(keep, z, torch.full((), float("-inf"), dtype=z.dtype))
    if k is not None and k < z.shape[-1]:
        return _apply_top_p_after_top_k(z, keep, masked, p, k)
    sorted_z, idx = masked.sort(dim=-1)  # ascending, as vLLM / HF do
    cum = sorted_z.softmax(dim=-1).cumsum(dim=-1)
    remove = cum <= 1 - p
    remove[..., -1] = False  # the most likely token always survives
    return keep & ~remove.scatter(-1, idx, remove)


def _apply_top_p_after_top_k(z: Tensor, keep: Tensor, masked: Tensor, p: float, k: int) -> Tensor:
    """Top-p when top-k came first: only the k largest (and ties with the k-th) are left, so their ascending
    cumulative mass comes from a top-k selection instead of a sort of the whole row (the sort is most of the
    replay's time at a 150k vocabulary). The masked tokens add exact zeros to the full row's cumulative sum, and tokens
    tied with the k-th beyond the k listed (their order among ties is arbitrary in any sort) add their mass first and
    go or stay together."""
    vals, idx = masked.topk(k, dim=-1)  # descending
    vals, idx = vals.flip(-1), idx.flip(-1)  # ascending, as the full sort would list them
    lse = masked.logsumexp(dim=-1, keepdim=True)
    probs = (vals - lse).exp()
    kth = vals[..., :1]
    tied = keep & (z == kth)
    extra = (tied.sum(-1, keepdim=True) - (vals == kth).sum(-1, keepdim=True)).clamp(min=0) * probs[..., :1]
    cum = probs.cumsum(dim=-1) + extra
    remove = cum <= 1 - p
    remove[..., -1] = False  # the most likely token always survives
    drop_extra = tied & (extra > 0) & (extra <= 1 - p)
    return keep & ~drop_extra.scatter(-1, idx, remove)


@torch.no_grad()
def sampling_support_mask(logits: Tensor, *, top_k: int | None = None, top_p: float | None = None,
                          min_p: float | None = None, temperature: float = 1.0,
                          order: Sequence[str] = SUPPORT_ORDER) -> Tensor:
    """Bool ``[..., V]``: the tokens a sampler with these parameters could emit from ``logits`` [..., V].

    Replays the engine's filters on z / temperature, in ``order`` (vLLM v1: min_p, top_k, top_p — the default;
    Hugging Face ``generate``: ("top_k", "top_p", "min_p")). top-k keeps logits ≥ the k-th largest (ties kept);
    top-p keeps the smallest head whose renormalised mass reaches p (ascending cumulative sum ≤ 1 − p removed, the
    top token always kept); min-p keeps π(a) ≥ min_p · max π. ``None`` (or top_k ≤ 0, top_p ≥ 1, min_p ≤ 0)
    disables a filter. The DeepSeek-V3.2 "keep sampling mask" is this mask recorded at rollout time.

    >>> z = torch.tensor([3.0, 2.0, 1.0, 0.0])
    >>> sampling_support_mask(z, top_k=3), sampling_support_mask(z, top_p=0.7)
    (tensor([ True,  True,  True, False]), tensor([ True,  True, False, False]))
    """
    _check_logits(logits)
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool)):
        raise ValueError(f"top_k must be an int or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if min_p is not None and not (isinstance(min_p, (int, float)) and 0 <= min_p <= 1):
        raise ValueError(f"min_p must be in [0, 1], got {min_p!r}")
    if sorted(order) != sorted(SUPPORT_ORDER):
        raise ValueError(f"order must be a permutation of {SUPPORT_ORDER}, got {tuple(order)!r}")
    z = logits.float() / temperature
    keep = torch.ones_like(z, dtype=torch.bool)
    after_top_k: int | None = None  # top-k already applied: top-p need not sort the whole row
    for step in order:
        if step == "min_p" and min_p is not None and min_p > 0:
            # The max always survives earlier filters, so the threshold is on the global max.
            keep = keep & (z >= z.amax(dim=-1, keepdim=True) + math.log(min_p))
        elif step == "top_k" and top_k is not None and top_k > 0:
            keep = _apply_top_k(z, keep, top_k)
            after_top_k = top_k
        elif step == "top_p" and top_p is not None and top_p < 1:
            keep = _apply_top_p(z, keep, top_p, after_top_k)
    return keep


def replay_support_logp(logits: Tensor, targets: Tensor, *, top_k: int | None = None, top_p: float | None = None,
                        min_p: float | None = None, temperature: float = 1.0,
                        order: Sequence[str] = SUPPORT_ORDER, recipe=None, history=None) -> tuple[Tensor, Tensor]:
    """π_θ renormalised on the rollout's sampling support: ``(logp [...], inside [...])``, float32.

    logp = z_y − logsumexp_{a∈support} z_a with z = logits / temperature and the support from
    :func:`sampling_support_mask` (computed on ``logits`` without gradient; pass the *rollout's* support logits via
    ``sampling_support_mask`` yourself if it must come from the engine). Gradient flows into ``logits``.
    ``inside`` is False when the target is outside the support (a finite stand-in value is returned there; drop the
    token). Allocates ``[..., V]`` temporaries (the support needs a sort for top-p).

    ``recipe`` (an :class:`offpolicy.rollout.sampling.SamplingConfig`, e.g. ``RolloutOutput.sampling``) replays the
    engine's whole recipe instead: its bad words, logit bias and repetition / frequency / presence penalties are
    applied to ``logits`` first (``history``: the :class:`~offpolicy.rollout.sampling.TokenHistory` they read), then
    its temperature and truncation in :func:`~offpolicy.rollout.sampling.process_logits`'s order; leave ``top_k`` …
    ``order`` at their defaults then. Equals ``process_logits(logits, recipe, history)`` at the targets.

    >>> # top_k = 2 on z = (3, 2, 1, 0): support {0, 1}; log π(1) = 2 − log(e³ + e²) = −1.3133
    >>> replay_support_logp(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), torch.tensor([1]), top_k=2)
    (tensor([-1.3133]), tensor([True]))
    """
    _check_logits(logits)
    if not isinstance(targets, Tensor) or tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"targets must have shape {tuple(logits.shape[:-1])}, got {getattr(targets, 'shape', type(targets))}")
    if recipe is not None:
        if (top_k, top_p, min_p, temperature, tuple(order)) != (None, None, None, 1.0, SUPPORT_ORDER):
            raise ValueError("recipe carries temperature, top_k, top_p and min_p: leave them and order unset")
        logits = apply_history_processors(logits.float(), recipe, history)
        top_k, top_p, min_p, temperature = recipe.top_k, recipe.top_p, recipe.min_p, recipe.temperature
        order = TRUNCATION_ORDER
    support = sampling_support_mask(logits, top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature,
                                    order=order)
    if recipe is not None and recipe.bad_words_ids:
        support = support & torch.isfinite(logits.detach())  # a banned word is outside the support too
    z = logits.float() / temperature
    if recipe is not None and recipe.bad_words_ids:
        z = z.clamp(min=torch.finfo(z.dtype).min)  # the finite stand-in at a banned target (no gradient there)
    lse = torch.where(support, z, torch.full((), float("-inf"))).logsumexp(dim=-1)
    y = targets.long().unsqueeze(-1)
    return z.gather(-1, y).squeeze(-1) - lse, support.gather(-1, y).squeeze(-1)
