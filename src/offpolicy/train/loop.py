"""The GRPO training loop, top to bottom (cleanrl style: one function that reads as the algorithm).

One step (:mod:`offpolicy.train.steps`):

1. rollout — ``engine.sync_weights(model)`` (every ``rollout.sync_every`` steps: an asynchronous engine lags); the
   engine samples ``group_size`` completions per prompt with its own numerics (bf16 + KV cache by default) and
   reports μ = ``rollout_logp``; the task's verifier gives rewards (a reward that raises or is NaN stops the run and
   names the sample); GRPO / Dr.GRPO / RLOO advantages per group;
2. scoring — π_old: one full forward of the trainer, no grad, ALP noise off (this is what μ is compared with);
3. update — per minibatch: π_θ forward (ALP noise on if enabled) → :class:`~offpolicy.LogProbBatch` → the
   correction chain → :func:`~offpolicy.policy_loss` → backward → clip → optimiser step;
4. metrics — mismatch diagnostics (``rollout_correction/*`` by default; ``run.metric_naming``), correction, loss,
   reward, σ — synced once, written to JSONL / TensorBoard.

The run's folder (replace or resume, checkpoints at the configured cadence, at the end and on Ctrl-C) is
:mod:`offpolicy.train.run_folder`'s. What it simplifies: one process, one device, no reference-model KL penalty, no
entropy bonus, no sequence packing; prompts are drawn fresh each step from a seed (so resuming needs no data-loader
state); the minibatch schedule is a seeded permutation. Every source of randomness is derived from
``(run.seed, step)`` or saved in the checkpoint, so an interrupted and resumed run reproduces the uninterrupted one
exactly on CPU.
"""

from __future__ import annotations

import inspect
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from offpolicy.models.warm_start import torch_threads
from offpolicy.perturbation import LayerwisePerturbation
from offpolicy.tasks import is_multi_turn
from offpolicy.train.build import step_seed
from offpolicy.train.config import TrainConfig
from offpolicy.train.control import Control
from offpolicy.train.multi_turn import multi_turn_step
from offpolicy.train.proximal import resumed_versions
from offpolicy.train.run_folder import RunFolder
from offpolicy.train.schedule import is_scheduled, lr_at
from offpolicy.train.steps import (
    Rollout,
    TrainState,
    build_state,
    kl_metric_name,
    metrics_step,
    rollout_step,
    score_step,
)
from offpolicy.train.update import update_step

__all__ = ["TrainResult", "train"]


@dataclass
class TrainResult:
    """What :func:`train` hands back: per-step metrics (floats), where things went, and the live objects."""

    steps_done: int
    history: list[dict[str, float]]
    out_dir: Path
    checkpoint: Path | None
    interrupted: bool
    model: torch.nn.Module
    alp: LayerwisePerturbation | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    state: TrainState | None = None


def train(
    cfg: TrainConfig,
    *,
    resume: bool | str | Path = False,
    overwrite: bool = False,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    engine: Any = None,
    task: Any = None,
    console: Any = None,
    on_step_end: Callable[..., None] | None = None,
    allow_changed: tuple[str, ...] | list[str] = (),
) -> TrainResult:
    """Run ``cfg.run.steps`` GRPO steps (see the module docstring). ``resume=True`` continues from the latest
    checkpoint in ``out_dir/checkpoints`` (or from the given file). A folder that holds an earlier run is refused
    (``ValueError`` naming it and what it holds) unless ``overwrite=True``, which replaces that run. ``model`` /
    ``tokenizer`` / ``engine`` / ``task`` replace what the config would build (tests, notebooks). A resume whose
    recipe settings differ from the checkpoint's is refused unless ``allow_changed`` names them (``--allow-changed``;
    :class:`~offpolicy.train.run_folder.RunFolder`).

    ``on_step_end(step, metrics)`` — or ``on_step_end(step, metrics, state)`` — runs after each completed step with
    its metrics as floats; with the :class:`~offpolicy.train.steps.TrainState` it may change the next steps
    (``state.set_corrections(specs)``, ``state.set_lr(lr)``; with ``optim.schedule`` or warm-up the schedule sets the
    rate again at the start of every step). A ``KeyboardInterrupt`` raised there (or a Ctrl-C)
    checkpoints the completed step and stops cleanly.
    """
    folder = RunFolder(cfg, resume, overwrite, allow_changed)  # a bad out_dir or a checkpoint of another run fails before the model loads
    with folder, torch_threads(cfg.run.threads or torch.get_num_threads()):  # the folder is ours until the end
        random.seed(cfg.run.seed)
        torch.manual_seed(cfg.run.seed)
        state = build_state(cfg, model=model, tokenizer=tokenizer, engine=engine, task=task)
        state.control = Control.build(cfg, state)
        start = folder.open(state)
        # policy versions (offpolicy.train.proximal): the steps done, and the step of the engine's last weight sync
        state.policy_version, state.engine_version = resumed_versions(start, cfg.rollout.sync_every)
        history: list[dict[str, float]] = []
        if start == cfg.run.steps:  # a finished run resumed again: nothing to do, every file left as it is
            return TrainResult(start, history, folder.out_dir, folder.last_checkpoint, False, state.model, state.alp,
                               state=state)
        hook = _step_hook(on_step_end)
        with folder.session(state, start, console) as session:
            for step in range(start, cfg.run.steps):
                with session.step():
                    started = time.perf_counter()
                    seed = step_seed(cfg.run.seed, step)
                    if is_scheduled(cfg.optim):  # the schedule's rate, times the LR guard's cut if one is on
                        guard = state.control.lr_scale if state.control is not None else 1.0
                        state.set_lr(lr_at(cfg.optim, step, cfg.run.steps) * guard)
                    sync = step % cfg.rollout.sync_every == 0
                    rollout: Rollout
                    if is_multi_turn(state.task):  # one engine call per policy turn; tool tokens out of the loss
                        rollout, scored, turn_metrics = multi_turn_step(state, seed, sync_weights=sync, step=step)
                    else:
                        rollout, turn_metrics = rollout_step(state, seed, sync_weights=sync, step=step), {}
                        scored = score_step(state, rollout)
                    updates = update_step(state, rollout, scored, seed)
                    metrics = metrics_step(state, rollout, scored, updates, started=started)
                    metrics.update(turn_metrics)
                    if state.control is not None:  # the thresholds / LR this step used, then the next step's
                        metrics.update(state.control.metrics())
                        state.control.update(state, scored)
                state.last_rollout, state.last_scored = rollout, scored
                floats = session.record(metrics, kl_key=kl_metric_name(cfg.run.metric_naming))
                history.append(floats)
                hook(step + 1, floats, state)
                session.stop_if_requested()
    return TrainResult(session.steps_done, history, folder.out_dir, folder.last_checkpoint, session.interrupted,
                       state.model, state.alp, state=state)


def _step_hook(on_step_end: Callable[..., None] | None) -> Callable[[int, dict[str, float], TrainState], None]:
    """``on_step_end`` called with the state too when it takes three arguments."""
    if on_step_end is None:
        return lambda step, metrics, state: None
    try:
        inspect.signature(on_step_end).bind(0, {}, None)
    except TypeError:
        return lambda step, metrics, state: on_step_end(step, metrics)
    return on_step_end
