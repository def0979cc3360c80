"""The policy loss: a registered token-level objective, a correction's coefficient, one aggregation; autograd does
the rest.

:func:`policy_loss` turns a :class:`~offpolicy.batch.LogProbBatch` (+ an optional correction) into a scalar loss to
*minimise* and a dict of 0-d metric tensors:

1. clean the batch once (:func:`token_inputs`): float32, and every position that does not count — padding, or a
   non-finite value in something the objective reads — set to 0 before any arithmetic, so neither the loss nor its
   gradient can see a NaN;
2. the objective's per-token loss L_t (:mod:`offpolicy.objectives`: ``ppo``, ``decoupled``, ``bypass``, ``gspo``,
   ``reinforce``, ``cispo``, ``sapo``, ``dppo_tv``, ``dppo_kl``, or one you registered);
3. times the correction's detached coefficient c_t = weights · keep (losses only aggregate; corrections only weight);
4. one aggregation over the *padding* mask — a token a correction dropped still counts in the denominator (Trust
   Region Masking's "normalise by the total batch", arXiv 2512.23075 §4):

* ``token_mean``               Σ m L / Σ m                                                  (DAPO, arXiv 2503.14476)
* ``seq_mean_token_mean``      mean over sequences with ≥ 1 valid token of Σ_t m L / Σ_t m   (GRPO)
* ``seq_mean_token_sum_norm``  Σ m L / (B · T_max), T_max = ``max_tokens`` or T              (Dr.GRPO, arXiv 2503.20783)
* ``token_sum``                Σ m L, no normalisation                      (verl's ``token-sum``; the caller scales)

Metrics (0-d float32, detached; fractions are over valid tokens): ``loss/clipfrac_low``, ``loss/clipfrac_high``,
``loss/dual_clip_frac`` — the tokens the objective's clip holds (0 for objectives without one; see
:func:`offpolicy.objectives.ppo.clipped_surrogate`), plus any other fraction an objective reports;
``loss/ratio_mean|max|min`` — of the objective's r (at its level; π_θ/π_old for ``reinforce``); ``loss/empty_batch`` —
1.0 iff no token is valid; ``loss/nonfinite_tokens`` — count of mask=1 tokens dropped as non-finite.

A batch without a valid token gives loss 0.0 with an all-zero gradient; so does an empty one (B = 0 or T = 0). Nothing
syncs to the host, so the function compiles with ``torch.compile(fullgraph=True)``. At ``sequence``/``geometric``
level the gradient is GSPO-token's: each token gets −A·s_i·∇log π_t while the value is the sequence ratio's loss, so a
finite-difference check of the value does not apply there, as for any stop-gradient objective.

Under torch.compile the gradient is autograd's taken during the forward (:func:`with_gradient_kept`), so the backward
keeps one float tensor instead of every mask and clip condition (what makes the compiled loss fast on CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import Tensor

import offpolicy.objectives  # noqa: F401  (registers the built-in objectives)
from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import Correction, CorrectionResult
from offpolicy.objectives.base import TokenInputs
from offpolicy.objectives.proximal import approximate_proximal
from offpolicy.ratios import (
    LOG_RATIO_BOUND,
    Level,
    as_factor,
    count,
    is_finite,
    keep_only,
    max_where,
    min_where,
    pad_nonempty,
    zero_outside,
)
from offpolicy.registry import AGGREGATIONS, OBJECTIVES, Objective, check_params, register_aggregation, split_spec

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm", "token_sum"]

# ---------------------------------------------------------------------------------------------------------------------
# Aggregations
# ---------------------------------------------------------------------------------------------------------------------


@register_aggregation("token_mean")
def token_mean(token_loss: Tensor, mask: Tensor, max_tokens: int | None) -> Tensor:
    """Σ m L / Σ m."""
    return token_loss.sum() / count(mask).clamp(min=1)


@register_aggregation("seq_mean_token_mean")
def seq_mean_token_mean(token_loss: Tensor, mask: Tensor, max_tokens: int | None) -> Tensor:
    """Mean over non-empty sequences of each sequence's token mean."""
    tokens = count(mask, dim=-1)
    per_sequence = token_loss.sum(dim=-1) / tokens.clamp(min=1)
    return per_sequence.sum() / count(tokens > 0).clamp(min=1)


@register_aggregation("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(token_loss: Tensor, mask: Tensor, max_tokens: int | None) -> Tensor:
    """Σ m L / (B · T_max): Dr.GRPO's constant normaliser, T_max = ``max_tokens`` or the padded width T."""
    t_max = max_tokens if max_tokens is not None else mask.shape[-1]
    return token_loss.sum() / max(mask.shape[0] * t_max, 1)


@register_aggregation("token_sum")
def token_sum(token_loss: Tensor, mask: Tensor, max_tokens: int | None) -> Tensor:
    """Σ m L (verl 0.9's ``agg_loss(..., "token-sum")`` without its data-parallel factor)."""
    return token_loss.sum()


# ---------------------------------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------------------------------


def policy_loss(
    batch: LogProbBatch,
    *,
    correction: Correction | CorrectionResult | None = None,
    objective: str | Mapping[str, Any] = "ppo",
    clip_low: float | None = None,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    aggregation: Aggregation | str = "token_mean",
    max_tokens: int | None = None,
    level: Level | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar policy loss (to minimise, float32) and metrics for a ``[B, T]`` batch. See the module docstring.

    Args:
        batch: ``logp`` [B, T] (carries grad), ``mask`` [B, T], ``advantages`` [B] or [B, T] (required), ``old_logp``
            (π_old; ``logp.detach()`` when absent, i.e. r = 1 on a single update), ``rollout_logp`` (μ; needed by
            objectives that read it: ``bypass``, ``decoupled`` without a correction).
        correction: a :class:`Correction` (called on ``batch``) or its :class:`CorrectionResult`; its detached
            ``weights · keep`` multiplies each token's loss and its metrics are merged into the returned dict.
        objective: a registered name (``ppo`` | ``decoupled`` | ``bypass`` | ``gspo`` | ``reinforce`` | ``cispo`` |
            ``sapo`` | ``dppo_tv`` | ``dppo_kl`` | yours) or ``{"name": ..., **params}`` (e.g. ``tau_neg`` for sapo).
        clip_low, clip_high, dual_clip, level: shortcuts for the objective's parameters of these names (the PPO
            family's ε_low ≥ 0 [0.2], ε_high [= ε_low], dual-clip c > 1 [off], ratio level [token]); None leaves the
            objective's default, a value the objective does not take is an error.
        aggregation: a registered name: ``token_mean`` | ``seq_mean_token_mean`` | ``seq_mean_token_sum_norm`` |
            ``token_sum``.
        max_tokens: T_max for ``seq_mean_token_sum_norm`` (defaults to T; ignored by the other aggregations).

    Returns:
        ``(loss, metrics)``: 0-d float32 loss; metrics ``loss/clipfrac_low``, ``loss/clipfrac_high``,
        ``loss/dual_clip_frac``, ``loss/ratio_mean``, ``loss/ratio_max``, ``loss/ratio_min``, ``loss/empty_batch``,
        ``loss/nonfinite_tokens`` (+ the objective's other fractions, + the correction's), all 0-d detached tensors.

    >>> logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    >>> b = LogProbBatch(logp=logp, mask=torch.ones(1, 2), old_logp=torch.tensor([[-1.0, -2.0]]), advantages=torch.tensor([1.0]))
    >>> loss, m = policy_loss(b)   # r = (1, e): the second token is clipped at 1.2 -> L = -(1 + 1.2)/2
    >>> round(loss.item(), 4), m["loss/clipfrac_high"].item()
    (-1.1, 0.5)
    """
    spec, params = resolve_objective(
        objective, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, level=level
    )
    aggregate = AGGREGATIONS[aggregation]
    _check_batch(batch, spec, correction is not None, max_tokens)
    if params.get("proximal", "recompute") == "loglinear":  # decoupled PPO's π_prox without a forward: before the
        batch = approximate_proximal(batch)                  # correction, whose π_old/μ is then π_prox/μ
    result = _resolve_correction(batch, correction)
    if batch.logp.numel() == 0:  # B = 0 or T = 0 (a filtered-out batch): the all-masked result; the padded logp keeps
        batch = batch.nonempty()  # the graph, so the gradient reaching the empty logp has its (empty) shape
        if result is not None:
            result = CorrectionResult(pad_nonempty(result.weights), pad_nonempty(result.keep, False), result.metrics,
                                      weight_level=result.weight_level)

    reads = spec.inputs_read(result is not None)

    def loss_of(logp: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        inputs = token_inputs(batch, reads, corrected=result is not None, logp=logp)
        out = spec.fn(inputs, **params)
        token_loss = out.loss if result is None else out.loss * result.coefficient
        token_loss = token_loss * as_factor(inputs.valid)  # finite: the inputs are 0 wherever a token does not count
        loss = aggregate(token_loss, batch.bool_mask, max_tokens)
        return loss, _loss_metrics(inputs.valid, batch.bool_mask, out.log_ratio, out.clipped)

    loss, metrics = with_gradient_kept(loss_of, batch.logp) if _keeps_gradient(batch.logp) else loss_of(batch.logp)
    if result is not None:
        metrics = {**result.metrics, **metrics}
    return loss, metrics


def with_gradient_kept(
    loss_of: Callable[[Tensor], tuple[Tensor, dict[str, Tensor]]], logp: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """``loss_of(logp)`` whose gradient autograd takes now (``torch.func.grad_and_value``), keeping one float tensor
    ∂loss/∂logp for the backward. :func:`policy_loss` takes this form under torch.compile.

    Why: a loss's backward goes through its masks and clips (``where``, ``minimum``, ``clamp``), and autograd keeps
    their conditions — under torch.compile the partitioner saves them as bool buffers (the smallest cut), which
    inductor on CPU writes element by element: the compiled benchmark path (``benchmarks/core.py``) takes 1.4× as
    long, a clipped PPO loss alone 2.6×. In eager mode the plain backward is the faster one (no transform overhead).
    A scalar loss's backward is grad_output · ∂loss/∂logp, so the numbers are the same (tests/test_registry.py checks
    them against ``loss.backward()`` for every registered objective and aggregation, tests/test_compile.py the
    compiled loss against the eager one). Not twice differentiable: ``create_graph`` sees a constant gradient.
    """
    gradient, (loss, metrics) = torch.func.grad_and_value(loss_of, has_aux=True)(logp.detach())
    return _KeptGradient.apply(logp, loss, gradient), metrics


def _keeps_gradient(logp: Tensor) -> bool:
    return torch.compiler.is_compiling() and logp.requires_grad and torch.is_grad_enabled()


class _KeptGradient(torch.autograd.Function):
    """The loss value, with backward grad_output · (the gradient :func:`with_gradient_kept` took)."""

    @staticmethod
    def forward(ctx: Any, logp: Tensor, loss: Tensor, gradient: Tensor) -> Tensor:
        ctx.save_for_backward(gradient)
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, None, None]:
        (gradient,) = ctx.saved_tensors
        return grad_output * gradient, None, None


def resolve_objective(objective: str | Mapping[str, Any], **shortcuts: Any) -> tuple[Objective, dict[str, Any]]:
    """The registered :class:`~offpolicy.registry.Objective` and its keyword parameters: the spec's own, then the
    shortcuts that are not None (``clip_low`` …). A parameter the objective does not take is a ``ValueError``.

    >>> spec, params = resolve_objective({"name": "sapo", "tau_neg": 2.0}, clip_low=None)
    >>> spec.name, params
    ('sapo', {'tau_neg': 2.0})
    >>> resolve_objective("reinforce", dual_clip=3.0)
    Traceback (most recent call last):
    ...
    ValueError: objective 'reinforce' has no parameter 'dual_clip'; it takes: none
    """
    name, params = split_spec(objective, "objective")
    spec = OBJECTIVES[name]
    params = {**params, **{k: v for k, v in shortcuts.items() if v is not None}}
    check_params("objective", name, spec.fn, params, skip=1)
    return spec, params


# corrections that exist only to act on μ: where a framework has no μ (μ = π_old) they would silently do nothing
NEEDS_ROLLOUT_CORRECTIONS = ("m2po",)


def _leaves(correction: Correction | None) -> list[Correction]:
    if correction is None:
        return []
    return [c for part in correction.parts for c in _leaves(part)] if correction.parts else [correction]


def needs_rollout_logp(correction: Correction | None, objective: str) -> list[str]:
    """The methods among ``correction`` (a chain's parts too) and ``objective`` that need the engine's log-probs μ
    (the M2PO mask, an objective registered with ``reads=("rollout_logp",)`` such as IPO): what a framework
    adapter must refuse when it has no μ to give.

    >>> from offpolicy.registry import build_correction
    >>> needs_rollout_logp(build_correction(["icepop", "m2po"]), "ipo")
    ['m2po', 'ipo']
    >>> needs_rollout_logp(None, "ppo")
    []
    """
    names = [c.name for c in _leaves(correction) if c.name in NEEDS_ROLLOUT_CORRECTIONS]
    if "rollout_logp" in OBJECTIVES[objective].inputs_read(correction is not None):
        names.append(objective)
    return names


def _check_batch(batch: LogProbBatch, spec: Objective, corrected: bool, max_tokens: object) -> None:
    if not isinstance(batch, LogProbBatch):
        raise ValueError(f"batch must be a LogProbBatch, got {type(batch).__name__}")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens must be a positive int or None, got {max_tokens!r}")
    if batch.advantages is None:
        raise ValueError("advantages: policy_loss needs batch.advantages ([B] or [B, T]); the batch has none")
    if "rollout_logp" in spec.inputs_read(corrected) and batch.rollout_logp is None:
        raise ValueError(f"rollout_logp: objective={spec.name!r} reads μ (the rollout engine's log-probs) here, but "
                         "the batch has no rollout_logp")


def _resolve_correction(
    batch: LogProbBatch, correction: Correction | CorrectionResult | None
) -> CorrectionResult | None:
    if correction is None:
        return None
    if isinstance(correction, Correction):
        correction = correction(batch)
    if not isinstance(correction, CorrectionResult):
        raise ValueError(
            f"correction must be a Correction, a CorrectionResult or None, got {type(correction).__name__}")
    if correction.weights.shape != batch.logp.shape or correction.keep.shape != batch.logp.shape:
        raise ValueError(
            f"correction weights/keep have shapes {tuple(correction.weights.shape)}/{tuple(correction.keep.shape)}, "
            f"expected {tuple(batch.logp.shape)}"
        )
    return correction


def token_inputs(batch: LogProbBatch, reads: tuple[str, ...], *, corrected: bool = False,
                 logp: Tensor | None = None) -> TokenInputs:
    """The batch as an objective's :class:`TokenInputs`: float32, and 0 wherever a token does not count.

    A token counts (``valid``) if its mask is 1 and π_θ, A and every log-prob in ``reads`` are finite there; a NaN in
    a log-prob the objective does not read (TRL stores missing vLLM log-probs as NaN) does not drop it. Values are
    replaced (:func:`~offpolicy.ratios.zero_outside`) before any arithmetic, so the gradient at a dropped token is
    exactly 0. ``logp`` stands in for ``batch.logp`` (the tensor the gradient is taken with respect to).

    >>> b = LogProbBatch(logp=torch.tensor([[-1.0, float("nan")]]), mask=torch.ones(1, 2), advantages=torch.ones(1))
    >>> token_inputs(b, ("old_logp",)).valid
    tensor([[ True, False]])
    """
    logp = (batch.logp if logp is None else logp).float()
    advantages = batch.token_advantages()
    valid = batch.bool_mask & is_finite(logp) & is_finite(advantages)
    others = {"old_logp": batch.old_logp, "rollout_logp": batch.rollout_logp}
    for name in reads:
        if others[name] is not None:
            valid = valid & is_finite(others[name])  # type: ignore[arg-type]

    def clean(x: Tensor | None) -> Tensor | None:
        return None if x is None else zero_outside(x.detach().float(), valid)

    clean_logp = zero_outside(logp, valid)
    old = clean(batch.old_logp)
    return TokenInputs(
        logp=clean_logp,
        old_logp=old if old is not None else clean_logp.detach(),
        rollout_logp=clean(batch.rollout_logp),
        advantages=clean(advantages),  # type: ignore[arg-type]
        valid=valid,
        corrected=corrected,
        rollout_finite=None if batch.rollout_logp is None else valid & is_finite(batch.rollout_logp),
    )


def _loss_metrics(valid: Tensor, mask: Tensor, log_ratio: Tensor, clipped: dict[str, Tensor]) -> dict[str, Tensor]:
    """Clip fractions and ratio statistics over the valid tokens, the empty-batch flag and the non-finite count."""
    n_mask = count(mask).float()
    n_valid = count(valid).float()
    per_valid = n_valid.clamp(min=1.0)
    fractions = {name: count(held & valid) / per_valid for name, held in clipped.items()}
    zero = torch.zeros((), device=valid.device)
    bounds = ("clipfrac_low", "clipfrac_high", "dual_clip_frac")
    metrics = {f"loss/{name}": fractions.get(name, zero) for name in bounds}
    metrics.update({f"loss/{name}": value for name, value in fractions.items()})

    log_r = log_ratio.detach().float().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    any_valid = n_valid > 0
    ratio_mean = keep_only(torch.exp(log_r), valid).sum() / per_valid
    ratio_max = torch.exp(max_where(log_r, valid))
    ratio_min = torch.exp(min_where(log_r, valid))
    metrics["loss/ratio_mean"] = torch.where(any_valid, ratio_mean, 1.0)
    metrics["loss/ratio_max"] = torch.where(any_valid, ratio_max, 1.0)
    metrics["loss/ratio_min"] = torch.where(any_valid, ratio_min, 1.0)
    metrics["loss/empty_batch"] = (n_mask == 0).float()
    metrics["loss/nonfinite_tokens"] = n_mask - n_valid
    return metrics
