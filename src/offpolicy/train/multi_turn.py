"""Multi-turn rollouts in the reference trainer: the engine called once per policy turn, tool tokens out of the loss.

A task with several policy turns (:func:`offpolicy.tasks.is_multi_turn`, e.g. ``tool_calc``) replaces the step's
rollout and scoring (:func:`offpolicy.train.steps.rollout_step` / :func:`~offpolicy.train.steps.score_step`) with
:func:`multi_turn_step`:

1. rollout — :func:`offpolicy.rollout.multi_turn.run_turns`: one ``engine.generate`` per policy turn, the environment's
   text tokenized once between turns; rewards on the final turn's text, advantages per group;
2. the trainer's ids — ``task.multi_turn_ids``: ``engine`` (default; token-in, token-out: the engine's sampled ids
   and the tool's ids as the engine read them) or ``retokenize`` (the decoded conversation tokenized again — the
   pipeline whose drift this module measures; :mod:`offpolicy.rollout.conversation`);
3. scoring — π_old over the whole conversation (one forward), then the loss mask: tool tokens, the prompt, padding
   and (retokenize) tokens with no engine log-prob never contribute to the loss or to the mismatch metrics;
4. metrics — ``multi_turn/drift_*`` (the trainer's ids against the engine's, per segment: 0 with ``engine``),
   ``multi_turn/retokenize_drift_*`` (what re-tokenizing would give, measured in either mode), per-turn mismatch
   ``multi_turn/turn{t}/{k3, abs_logp_diff, first_k3, first_abs_logp_diff, tokens}``
   (:mod:`offpolicy.rollout.turn_drift`), ``multi_turn/tool_tokens`` and ``multi_turn/unaligned_tokens`` per row.

The update's batch takes the scoring's mask, in the single pass and in every minibatch or epoch that scores π_θ
again (:mod:`offpolicy.train.update`): the re-scoring forward alone would count tool tokens. What it needs: π_old from
a forward (``algorithm.proximal=recompute``) and no engine-routes replay (``rollout.routing_replay=r3``: the engine's
routes are not recorded across turns; ``r2`` records the trainer's own). Other configs are refused with a
``ValueError`` naming the setting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from offpolicy.rollout.conversation import MODES, Conversation, TrainerView, trainer_view
from offpolicy.rollout.multi_turn import TurnPrompt, run_turns
from offpolicy.rollout.prompts import compute_rewards, step_prompts
from offpolicy.rollout.sync_check import SyncProbe
from offpolicy.rollout.turn_drift import retokenization_drift, turn_metrics, turn_mismatch, view_drift
from offpolicy.train.proximal import proximal_method, token_versions
from offpolicy.train.steps import Rollout, Scored, TrainState, score_step


@dataclass
class MultiTurnRollout(Rollout):
    """A :class:`~offpolicy.train.steps.Rollout` whose completions are whole conversations after the prompt, with
    the conversations, the trainer's views of them and, ``[B, T]`` like ``rollout_logp``: ``loss_mask`` (policy
    tokens with an engine log-prob), ``turn`` (0-based policy turn, −1 elsewhere), ``first`` (a turn's first token)."""

    conversations: list[Conversation] = field(default_factory=list)
    views: list[TrainerView] = field(default_factory=list)
    loss_mask: Tensor | None = None
    turn: Tensor | None = None
    first: Tensor | None = None


def multi_turn_ids(cfg) -> str:
    """The trainer's id mode (``task.multi_turn_ids``: ``engine`` unless the config says otherwise)."""
    mode = str(getattr(cfg.task, "multi_turn_ids", "engine"))
    if mode not in MODES:
        raise ValueError(f"task.multi_turn_ids must be one of {MODES}, got {mode!r}")
    return mode


def check_multi_turn(state: TrainState) -> None:
    """Refuse a config the multi-turn step cannot train correctly (see the module docstring)."""
    if state.cfg.rollout.routing_replay == "r3":
        raise ValueError("rollout.routing_replay: a multi-turn task cannot replay the engine's routes (r3), which are "
                         "not recorded across turns; use r2 (the trainer's own π_old routes) or none")
    if proximal_method(state.objective_params) != "recompute":
        raise ValueError("algorithm.proximal: a multi-turn task needs recompute (π_old from a forward over the "
                         "conversation), not loglinear")


def padded(rows: list[list], value, dtype: torch.dtype, width: int) -> Tensor:
    """Rows right-padded with ``value`` to ``[B, width]``."""
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out


def multi_turn_rollout(state: TrainState, seed: int, *, sync_weights: bool = True,
                       step: int | None = None) -> MultiTurnRollout:
    """Step 1–2 of the module docstring: sync (and check) the engine's weights, run the turns, reward the final turn,
    build the trainer's view of every conversation in ``task.multi_turn_ids`` mode."""
    t0 = time.perf_counter()
    cfg, a = state.cfg, state.cfg.algorithm
    mode = multi_turn_ids(cfg)
    prompts = step_prompts(state.task, state.tokenizer, cfg.task.prompts_per_step, seed)
    rows = [TurnPrompt(p.example.prompt, list(p.ids), dict(p.example.meta)) for p in prompts for _ in range(a.group_size)]
    check, sync_metrics = state.sync_check, {}
    if sync_weights:  # as rollout_step: the engine takes the trainer's weights, and the sync is checked
        state.engine.sync_weights(state.model)
        state.engine_version = state.policy_version
        if check is not None and check.baseline is not None:
            sync_metrics = check.after_sync(state.engine, state.model,
                                            what=f"step {'?' if step is None else step + 1}'s weight sync")
    conversations, first = run_turns(state.engine, state.tokenizer, state.task, rows, state.sampling, seed=seed)
    if check is not None and check.baseline is None:
        sync_metrics = check.calibrate(state.engine, state.model,
                                       SyncProbe.from_rollout(first.prompt_ids, first.completion_ids))
    seconds = time.perf_counter() - t0
    return rollout_of(state, prompts, conversations, mode, seconds=seconds, sync_metrics=sync_metrics)


def rollout_of(state: TrainState, prompts: list, conversations: list[Conversation], mode: str, *,
               seconds: float = 0.0, sync_metrics: dict[str, float] | None = None) -> MultiTurnRollout:
    """The trainer's :class:`MultiTurnRollout` of sampled ``conversations`` (``group_size`` rows per prompt) in id
    ``mode``: rewards on the final turn, advantages, the views and their masks. The same conversations in both modes
    measure the drift against the fix on identical samples (scripts/multi_turn_drift.py)."""
    a = state.cfg.algorithm
    final = [list(c.segments[-1].ids) for c in conversations]
    rewards = compute_rewards(state.task, prompts, a.group_size, [c.texts[-1] for c in conversations], final)
    views = [trainer_view(c, mode, state.tokenizer) for c in conversations]
    width = max(len(v.completion_ids) for v in views)
    if width == 0:
        raise ValueError("the multi-turn rollout produced no completion token in any row")
    rollout_logp = padded([v.rollout_logp for v in views], 0.0, torch.float32, width)
    completions = [v.completion_ids for v in views]
    return MultiTurnRollout(
        prompts, [v.prompt_ids for v in views], completions, rollout_logp, rewards,
        state.advantage_fn(rewards, a.group_size), None, seconds, sync_metrics=dict(sync_metrics or {}),
        versions=token_versions(completions, rollout_logp, state.engine_version),
        conversations=conversations, views=views,
        loss_mask=padded([v.loss for v in views], False, torch.bool, width),
        turn=padded([v.turn for v in views], -1, torch.long, width),
        first=padded([v.first for v in views], False, torch.bool, width),
    )


def mask_scored(scored: Scored, rollout: MultiTurnRollout) -> Scored:
    """π_old's view with the loss mask applied: only policy tokens with an engine log-prob stay valid; μ is 0
    elsewhere. The update's batches take ``scored.mask``, so this is also the loss's mask."""
    assert rollout.loss_mask is not None
    loss = rollout.loss_mask.to(scored.mask.device)[:, : scored.mask.shape[1]]
    scored.mask = scored.mask & loss
    scored.rollout_logp = torch.where(scored.mask, scored.rollout_logp, torch.zeros_like(scored.rollout_logp))
    return scored


def multi_turn_metrics(state: TrainState, rollout: MultiTurnRollout, scored: Scored) -> dict[str, Tensor]:
    """Step 4 of the module docstring: drift (the trainer's ids and re-tokenized ids against the engine's) and the
    per-turn mismatch between π_old and μ."""
    assert rollout.turn is not None and rollout.first is not None
    out: dict[str, Tensor] = {}
    out.update(view_drift(rollout.conversations, rollout.views).metrics("multi_turn/drift"))
    out.update(retokenization_drift(rollout.conversations, state.tokenizer).metrics("multi_turn/retokenize_drift"))
    t = scored.mask.shape[1]
    turn = torch.where(scored.mask, rollout.turn.to(scored.mask.device)[:, :t], -1)
    n_turns = int(state.task.turns)
    out.update(turn_metrics(turn_mismatch(scored.old_logp, scored.rollout_logp, turn,
                                          rollout.first.to(scored.mask.device)[:, :t], n_turns)))
    tool = [sum(1 for k in v.segment if k > 0 and c.segments[k].role == "tool")
            for c, v in zip(rollout.conversations, rollout.views)]
    out["multi_turn/tool_tokens"] = torch.tensor(tool, dtype=torch.float32).mean()
    out["multi_turn/unaligned_tokens"] = torch.tensor([v.unaligned for v in rollout.views], dtype=torch.float32).mean()
    return out


def multi_turn_step(state: TrainState, seed: int, *, sync_weights: bool = True,
                    step: int | None = None) -> tuple[MultiTurnRollout, Scored, dict[str, Tensor]]:
    """The multi-turn step's rollout, scoring and turn metrics (the module docstring's steps 1–4); the update and
    the step's other metrics are the single-turn step's own."""
    check_multi_turn(state)
    rollout = multi_turn_rollout(state, seed, sync_weights=sync_weights, step=step)
    scored = mask_scored(score_step(state, rollout), rollout)
    return rollout, scored, multi_turn_metrics(state, rollout, scored)


__all__ = ["MultiTurnRollout", "check_multi_turn", "mask_scored", "multi_turn_ids", "multi_turn_metrics",
           "multi_turn_rollout", "multi_turn_step", "rollout_of"]
