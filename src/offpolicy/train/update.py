"""Step 3 of the trainer, the update: minibatches of π_θ forwards (ALP noise on, routes replayed), score centering's
centred log-probs, the correction chain and the objective, backward, clip, step.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from offpolicy.batch import LogProbBatch
from offpolicy.losses import policy_loss
from offpolicy.perturbation import alp_policy_loss
from offpolicy.ratios import masked_mean
from offpolicy.registry import BoundTransform, build_transform
from offpolicy.rollout.routing import replay_routes
from offpolicy.rollout.sampling import process_logits
from offpolicy.train.build import DTYPES, nonfinite_fields
from offpolicy.train.presets import SCORE_CENTERING_TOPK
from offpolicy.train.proximal import proximal_method, with_versions
from offpolicy.train.scoring import score_policy
from offpolicy.transforms import apply_transforms, forward_extras

if TYPE_CHECKING:  # the records of offpolicy.train.steps, which imports this module
    from offpolicy.train.steps import Rollout, Scored, TrainState


def update_step(state: TrainState, rollout: Rollout, scored: Scored, seed: int) -> list[dict[str, Tensor]]:
    """``optim.epochs`` passes of ``optim.minibatches`` optimiser steps over the batch, in a seeded order: per
    minibatch a π_θ forward (ALP noise on), the correction chain and the objective, backward, clip, step. Returns
    each minibatch's loss metrics (tensors)."""
    cfg = state.cfg
    if state.alp is not None:
        state.alp.reseed(seed)
    order_generator = torch.Generator().manual_seed(seed)
    updates: list[dict[str, Tensor]] = []
    loglinear = proximal_method(state.objective_params) == "loglinear"
    for epoch in range(cfg.optim.epochs):
        order = torch.randperm(len(rollout.prompt_ids), generator=order_generator)
        for rows in order.tensor_split(cfg.optim.minibatches):
            batch = _minibatch(state, rollout, scored, rows)
            if rollout.versions is not None and not loglinear:  # per-token versions for what reads them
                batch = batch.replace(versions=rollout.versions[rows, : batch.seq_len].to(batch.logp.device),
                                      policy_version=state.policy_version)
            if loglinear:  # AReaL's π_prox from versions (offpolicy.train.proximal); epoch 1 feeds the π_old metrics
                assert rollout.versions is not None  # score_step refuses a rollout without
                batch = with_versions(batch, rollout.versions[rows], state.policy_version,
                                      record=scored.old_logp if epoch == 0 else None, rows=rows)
            loss, metrics = _loss(state, batch)
            state.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            params = [p for g in state.optimizer.param_groups for p in g["params"]]
            max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm is not None else math.inf
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            state.optimizer.step()
            updates.append({"loss/loss": loss.detach(), "loss/grad_norm": grad_norm.detach(), **metrics})
    scored.theta = None  # the graph has served its one backward
    state.policy_version += 1
    return updates


def _minibatch(state: TrainState, rollout: Rollout, scored: Scored, rows: Tensor) -> LogProbBatch:
    """The :class:`LogProbBatch` of some rows, with π_θ from a forward with the ALP noise on (and routes replayed)."""
    if scored.theta is not None:  # single pass: the scoring's forward, with its graph, is π_θ's
        logp, extras = scored.theta
        return LogProbBatch(logp=logp[rows], mask=scored.mask[rows], old_logp=scored.old_logp[rows],
                            rollout_logp=scored.rollout_logp[rows], advantages=rollout.advantages[rows],
                            token_divergence=None if scored.token_divergence is None else scored.token_divergence[rows],
                            extras={**{k: v[rows] for k, v in extras.items()},
                                    **_engine_topk(state, rollout, rows, logp.shape[1], logp.device)},
                            **nonfinite_fields(state.cfg))
    ids = rows.tolist()
    routes = replay_routes(state.model, [scored.theta_routes[i] for i in ids]) if scored.theta_routes is not None \
        else contextlib.nullcontext()
    with state.alp.active() if state.alp is not None else contextlib.nullcontext(), routes:
        logp, mask, logits, extras = score_policy(
            state.model, [rollout.prompt_ids[i] for i in ids], [rollout.completions[i] for i in ids], state.sampling,
            dtype=DTYPES[state.cfg.model.dtype], dvp_rho=state.cfg.algorithm.dvp_rho if state.preset.minp else None,
            return_logits=state.preset.score_centering is not None)
    t = logp.shape[1]
    # the scoring's mask, not only the completion's: a multi-turn step leaves tool tokens out there (train.multi_turn)
    mask = mask & scored.mask[rows, :t].to(mask.device)
    if state.preset.score_centering is not None:
        assert logits is not None  # return_logits
        q: Tensor | tuple[Tensor, Tensor]
        if scored.sampler_logits is not None:
            q = scored.sampler_logits[rows, :t]
        else:
            assert scored.sampler_head is not None  # score_step sets one of the two
            q = (scored.sampler_head[0][rows, :t], scored.sampler_head[1][rows, :t])
        targets = None
        if state.preset.score_weighting == "replay":  # π_θ renormalised on the sampler's support at the sampled ids
            from offpolicy.rollout.base import pad_ids

            targets = pad_ids([rollout.completions[i] for i in ids], 0, side="right")[0].to(logits.device)[:, :t]
        logp, extras = _score_centered(state, logp, logits, q, extras, rollout_logp=scored.rollout_logp[rows, :t],
                                       targets=targets)
    return LogProbBatch(
        logp=logp, mask=mask, old_logp=scored.old_logp[rows, :t], rollout_logp=scored.rollout_logp[rows, :t],
        advantages=rollout.advantages[rows],
        token_divergence=None if scored.token_divergence is None else scored.token_divergence[rows, :t],
        extras={**extras, **_engine_topk(state, rollout, rows, t, logp.device)}, **nonfinite_fields(state.cfg),
    )


def _engine_topk(state: TrainState, rollout: Rollout, rows: Tensor, t: int, device: torch.device
                 ) -> dict[str, Tensor]:
    """The engine's top-K ``[rows, t, K]`` as the batch's extras (``engine_topk.logp`` / ``.ids``), for a plug-in
    transform that needs it (:func:`~offpolicy.train.build.sampling_config` asked the engine for its K)."""
    ids, logp = getattr(rollout, "topk_ids", None), getattr(rollout, "topk_logp", None)
    if ids is None or logp is None or not any(
            "engine_topk" in build_transform(spec).needs for spec in state.cfg.algorithm.transforms or ()):
        return {}
    picked = rows.to(ids.device)
    return forward_extras(topk=(logp[picked, :t].to(device), ids[picked, :t].to(device)))


def _score_centered(state: TrainState, logp: Tensor, logits: Tensor, sampler: Tensor | tuple[Tensor, Tensor],
                    extras: dict[str, Tensor], *, rollout_logp: Tensor,
                    targets: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """π_θ's log-probs and the centre c of the centred score ∇log p(y) − E_q[∇log p] (arXiv 2609.20807; exact from
    the sampler's full logits, or its top-k head with the proportional tail) in the extras, which the batch step of
    ``score_centering`` puts into the log-probs' gradient (:func:`_transforms`), and the per-token drift ½‖q − p‖₁,
    the top-k head's mass and the top-k tail error ½‖q − q̂‖₁ as extras (logged as ``score_centering/*``). ``sampler``: the raw logits ``[B, T, V]``
    of a re-score, or a server's head ``(ids, log q)`` ``[B, T, K]``: then the drift is the proportional-tail estimate
    ½‖q̂ − p‖₁ and the tail error, which needs the full q, is not logged."""
    from offpolicy.objectives.score_centering import centering_token_metrics, sampler_topk, score_center, topk_tail_gap

    temperature = state.sampling.temperature
    if state.preset.score_weighting is not None:  # the IS rule's weight and weighted centre (score_centering_is)
        return _weighted_centered(state, logp, logits, sampler, rollout_logp, extras, targets)
    if isinstance(sampler, tuple):  # the engine's own top-K, already tempered
        ids, logq = sampler
        center, drift = _topk_center(logits, ids, logq, temperature, drift=True)
        assert drift is not None  # asked for
        return logp, {**extras, **forward_extras(center=center), **centering_token_metrics(drift, logq)}
    sampler_logits = sampler
    if state.preset.score_centering == "topk":
        center = _topk_center(logits, *sampler_topk(sampler_logits, SCORE_CENTERING_TOPK, temperature=temperature),
                              temperature, drift=False)[0]
    else:
        center = score_center(logits, sampler_logits, temperature=temperature)
    tail = topk_tail_gap(logits.detach(), sampler_logits, SCORE_CENTERING_TOPK, temperature=temperature)
    return logp, {**extras, **forward_extras(center=center),
                  **centering_token_metrics(tail.drift, head_mass_q=tail.head_mass_q),
                  "score_centering/topk_gap_tv": tail.gap}


def _topk_center(logits: Tensor, ids: Tensor, logq: Tensor, temperature: float, *,
                 drift: bool) -> tuple[Tensor, Tensor | None]:
    """Score centering's top-K centre ``[B, T]`` of raw logits ``[B, T, V]`` on q's head ``(ids, logq)`` ``[B, T, K]``
    (and its drift when asked): one :func:`~offpolicy.forward_scores.token_scores` pass, as TRL's and verl's."""
    from offpolicy.forward_scores import token_scores

    shape, vocab, k = ids.shape[:-1], logits.shape[-1], ids.shape[-1]
    s = token_scores(torch.zeros(shape.numel(), dtype=torch.long, device=logits.device),
                     logits=logits.reshape(-1, vocab), temperature=temperature,
                     topk=(logq.reshape(-1, k), ids.reshape(-1, k)), center=True, drift=drift, logp=False, mass=False)
    assert s.center is not None  # asked for
    return s.center.reshape(shape), (s.drift.reshape(shape) if s.drift is not None else None)


def _weighted_centered(state: TrainState, logp: Tensor, logits: Tensor, sampler: Tensor | tuple[Tensor, Tensor],
                       rollout_logp: Tensor, extras: dict[str, Tensor],
                       targets: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
    """π_θ's log-probs with the sampled token's IS weight and the weighted centre in their gradient (presets
    ``score_centering_tis`` / ``_icepop`` / ``_replay``; no correction weights the loss), on q's top-K head: the
    engine's own, or from a re-score's logits — tempered for TIS / IcePop, processed like the engine's sampling
    (its truncated support) for replay, where the sampled token's log-prob is renormalised on that support too
    (``targets``). Logs ``score_centering/is_weight`` and ``score_centering/is_clipped``."""
    from offpolicy.objectives.score_centering import sampler_topk
    from offpolicy.objectives.score_centering_is import weighted_centering

    rule = state.preset.score_weighting
    assert rule is not None
    if isinstance(sampler, tuple):
        head = sampler
    elif rule == "replay":  # the support the engine sampled from: −inf outside it (an empty slot in the head)
        logq, ids = process_logits(sampler, state.sampling).topk(min(SCORE_CENTERING_TOPK, sampler.shape[-1]), -1)
        head = (ids, logq)
    else:
        head = sampler_topk(sampler, SCORE_CENTERING_TOPK, temperature=state.sampling.temperature)
    logp, more = weighted_centering(logp, logits, rollout_logp, head, rule=rule,
                                    temperature=state.sampling.temperature, targets=targets)
    return logp, {**extras, **more}


def _transforms(state: TrainState) -> list[BoundTransform]:
    """The batch steps of the run's transforms: score centering's (unweighted: the IS rules put their weighted
    centre in the log-probs themselves), then the plug-ins, in the config's order."""
    out = []
    if state.preset.score_centering is not None and state.preset.score_weighting is None:
        out.append(build_transform({"name": "score_centering", "source": state.preset.score_centering}))
    return out + [build_transform(spec) for spec in state.cfg.algorithm.transforms or ()]


def _loss(state: TrainState, batch: LogProbBatch) -> tuple[Tensor, dict[str, Tensor]]:
    batch = apply_transforms(batch, _transforms(state))
    if state.preset.score_centering is not None:  # the drift term's size per position, over the valid tokens
        loss, metrics = _loss_of(state, batch)
        return loss, {**metrics, **{k: masked_mean(v, batch.mask) for k, v in batch.extras.items()
                                    if k.startswith("score_centering/")}}
    return _loss_of(state, batch)


def _loss_of(state: TrainState, batch: LogProbBatch) -> tuple[Tensor, dict[str, Tensor]]:
    a = state.cfg.algorithm
    if state.alp is not None:  # ALP's unified ratio with the paper's clip range for its level
        return alp_policy_loss(batch, level=state.cfg.alp.level, correction=state.correction, clip_low=a.clip_low,
                               clip_high=a.clip_high, dual_clip=state.objective_params.get("dual_clip"),
                               aggregation=a.aggregation)
    objective = {"name": state.objective, **state.objective_params}
    return policy_loss(batch, correction=state.correction, objective=objective, aggregation=a.aggregation)
