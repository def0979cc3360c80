"""The forward stage of the log-prob transforms in one row-chunked pass: :func:`token_scores`, which every host's
scoring calls (TRL's from the backbone's hidden states, verl's engine from its logits).

Over the scored rows, each row chunk's float32 logits z are built once — read from the logits ``[N, V]`` the host
already has (:func:`offpolicy.kernels.row_maps.logits_row_map`), or recomputed as z = h Wᵀ + b from hidden states and
the lm_head (:func:`offpolicy.kernels.row_maps.head_row_map`, no ``[N, V]`` tensor at all) — and every statistic of
the step is read off them by the project's formula functions:

* the log-prob of the targets and the entropy: softmax(z/T) (:func:`offpolicy.kernels.token_stats_from_logits`), or
  under a sampling recipe — DVP's min-p (arXiv 2512.23087 Def 5.2), sampling replay's top-k / top-p — on the support
  the engine's filters leave, in the engine's order (:func:`support_scores`, :func:`support_entropy`; where top-k
  comes before top-p, read off the k largest logits alone, without a ``[rows, V]`` mask or sort);
* top-K TRM's bounds on KL(μ‖π) from the engine's top-K (:func:`offpolicy.topk_kl_lower_bound`,
  :func:`offpolicy.topk_kl_upper_bound`; no gradient);
* score centering's top-K centre (:func:`offpolicy.objectives.score_centering.score_center_topk`, arXiv 2609.20807)
  and the drift it logs (:func:`offpolicy.topk_drift_tv`, no gradient; from the centre's own log-softmax).

The log-prob, the centre and (with ``entropy_grad``) the entropy are differentiable: the backward recomputes each
chunk's z once, takes ∂/∂z of all of them together and pushes it back once, so a method's extra statistics cost
element-wise work on z, not another pass over the head. A recipe of temperature and min-p alone from hidden states,
with no top-K, stays on the fused kernel (:func:`offpolicy.kernels.fused_token_stats`: no ``[rows, V]`` chunk).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import torch
from torch import Tensor

from offpolicy.corrections.vocabulary import SUPPORT_ORDER, replay_support_logp, sampling_support_mask
from offpolicy.divergence import topk_kl_lower_bound, topk_kl_upper_bound
from offpolicy.kernels.chunking import DEFAULT_MEMORY_BUDGET_BYTES
from offpolicy.kernels.fused import fused_token_stats, token_stats_from_logits
from offpolicy.kernels.row_maps import head_row_map, logits_row_map
from offpolicy.objectives.score_centering import score_center_topk, score_center_topk_with_drift, topk_drift_tv
from offpolicy.rollout.sampling import SamplingConfig, TokenHistory, apply_history_processors

__all__ = ["TokenScores", "fused_recipe", "penalised", "support_entropy", "support_scores", "token_scores"]


class TokenScores(NamedTuple):
    """Per scored row ``[N]``: ``logp`` (on the recipe's support under a recipe: a finite stand-in where the target
    is outside it; None when not asked), ``inside`` (the target is in the support; all True without a recipe),
    ``mass`` (the support's retained mass Z; 1 without a recipe, None when not asked), ``entropy`` (None unless
    asked), ``kl_lower`` / ``kl_upper`` (None unless asked), ``center`` (None unless asked), ``drift`` (score
    centering's top-K drift ½‖q̂ − p‖₁, no gradient; None unless asked)."""

    logp: Tensor | None
    inside: Tensor
    mass: Tensor | None
    entropy: Tensor | None
    kl_lower: Tensor | None
    kl_upper: Tensor | None
    center: Tensor | None
    drift: Tensor | None = None


def penalised(z: Tensor, recipe: SamplingConfig, history: TokenHistory | None) -> Tensor:
    """One chunk's float32 logits ``z`` [rows, V] after the recipe's bad words, logit bias and penalties (``z``
    itself when it has none): the first steps of the engine's processing, which a logit bias or a one-token bad word
    takes too without reading the history."""
    return apply_history_processors(z, recipe, history)


def fused_recipe(recipe: SamplingConfig) -> bool:
    """The recipe is temperature and min-p alone: its support needs no sort (min-p is a threshold on the max)."""
    return recipe.top_k is None and recipe.top_p is None and not recipe.reads_history and not recipe.logit_bias \
        and not recipe.bad_words_ids


def _top_k_support(z: Tensor, recipe: SamplingConfig, order: Sequence[str]) -> tuple[Tensor, Tensor, Tensor] | None:
    """The support of a recipe whose top-k comes before any top-p, read off the k largest of z / T alone:
    ``(vals, ids, keep)`` [rows, k] — the k largest tempered logits (differentiable; −inf where a later filter drops
    the token), their ids and whether each survives; None where this does not apply (no top-k, top-p before it,
    k ≥ V, a tie with the k-th value that :func:`~offpolicy.corrections.vocabulary.sampling_support_mask` keeps and
    a top-k list cannot, a non-finite value among the k). Min-p's threshold is on the row's maximum, the first of
    the k, wherever it comes in ``order``; top-p renormalises over the survivors, as the full-row filters do, so the
    support is theirs without a ``[rows, V]`` mask, sort or logsumexp. The tie test reads one bool per chunk."""
    k, p = recipe.top_k, recipe.top_p
    with_top_p = p is not None and p < 1
    if k is None or k <= 0 or k >= z.shape[-1] or (with_top_p and order.index("top_p") < order.index("top_k")):
        return None
    top = (z / recipe.temperature).topk(k + 1, dim=-1)
    vals, ids = top.values[:, :k], top.indices[:, :k]
    with torch.no_grad():
        if bool((top.values[:, k] == top.values[:, k - 1]).any()) or not bool(torch.isfinite(vals).all()):
            return None
        keep = torch.ones_like(vals, dtype=torch.bool)
        for step in order:
            if step == "min_p" and recipe.min_p is not None and recipe.min_p > 0:
                keep &= vals >= vals[:, :1] + math.log(recipe.min_p)
            elif step == "top_p" and with_top_p:
                ascending = vals.masked_fill(~keep, float("-inf")).flip(-1)
                cum = ascending.softmax(-1).cumsum(-1)
                remove = cum <= 1 - p  # type: ignore[operator]  # with_top_p: p is a float
                remove[:, -1] = False  # the most likely token always survives
                keep &= ~remove.flip(-1)
    return vals.masked_fill(~keep, float("-inf")), ids, keep


def support_scores(z: Tensor, targets: Tensor, recipe: SamplingConfig, order: Sequence[str] = SUPPORT_ORDER, *,
                   with_mass: bool = True) -> tuple[Tensor, Tensor, Tensor | None]:
    """(logp, inside, mass) ``[rows]`` of one chunk's penalised float32 logits ``z`` [rows, V] (:func:`penalised`):
    the log-prob of ``targets`` on the support the recipe's filters leave in ``order``, whether the target is inside
    it, and the support's retained mass Z = π(y) / π_S(y) (no gradient; None unless ``with_mass``). A temperature / min-p recipe takes the
    min-p statistics of :func:`~offpolicy.kernels.token_stats_from_logits` (no sort), any other
    :func:`~offpolicy.corrections.vocabulary.replay_support_logp`. Differentiable in ``z`` through ``logp``.

    >>> # z = (3, 2, 1, 0), top-k 2: support {0, 1}; log π(1) = 2 − log(e³ + e²) = −1.3133, Z = 0.8808
    >>> support_scores(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), torch.tensor([1]), SamplingConfig(top_k=2))
    (tensor([-1.3133]), tensor([True]), tensor([0.8808]))
    """
    if fused_recipe(recipe):
        want = (("minp_logp",) + ("minp_mass",) * with_mass) if recipe.min_p is not None else ("logp",)
        s = token_stats_from_logits(z, targets, temperature=recipe.temperature, want=want, min_p_rho=recipe.min_p)
        if recipe.min_p is None:
            assert s.logp is not None  # requested
            return s.logp, torch.ones_like(targets, dtype=torch.bool), torch.ones_like(s.logp) if with_mass else None
        assert s.minp_logp is not None and s.minp_inside is not None  # requested
        return s.minp_logp, s.minp_inside, s.minp_mass.detach() if s.minp_mass is not None else None
    top = _top_k_support(z, recipe, order)
    if top is not None:  # the support within the k largest: log π_S(y) = z_y/T − logsumexp over the survivors
        vals, ids, keep = top
        logp = (z.gather(-1, targets[:, None])[:, 0] / recipe.temperature) - vals.logsumexp(-1)
        inside = ((ids == targets[:, None]) & keep).any(-1)
    else:
        logp, inside = replay_support_logp(z, targets, top_k=recipe.top_k, top_p=recipe.top_p, min_p=recipe.min_p,
                                           temperature=recipe.temperature, order=order)
    if not with_mass:
        return logp, inside, None
    with torch.no_grad():
        scaled = z.detach() / recipe.temperature
        full = scaled.gather(-1, targets[:, None])[:, 0] - scaled.logsumexp(-1)
        mass = torch.exp(full - logp.detach()).clamp(max=1.0)
    return logp, inside, mass


def support_entropy(z: Tensor, recipe: SamplingConfig, order: Sequence[str] = SUPPORT_ORDER) -> Tensor:
    """Entropy ``[rows]`` of π_S from one chunk's penalised float32 logits ``z`` [rows, V] (:func:`penalised`):
    tempered and renormalised on the support S the recipe's filters leave in ``order``,

        H(π_S) = −Σ_{a∈S} π_S(a) log π_S(a),   π_S(a) = exp(z_a/T) / Σ_{b∈S} exp(z_b/T);

    differentiable in ``z`` (the support is fixed).

    >>> # z = (3, 2, 1, 0), top-k 2: π_S = softmax(3, 2) = (0.7311, 0.2689), H = 0.5822
    >>> support_entropy(torch.tensor([[3.0, 2.0, 1.0, 0.0]]), SamplingConfig(top_k=2), ("top_k", "top_p", "min_p"))
    tensor([0.5822])
    """
    top = _top_k_support(z, recipe, order)
    if top is not None:  # over the k largest alone (:func:`_top_k_support`)
        logp_k = top[0].log_softmax(-1)
        return -(logp_k.exp() * logp_k.masked_fill(~top[2], 0.0)).sum(-1)
    support = sampling_support_mask(z.detach(), top_k=recipe.top_k, top_p=recipe.top_p, min_p=recipe.min_p,
                                    temperature=recipe.temperature, order=order)
    logp = (z / recipe.temperature).masked_fill(~support, float("-inf")).log_softmax(-1)
    inside = logp.masked_fill(~support, 0.0)  # 0 · log 0 is 0, not NaN
    return -(inside.exp() * inside).sum(-1)


def _buffers(recipe: SamplingConfig | None, bounds: bool, center: bool) -> int:
    """Float32 ``[rows, V]`` scratch per row of a chunk: the logits, the log-softmax and its gradient (4); the replayed
    support (its sort, the history's two tensors: 8); the bounds' sorted tail (8); the centre's p and q̂ (4)."""
    return 4 + (8 if recipe is not None else 0) + (8 if bounds else 0) + (4 if center else 0)


def token_scores(targets: Tensor, *, logits: Tensor | None = None, hidden: Tensor | None = None,
                 weight: Tensor | None = None, bias: Tensor | None = None, temperature: float | Tensor = 1.0,
                 recipe: SamplingConfig | None = None, order: Sequence[str] = SUPPORT_ORDER, history: Any = None,
                 entropy: bool = False, entropy_grad: bool = False, topk: tuple[Tensor, Tensor] | None = None,
                 bounds: bool = False, center: bool = False, drift: bool = False, logp: bool = True,
                 mass: bool = True, memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> TokenScores:
    """The forward-stage scores of ``targets`` [N] in one row-chunked pass (module docstring), from ``logits``
    [N, V] (raw, before the temperature) or from ``hidden`` [N, H] and the lm_head ``weight`` [V, H] (+ ``bias`` [V]).

    ``temperature``: a float, or ``[N]`` per row (then every statistic is read off z / T and the recipe's own
    temperature is not applied again). Without a recipe it tempers the log-prob and the entropy; it always tempers
    the bounds and the centre (they compare the engine's top-K with π at the sampling temperature). ``recipe`` /
    ``order``: the sampling recipe and the engine's filter order (vLLM's by default); ``history``: what the
    recipe's penalties read (an object with ``chunk(a, b, vocab) -> TokenHistory``). ``entropy``: return it;
    ``entropy_grad``: with its gradient. ``topk``: the engine's ``(log-probs, ids)`` [N, K], read by ``bounds``
    (TRM's KL bounds), ``center`` (score centering) and ``drift`` (its logged drift). ``logp=False``: no log-prob
    of the targets (a host that keeps its own and wants only the bounds or the centre; no recipe then),
    ``TokenScores.logp`` is None; ``mass=False``:
    no retained mass (a host that logs none), ``TokenScores.mass`` is None. Differentiable
    through ``logp``, ``center`` and (with ``entropy_grad``) ``entropy``.

    >>> # z = (0, 0, 0): p = ⅓ each; the engine's top-1 is token 0 with q = 0.6 (κ = 0.6)
    >>> z = torch.zeros(1, 3, requires_grad=True)
    >>> s = token_scores(torch.tensor([1]), logits=z, entropy=True, center=True,
    ...                  topk=(torch.tensor([[0.6]]).log(), torch.tensor([[0]])))
    >>> s.logp.detach(), s.entropy, s.center.detach()   # log ⅓, log 3, Σ_H sg(q − κp) log p = (0.6 − 0.2)·log ⅓
    (tensor([-1.0986]), tensor([1.0986]), tensor([-0.4394]))
    >>> torch.autograd.grad((s.logp + s.center).sum(), z)[0]   # (onehot(1) − p) + (q̂ − p), q̂ = (0.6, 0.2, 0.2)
    tensor([[-0.0667,  0.5333, -0.4667]])
    """
    if (logits is None) == (hidden is None) or (hidden is not None and weight is None):
        raise ValueError("token_scores: pass logits=, or hidden= with weight=")
    if (center or bounds or drift) and topk is None:
        raise ValueError("topk: score centering's centre and drift and TRM's bounds need the engine's top-K "
                         "(topk=(logp, ids))")
    if entropy_grad and not entropy:
        raise ValueError("entropy_grad: set entropy=True too")
    if not logp and recipe is not None:
        raise ValueError("logp=False with a recipe: the recipe changes only the log-prob and its support")
    if recipe is not None and recipe.reads_history and history is None:
        raise ValueError(f"history: the recipe's {recipe.reads_history[0]} reads the token history; pass history=")
    per_row = isinstance(temperature, Tensor)
    if per_row and recipe is not None and recipe.reads_history:
        raise ValueError("temperature: per-row temperatures with a recipe's penalties (applied before it) are not "
                         "supported; pass one float")
    if hidden is not None and weight is not None and recipe is not None and topk is None and fused_recipe(recipe) \
            and not per_row:
        return _fused(hidden, weight, targets, bias, recipe, order, entropy, entropy_grad, memory_budget_bytes)
    n = targets.shape[0]
    t_rows = temperature.float().clamp(min=1e-8).reshape(-1, 1).expand(n, 1) if isinstance(temperature, Tensor) \
        else None
    temp = 1.0 if per_row else float(temperature)
    rec = replace(recipe, temperature=1.0) if per_row and recipe is not None else recipe
    vocab = (weight.shape[0] if weight is not None else logits.shape[1])  # type: ignore[union-attr]
    lp_k, id_k = topk if topk is not None else (None, None)
    with_entropy_out = entropy and not entropy_grad  # the entropy rides along without a gradient

    def chunk(z: Tensor, a: int, b: int) -> tuple[Tensor, ...]:
        recompute = torch.is_grad_enabled()  # the backward: only the differentiable outputs are read
        if t_rows is not None:
            z = z / t_rows[a:b]
        y = targets[a:b]
        ent: Tensor | None = None
        lp: Tensor | None = None
        if rec is None:
            with_entropy = entropy and (entropy_grad or not recompute)
            want = ("logp",) * logp + ("entropy",) * with_entropy
            if want:
                s = token_stats_from_logits(z, y, temperature=temp, want=want,
                                            memory_budget_bytes=memory_budget_bytes)
                lp, ent = s.logp, s.entropy
            inside, kept = torch.ones_like(y, dtype=torch.bool), torch.ones(y.shape, device=z.device)
        else:
            zp = penalised(z, rec, history.chunk(a, b, vocab) if rec.reads_history else None)
            lp, inside, maybe_mass = support_scores(zp, y, rec, order, with_mass=mass and not recompute)
            kept = maybe_mass if maybe_mass is not None else torch.ones_like(lp)
            if entropy and (entropy_grad or not recompute):
                ent = support_entropy(zp, rec, order)
        diff: list[Tensor] = []
        if logp:
            assert lp is not None  # computed above
            diff.append(lp)
        drift_k: Tensor | None = None  # rides along without a gradient: not in the backward's recompute
        if center or drift:
            assert lp_k is not None and id_k is not None  # checked above
            head = (z, id_k[a:b], lp_k[a:b])
            if center and drift and not recompute:  # one log-softmax for both
                c, drift_k = score_center_topk_with_drift(*head, temperature=temp)
                diff.append(c)
            elif center:
                diff.append(score_center_topk(*head, temperature=temp))
            elif not recompute:
                drift_k = topk_drift_tv(*head, temperature=temp)
        if entropy_grad:
            assert ent is not None  # computed above
            diff.append(ent)
        if recompute:
            return tuple(diff)
        ride: list[Tensor] = [inside, kept]
        if with_entropy_out:
            assert ent is not None  # computed above
            ride.append(ent)
        if bounds:
            assert lp_k is not None and id_k is not None  # checked above
            ride.append(topk_kl_lower_bound(lp_k[a:b], id_k[a:b], z, temperature=temp))
            ride.append(topk_kl_upper_bound(lp_k[a:b], id_k[a:b], z, temperature=temp))
        if drift_k is not None:
            ride.append(drift_k)
        return (*diff, *ride)

    n_diff = int(logp) + int(center) + int(entropy_grad)
    buffers = _buffers(recipe, bounds, center or drift) + int(per_row)
    if hidden is not None:
        outs = list(head_row_map(chunk, hidden, weight, bias, buffers=buffers,  # type: ignore[arg-type]
                                 memory_budget_bytes=memory_budget_bytes, differentiable=n_diff))
    else:
        outs = list(logits_row_map(chunk, logits, buffers=buffers,  # type: ignore[arg-type]
                                   memory_budget_bytes=memory_budget_bytes, differentiable=n_diff))
    logp_out = outs.pop(0) if logp else None
    centre = outs.pop(0) if center else None
    ent_out = outs.pop(0) if entropy_grad else None
    inside, kept_mass = outs.pop(0), outs.pop(0)
    if with_entropy_out:
        ent_out = outs.pop(0)
    lower, upper = (outs.pop(0), outs.pop(0)) if bounds else (None, None)
    drift_out = outs.pop(0) if drift else None
    return TokenScores(logp_out, inside, kept_mass if mass else None, ent_out, lower, upper, centre, drift_out)


def _fused(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, recipe: SamplingConfig,
           order: Sequence[str], entropy: bool, entropy_grad: bool, memory_budget_bytes: int) -> TokenScores:
    """A temperature / min-p recipe from hidden states: the fused kernel's log-prob (no ``[rows, V]`` chunk), and the
    support's entropy beside it when asked (one row-chunked pass of its own)."""
    want = ("minp_logp", "minp_mass") if recipe.min_p is not None else ("logp",)
    s = fused_token_stats(hidden, weight, targets, bias=bias, temperature=recipe.temperature, want=want,
                          min_p_rho=recipe.min_p, memory_budget_bytes=memory_budget_bytes)
    if recipe.min_p is None:
        assert s.logp is not None  # requested
        logp, inside, mass = s.logp, torch.ones_like(targets, dtype=torch.bool), torch.ones_like(s.logp)
    else:
        assert s.minp_logp is not None and s.minp_inside is not None and s.minp_mass is not None  # requested
        logp, inside, mass = s.minp_logp, s.minp_inside, s.minp_mass.detach()
    ent = None
    if entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            (ent,) = head_row_map(lambda z, a, b: (support_entropy(z, recipe, order),), hidden, weight, bias,
                                  buffers=8, memory_budget_bytes=memory_budget_bytes)
    return TokenScores(logp, inside, mass, ent, None, None, None)
