"""Everything the TRL adapter's forward needs from the lm_head, in one row-chunked pass over it.

From the backbone's last hidden states ``h`` [N, H] of the scored tokens and the head ``W`` [V, H] (+ ``b``), each
row chunk's logits z = h Wᵀ + b are built once (:func:`offpolicy.kernels.row_maps.head_row_map`, float32) and every
statistic of the step is read off them by the project's own formula functions:

* the log-prob of the targets and the entropy — TRL's (softmax(z/T), :func:`offpolicy.kernels.token_stats_from_logits`)
  or, under the sampling recipe, the replayed ones on the support the engine's filters leave
  (:func:`~offpolicy.integrations.trl.replay.support_scores`, :func:`~offpolicy.integrations.trl.replay.support_entropy`);
* top-k TRM's bounds on KL(μ‖π) from the engine's top-K (:func:`offpolicy.topk_kl_lower_bound`,
  :func:`offpolicy.topk_kl_upper_bound`; no gradient);
* score centering's top-k centre (:func:`offpolicy.objectives.score_centering.score_center_topk`, differentiable).

The log-prob, the centre and (when TRL's entropy bonus trains through it) the entropy are differentiable: the backward
recomputes each chunk's z once, takes ∂/∂z of all of them together and pushes it through the matmul once, so a
method's extra statistics cost element-wise work on z, not another head pass (before: the bounds and the centre were
one pass each, the replayed entropy another). The recompute skips the outputs without gradient. A 16-bit head is
up-cast once per forward and once per backward when its float32 copy fits in a quarter of the budget, else one slice
per chunk (:mod:`offpolicy.kernels.row_maps`).

A recipe of temperature and min-p alone, without top-k data, stays on the fused kernel of
:func:`~offpolicy.integrations.trl.replay.replay_logp` (no ``[rows, V]`` chunk at all), its entropy a separate pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from offpolicy.divergence import topk_kl_lower_bound, topk_kl_upper_bound
from offpolicy.integrations.trl.replay import (
    ReplayHistory,
    fused_recipe,
    penalised,
    replay_logp,
    support_entropy,
    support_scores,
)
from offpolicy.integrations.trl.terms import replay_entropy
from offpolicy.kernels.chunking import DEFAULT_MEMORY_BUDGET_BYTES
from offpolicy.kernels.fused import token_stats_from_logits
from offpolicy.kernels.row_maps import head_row_map
from offpolicy.objectives.score_centering import score_center_topk
from offpolicy.rollout.sampling import TRUNCATION_ORDER, SamplingConfig


class HeadScores(NamedTuple):
    """Per scored row ``[N]``: ``logp`` (replayed under a recipe), ``inside`` (the target is in the replayed support;
    all True without a recipe), ``mass`` (the support's retained mass; 1 without a recipe), ``entropy`` (None unless
    asked), ``kl_lower`` / ``kl_upper`` (None without top-k data), ``center`` (None unless asked)."""

    logp: Tensor
    inside: Tensor
    mass: Tensor
    entropy: Tensor | None
    kl_lower: Tensor | None
    kl_upper: Tensor | None
    center: Tensor | None


def _buffers(recipe: SamplingConfig | None, topk: bool, center: bool) -> int:
    """Float32 ``[rows, V]`` scratch per row of a chunk: the logits, the log-softmax and its gradient (4); the replayed
    support (its sort, the history's two tensors: 8); the bounds' sorted tail (8); the centre's p and q̂ (4)."""
    return 4 + (8 if recipe is not None else 0) + (8 if topk else 0) + (4 if center else 0)


def head_scores(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None,
                temperature: float = 1.0, recipe: SamplingConfig | None = None,
                order: Sequence[str] = TRUNCATION_ORDER, history: ReplayHistory | None = None,
                entropy: bool = False, entropy_grad: bool = False,
                topk: tuple[Tensor, Tensor] | None = None, center: bool = False,
                memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> HeadScores:
    """The scores of ``targets`` [N] from ``hidden`` [N, H] and the lm_head ``weight`` [V, H] (``bias`` [V]) in one
    pass (module docstring).

    ``temperature``: TRL's, for the log-prob and entropy without a recipe, and for the top-k bounds and the centre
    (which compare the engine's top-K with π_θ at the sampling temperature). ``recipe`` / ``order`` / ``history``:
    the sampling recipe to replay (:mod:`offpolicy.integrations.trl.replay`). ``entropy``: return it;
    ``entropy_grad``: with its gradient (TRL's entropy bonus). ``topk``: the engine's ``(log-probs, ids)`` [N, K]:
    return the bounds. ``center``: return score centering's centre (needs ``topk``). Differentiable in ``hidden``,
    ``weight`` and ``bias`` through ``logp``, ``center`` and (with ``entropy_grad``) ``entropy``.

    >>> # W = I, z = h = (0, 0, 0): p = ⅓ each; the engine's top-1 is token 0 with q = 0.6 (κ = 0.6)
    >>> h = torch.zeros(1, 3, requires_grad=True)
    >>> s = head_scores(h, torch.eye(3), torch.tensor([1]), entropy=True, center=True,
    ...                 topk=(torch.tensor([[0.6]]).log(), torch.tensor([[0]])))
    >>> s.logp.detach(), s.entropy, s.center.detach()   # log ⅓, log 3, Σ_H sg(q − κp) log p = (0.6 − 0.2)·log ⅓
    (tensor([-1.0986]), tensor([1.0986]), tensor([-0.4394]))
    >>> torch.autograd.grad((s.logp + s.center).sum(), h)[0]   # (onehot(1) − p) + (q̂ − p), q̂ = (0.6, 0.2, 0.2)
    tensor([[-0.0667,  0.5333, -0.4667]])
    """
    if center and topk is None:
        raise ValueError("center: score centering's centre needs the engine's top-k (topk=(logp, ids))")
    if entropy_grad and not entropy:
        raise ValueError("entropy_grad: set entropy=True too")
    if recipe is not None and topk is None and not center and fused_recipe(recipe):
        return _fused_replay(hidden, weight, targets, bias=bias, recipe=recipe, order=order, entropy=entropy,
                             entropy_grad=entropy_grad, memory_budget_bytes=memory_budget_bytes)
    vocab = weight.shape[0]
    budget = memory_budget_bytes
    lp_k, id_k = topk if topk is not None else (None, None)
    with_entropy_out = entropy and not entropy_grad  # the entropy rides along without a gradient

    def chunk(z: Tensor, a: int, b: int) -> tuple[Tensor, ...]:
        recompute = torch.is_grad_enabled()  # the backward: only the differentiable outputs are read
        y = targets[a:b]
        ent: Tensor | None = None
        if recipe is None:
            want = ("logp", "entropy") if entropy and (entropy_grad or not recompute) else ("logp",)
            s = token_stats_from_logits(z, y, temperature=temperature, want=want, memory_budget_bytes=budget)
            assert s.logp is not None  # requested
            logp, ent = s.logp, s.entropy
            inside = torch.ones_like(y, dtype=torch.bool)
            mass = torch.ones_like(logp)
        else:
            zp = penalised(z, recipe, history.chunk(a, b, vocab) if recipe.reads_history else None)  # type: ignore[union-attr]
            logp, inside, mass = support_scores(zp, y, recipe, order)
            if entropy and (entropy_grad or not recompute):
                ent = support_entropy(zp, recipe, order)
        diff: list[Tensor] = [logp]
        if center:
            assert lp_k is not None and id_k is not None  # checked above
            diff.append(score_center_topk(z, id_k[a:b], lp_k[a:b], temperature=temperature))
        if entropy_grad:
            assert ent is not None  # computed above
            diff.append(ent)
        if recompute:
            return tuple(diff)
        ride: list[Tensor] = [inside, mass]
        if with_entropy_out:
            assert ent is not None  # computed above
            ride.append(ent)
        if lp_k is not None and id_k is not None:
            ride.append(topk_kl_lower_bound(lp_k[a:b], id_k[a:b], z, temperature=temperature))
            ride.append(topk_kl_upper_bound(lp_k[a:b], id_k[a:b], z, temperature=temperature))
        return (*diff, *ride)

    n_diff = 1 + int(center) + int(entropy_grad)
    outs = list(head_row_map(chunk, hidden, weight, bias, buffers=_buffers(recipe, topk is not None, center),
                             memory_budget_bytes=budget, differentiable=n_diff))
    logp = outs.pop(0)
    centre = outs.pop(0) if center else None
    ent_out = outs.pop(0) if entropy_grad else None
    inside, mass = outs.pop(0), outs.pop(0)
    if with_entropy_out:
        ent_out = outs.pop(0)
    lower, upper = (outs.pop(0), outs.pop(0)) if topk is not None else (None, None)
    return HeadScores(logp, inside, mass, ent_out, lower, upper, centre)


def _fused_replay(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None, recipe: SamplingConfig,
                  order: Sequence[str], entropy: bool, entropy_grad: bool, memory_budget_bytes: int) -> HeadScores:
    """A temperature / min-p recipe: the fused kernel's replayed log-prob, and the support's entropy beside it."""
    r = replay_logp(hidden, weight, targets, recipe, order=order, bias=bias, memory_budget_bytes=memory_budget_bytes)
    ent = None
    if entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            ent = replay_entropy(hidden, weight, recipe, order=order, bias=bias, memory_budget_bytes=memory_budget_bytes)
    return HeadScores(r.logp, r.inside, r.mass, ent, None, None, None)
