"""The trainer's state and its four steps — rollout, scoring, update, metrics — each a function of the state.

:func:`build_state` builds everything from the config (before any rollout, so errors surface first). The steps read
the state and return plain records; only :func:`update_step` changes it (the weights, the optimizer). Between steps a
caller — :func:`offpolicy.train.loop.train`'s ``on_step_end``, or a loop of one's own — may change the state:
:meth:`TrainState.set_corrections` rebuilds the correction chain from specs with new parameters,
:meth:`TrainState.set_lr` sets the policy's learning rate.

The rollout and scoring steps and the metrics are here; the update is :mod:`offpolicy.train.update`, the trainer's
log-prob forwards :mod:`offpolicy.train.scoring`, and what is built from the config (model, engine, sampling)
:mod:`offpolicy.train.build`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import Correction, CorrectionResult, drop_metrics
from offpolicy.metrics import NAMINGS, metrics_by_staleness, offpolicy_metrics
from offpolicy.perturbation import LayerwisePerturbation
from offpolicy.position import position_metrics
from offpolicy.ratios import masked_mean
from offpolicy.registry import build_correction
from offpolicy.rollout.prompts import Prompt, compute_rewards, step_prompts
from offpolicy.rollout.routing import RouteRecorder, flip_rate_metrics, replay_routes
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.sync_check import SyncCheck, SyncProbe
from offpolicy.tasks import is_multi_turn
from offpolicy.train.async_rollout import (
    WeightHistory,
    check_async,
    partial_generate,
    queue_generate,
    staleness_metrics,
)
from offpolicy.train.build import (
    DTYPES,
    advantage_fn,
    build_run_engine,
    load_model,
    nonfinite_fields,
    sampling_config,
)
from offpolicy.train.config import TrainConfig, objective_call
from offpolicy.train.data import load_task
from offpolicy.train.presets import PRESETS, Preset, chain_specs
from offpolicy.train.proximal import proximal_method, token_versions, unscored_mask
from offpolicy.train.scoring import exact_token_kl, score_policy

# What the trainer builds from the config, its scoring forward and its update live in offpolicy.train.build, .scoring
# and .update.
__all__ = ["Rollout", "Scored", "TrainState", "build_state", "kl_metric_name", "metrics_step", "rollout_step",
           "score_step", "single_pass"]


# -- the state -------------------------------------------------------------------------------------------------------


@dataclass
class TrainState:
    """What the steps read and update. ``correction_specs`` is the correction chain as data (registered names and
    parameters); ``correction`` the chain built from it. ``last_rollout`` / ``last_scored`` are the last completed
    step's tensors (μ, π_old, the mask, rewards) for a per-step controller that needs more than the metrics."""

    cfg: TrainConfig
    model: torch.nn.Module
    tokenizer: Any
    task: Any
    engine: Any
    sampling: SamplingConfig
    optimizer: torch.optim.Optimizer
    alp: LayerwisePerturbation | None
    correction_specs: list[dict[str, Any]]
    correction: Correction | None
    objective: str
    objective_params: dict[str, Any]
    advantage_fn: Callable[[Tensor, int], Tensor]
    last_rollout: Rollout | None = None
    last_scored: Scored | None = None
    control: Any = None  # the closed-loop controllers (offpolicy.train.control.Control) when cfg.control asks
    sync_check: SyncCheck | None = None  # every weight sync verified (rollout.sync_check)
    policy_version: int = 0  # v_θ: the steps completed (offpolicy.train.proximal)
    engine_version: int = 0  # the trainer's version at the engine's last weight sync
    weight_history: Any = None  # rollout.async_mode: the last versions' weights (offpolicy.train.async_rollout)

    @property
    def preset(self) -> Preset:
        return PRESETS[self.cfg.algorithm.preset]

    def set_corrections(self, specs: list[Any]) -> None:
        """Rebuild the correction chain from specs (``[{"name": "trm", "max_kl": 0.02}, ...]``): the whole chain, as
        :attr:`correction_specs` holds it. Unknown names or parameters raise before anything changes."""
        correction = build_correction(list(specs))
        self.correction_specs = [dict(s) if isinstance(s, dict) else {"name": s} for s in specs]
        self.correction = correction

    @property
    def lr(self) -> float:
        """The policy's learning rate (the first parameter group; ALP's σ has its own)."""
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
        self.optimizer.param_groups[0]["lr"] = float(lr)


def build_state(cfg: TrainConfig, *, model: torch.nn.Module | None = None, tokenizer: Any = None, engine: Any = None,
                task: Any = None) -> TrainState:
    """Everything a run needs, from the config; ``model`` / ``tokenizer`` / ``engine`` / ``task`` replace what the
    config would build (tests, notebooks)."""
    if model is None:
        model, tokenizer = load_model(cfg)
    if tokenizer is None:
        raise ValueError("tokenizer: pass one together with model=")
    engine = engine if engine is not None else build_run_engine(cfg, model, tokenizer)
    if cfg.rollout.sync_every > 1 and not isinstance(getattr(engine, "model", None), torch.nn.Module):
        raise ValueError("rollout.sync_every > 1 needs an engine whose weights are a module at engine.model "
                         "(they are saved in checkpoints)")
    task = task if task is not None else load_task(cfg.task)
    check_async(cfg, engine)
    if cfg.rollout.async_mode != "none" and is_multi_turn(task):
        raise ValueError(f"rollout.async_mode={cfg.rollout.async_mode} is single-turn only; the task is multi-turn")
    alp = None
    if cfg.alp.enabled:
        layers = cfg.alp.layers if isinstance(cfg.alp.layers, str) else list(cfg.alp.layers)
        alp = LayerwisePerturbation(model, layers=layers, init_std=cfg.alp.init_std, layers_path=cfg.model.layers_path,
                                    seed=cfg.run.seed).to(cfg.run.device)
    groups = [{"params": [p for p in model.parameters() if p.requires_grad], "lr": cfg.optim.lr,
               "weight_decay": cfg.optim.weight_decay}]
    if alp is not None:
        groups.append(alp.param_group(lr=cfg.alp.lr))
    specs = chain_specs(PRESETS[cfg.algorithm.preset], cfg.algorithm)
    objective, objective_params = objective_call(cfg)
    action = cfg.rollout.sync_check_action
    can_score = callable(getattr(engine, "score", None)) and getattr(engine, "scores_tokens", True)
    if cfg.rollout.sync_check == "auto" and not can_score:
        action = "off"  # llama.cpp's protocol has no teacher-forced scoring; its sync is an export and a restart
    sync_check = None
    if action != "off" and cfg.rollout.async_mode != "none":  # each call syncs an older version on purpose
        raise ValueError(f"rollout.sync_check={cfg.rollout.sync_check!r}: rollout.async_mode={cfg.rollout.async_mode} "
                         "syncs old weight versions on purpose; set rollout.sync_check=off")
    if action != "off":
        if not can_score:
            raise ValueError(f"rollout.sync_check={cfg.rollout.sync_check!r}: the engine {type(engine).__name__} cannot "
                             "score given tokens (no score()), so its syncs cannot be checked; set rollout.sync_check=off")
        sync_check = SyncCheck(z=cfg.rollout.sync_check_z, max_baseline=cfg.rollout.sync_check_max_baseline,
                               on_failure=action, parameters=cfg.rollout.sync_check_parameters)
    # an asynchronous rollout's weight history, built here so that a resumed run's checkpoint can fill it
    history = (WeightHistory(model, keep=cfg.rollout.max_staleness + 1) if cfg.rollout.async_mode != "none" else None)
    return TrainState(
        cfg=cfg, model=model, tokenizer=tokenizer, task=task, weight_history=history,
        engine=engine, sampling=sampling_config(cfg),
        optimizer=torch.optim.AdamW(groups, betas=cfg.optim.betas), alp=alp, correction_specs=specs,
        correction=build_correction(specs), objective=objective, objective_params=objective_params,
        advantage_fn=advantage_fn(cfg.algorithm.advantage), sync_check=sync_check,
    )


# -- 1. rollout --------------------------------------------------------------------------------------------------------


@dataclass
class Rollout:
    """One step's samples: ``group_size`` completions per prompt (prompt-major), μ's log-probs, rewards, advantages."""

    prompts: list[Prompt]
    prompt_ids: list[list[int]]
    completions: list[list[int]]
    rollout_logp: Tensor
    rewards: Tensor
    advantages: Tensor
    routed_experts: Any
    seconds: float
    topk_ids: Tensor | None = None  # [B, T, K] the engine's top-K ids / processed log-probs (sampling.logprobs_topk)
    topk_logp: Tensor | None = None
    sync_metrics: dict[str, float] = field(default_factory=dict)  # sync/* of this step's weight sync check
    versions: Tensor | None = None  # [B, T] int64: the engine's weights version per sampled token, −1 on padding
    staleness: dict[str, Any] = field(default_factory=dict)  # staleness/* of the step (offpolicy.train.async_rollout)
    trainer_version: int | None = None  # v_θ when sampled: a token's staleness is this − its version


def rollout_step(state: TrainState, seed: int, *, sync_weights: bool = True, step: int | None = None) -> Rollout:
    """Sample with the inference engine's numerics, score with the task's verifier (a reward that raises or is NaN
    stops the run naming the sample), and turn the rewards into advantages over each group. ``sync_weights=False``:
    the engine keeps the weights of its last sync (``rollout.sync_every > 1``, as an asynchronous rollout pipeline
    samples with a policy some updates old — off-policy data the corrections see). With ``state.sync_check``, the
    first rollout's first rows become the probe and every later sync is checked against it (``step`` names it)."""
    t0 = time.perf_counter()
    a = state.cfg.algorithm
    prompts = step_prompts(state.task, state.tokenizer, state.cfg.task.prompts_per_step, seed)
    prompt_ids = [p.ids for p in prompts for _ in range(a.group_size)]
    if state.cfg.rollout.async_mode != "none":
        return _async_rollout(state, prompts, prompt_ids, seed, t0)
    check, sync_metrics = state.sync_check, {}
    if sync_weights:
        state.engine.sync_weights(state.model)
        state.engine_version = state.policy_version
        if check is not None and check.baseline is not None:
            sync_metrics = check.after_sync(state.engine, state.model, what=f"step {'?' if step is None else step + 1}'s weight sync")
    out = state.engine.generate(prompt_ids, state.sampling, seed=seed)
    if check is not None and check.baseline is None:  # the first rollout: same weights on both sides, no update yet
        sync_metrics = check.calibrate(state.engine, state.model,
                                       SyncProbe.from_rollout(out.prompt_ids, out.completion_ids))
    seconds = time.perf_counter() - t0
    rewards = compute_rewards(state.task, prompts, a.group_size, out.texts, out.completion_ids)
    versions = token_versions(out.completion_ids, out.logp, state.engine_version)
    return Rollout(prompts, prompt_ids, out.completion_ids, out.logp, rewards, state.advantage_fn(rewards, a.group_size),
                   getattr(out, "routed_experts", None), seconds, topk_ids=getattr(out, "topk_ids", None),
                   topk_logp=getattr(out, "topk_logp", None), sync_metrics=sync_metrics, versions=versions,
                   staleness=staleness_metrics(versions, state.policy_version), trainer_version=state.policy_version)


def _async_rollout(state: TrainState, prompts: list[Prompt], prompt_ids: list[list[int]], seed: int,
                   t0: float) -> Rollout:
    """``rollout.async_mode``'s rollout: a queue of groups up to ``max_staleness`` versions old, or answers whose
    weights switch mid-answer (:mod:`offpolicy.train.async_rollout`); per-token versions on the rollout."""
    a = state.cfg.algorithm
    if state.cfg.rollout.async_mode == "queue":
        gen = queue_generate(state, prompt_ids, a.group_size, seed)
    else:
        gen = partial_generate(state, prompt_ids, seed)
    seconds = time.perf_counter() - t0
    rewards = compute_rewards(state.task, prompts, a.group_size, gen.texts, gen.completions)
    staleness = {**staleness_metrics(gen.versions, state.policy_version), "staleness/dropped": float(gen.dropped)}
    return Rollout(prompts, prompt_ids, gen.completions, gen.logp, rewards, state.advantage_fn(rewards, a.group_size),
                   None, seconds, versions=gen.versions, staleness=staleness, trainer_version=state.policy_version)


# -- 2. scoring --------------------------------------------------------------------------------------------------------


@dataclass
class Scored:
    """π_old's view of the rollout: log-probs ``[B, T]``, the response mask, μ aligned to it, TRM's exact token KL
    (when the engine can re-score with full logits), DVP's extras, the routes the updates replay (MoE)."""

    old_logp: Tensor
    mask: Tensor
    rollout_logp: Tensor
    token_divergence: Tensor | None
    extras: dict[str, Tensor]
    theta_routes: Any
    flip_rate: float | None
    sampler_logits: Tensor | None = None  # the engine's raw logits [B, T, V] (score centering's q)
    sampler_head: tuple[Tensor, Tensor] | None = None  # else q's head from the rollout: ids, log q [B, T, K]
    # single pass (:func:`single_pass`): π_θ's log-probs ``[B, T]`` and DVP extras *with* their autograd graph — the
    # same forward as π_old's, which the update uses instead of a second one; dropped once the update has used it
    theta: tuple[Tensor, dict[str, Tensor]] | None = None
    # MoE: flipped and routed (position, layer) counts of each MoE layer (the per-layer ``routing/flip_rate/layer{i}``)
    flip_counts: tuple[list[int], list[int]] | None = None


def single_pass(state: TrainState) -> bool:
    """Whether the update is one optimiser step over the whole batch from π_old's weights (``optim.minibatches`` =
    ``optim.epochs`` = 1), without ALP noise or routing replay: then π_θ's forward is π_old's forward, so the
    scoring keeps its graph and the update reuses it instead of running the same forward again (as TRL's
    ``GRPOTrainer`` and verl do when generation and optimisation are aligned). Score centering needs the update's
    own logits, which the scoring forward does not keep, so it always runs the second forward."""
    cfg = state.cfg
    return (cfg.optim.minibatches == 1 and cfg.optim.epochs == 1 and state.alp is None
            and cfg.rollout.routing_replay == "none" and state.preset.score_centering is None)


def score_step(state: TrainState, rollout: Rollout) -> Scored:
    """π_old: one full forward of the trainer, ALP noise off — this is what μ is compared with. No grad, except in a
    single pass (:func:`single_pass`), where the update reuses this forward as π_θ's.

    Routing replay (mixture-of-experts, ``rollout.routing_replay``): ``r3`` routes π_old as the engine did, ``r2``
    records π_old's own routes for the π_θ forwards. Without replay, routes the engine recorded are only compared
    with π_old's (the flip rate, nothing replayed).
    """
    cfg = state.cfg
    mode = cfg.rollout.routing_replay
    if proximal_method(state.objective_params) == "loglinear":  # π_prox from versions in the loss: no forward here;
        mask = unscored_mask(rollout.completions, rollout.rollout_logp, rollout.versions)  # π_old is filled in by the
        mu = rollout.rollout_logp.to(mask.device)  # update with the approximation each row's loss read
        return Scored(mu.clone(), mask, mu, None, {}, rollout.routed_experts if mode == "r3" else None, None)
    # r2 (and no replay) measure how often π_old's routes differ from the engine's where the engine's were recorded
    # (a multi-turn rollout records none across its turns: no flip rate there)
    routing = (replay_routes(state.model, rollout.routed_experts, mode="replay" if mode == "r3" else "compare")
               if mode == "r3" or rollout.routed_experts is not None else None)
    recorder = RouteRecorder(state.model, batch_size=len(rollout.prompt_ids)) if mode == "r2" else None
    reuse = single_pass(state)
    with torch.set_grad_enabled(reuse), routing or contextlib.nullcontext(), recorder or contextlib.nullcontext():
        old_logp, mask, old_logits, extras = score_policy(
            state.model, rollout.prompt_ids, rollout.completions, state.sampling, dtype=DTYPES[cfg.model.dtype],
            dvp_rho=cfg.algorithm.dvp_rho if state.preset.minp else None, return_logits=state.preset.divergence)
    theta = (old_logp, extras) if reuse else None
    old_logp, extras = old_logp.detach(), {k: v.detach() for k, v in extras.items()}
    old_logits = old_logits.detach() if old_logits is not None else None
    theta_routes = {"none": None, "r3": rollout.routed_experts}.get(mode)
    if recorder is not None:
        theta_routes = recorder.pop_rows([len(p) + len(c) - 1 for p, c in zip(rollout.prompt_ids, rollout.completions)])
    token_divergence = roll_logits = None
    if ((state.preset.divergence or state.preset.score_centering) and hasattr(state.engine, "score")
            and getattr(state.engine, "full_logits", True)):
        # TRM's exact KL(μ‖π_old) and score centering's q need the rollout engine's full logits: re-score with its
        # numerics (and its weights: a lagging engine's q is the stale policy's)
        roll_logits = state.engine.score(rollout.prompt_ids, rollout.completions, state.sampling,
                                         return_logits=True)[2].to(old_logp.device)
    if state.preset.divergence and roll_logits is not None:
        assert old_logits is not None  # return_logits=state.preset.divergence
        token_divergence = exact_token_kl(roll_logits, old_logits, state.sampling)
    head = None
    if state.preset.score_centering and roll_logits is None:
        if state.preset.score_centering != "topk" or rollout.topk_ids is None or rollout.topk_logp is None:
            raise ValueError(f"algorithm.preset={state.cfg.algorithm.preset!r} needs the sampler's logits: the engine "
                             f"{type(state.engine).__name__} has no score(..., return_logits=True) (score_centering_topk "
                             "centres on the top-K log-probs a server engine reports)")
        # a server engine: q's head is the sampling decode's own top-K (processed: tempered, as the centring expects)
        head = (rollout.topk_ids.to(old_logp.device), rollout.topk_logp.to(old_logp.device))
    return Scored(old_logp, mask, rollout.rollout_logp.to(old_logp.device), token_divergence, extras, theta_routes,
                  routing.flip_rate if routing is not None else None,
                  roll_logits if state.preset.score_centering else None, theta=theta, sampler_head=head,
                  flip_counts=(routing.flips_per_layer, routing.routed_per_layer) if routing is not None else None)


# -- 4. metrics --------------------------------------------------------------------------------------------------------


def metrics_step(state: TrainState, rollout: Rollout, scored: Scored, updates: list[dict[str, Tensor]], *,
                 started: float) -> dict[str, Tensor | float]:
    """The step's metrics (tensors, synced once by the caller): the mismatch diagnostics between π_old and μ under
    ``run.metric_naming`` (with the correction chain's result at π_old), the minibatches' mean loss metrics
    (which include each correction's own), rewards, response length, TRM's exact KL, the mismatch per position bin
    (``mismatch/by_position/…``, :func:`offpolicy.position.position_metrics`), the whole correction's
    :func:`~offpolicy.corrections.base.drop_metrics` under ``correction/``, ALP's σ, MoE
    routing flips and timings."""
    naming = state.cfg.run.metric_naming
    mask = scored.mask
    at_old = LogProbBatch(logp=scored.old_logp, mask=mask, old_logp=scored.old_logp, rollout_logp=scored.rollout_logp,
                          advantages=rollout.advantages, token_divergence=scored.token_divergence,
                          extras=scored.extras, **nonfinite_fields(state.cfg))
    corrected = state.correction(at_old) if state.correction is not None else None
    metrics: dict[str, Tensor | float] = dict(
        offpolicy_metrics(scored.old_logp, scored.rollout_logp, mask, corrected, naming=naming))
    if scored.flip_counts is not None:  # the engine's routes that π_old's own router would change, per MoE layer
        metrics.update(flip_rate_metrics(*scored.flip_counts))
    elif scored.flip_rate is not None:
        metrics["routing/flip_rate"] = scored.flip_rate
    for name in updates[0]:
        metrics[name] = torch.stack([u[name].float() for u in updates]).mean()
    metrics["optim/lr"] = state.lr
    metrics["reward/mean"] = rollout.rewards.mean()
    metrics["reward/std"] = rollout.rewards.std(unbiased=False)
    metrics["reward/max"] = rollout.rewards.max()
    metrics["response/length_mean"] = mask.float().sum(-1).mean()
    metrics["mismatch/token_kl_exact_mean"] = (masked_mean(scored.token_divergence, mask)
                                              if scored.token_divergence is not None else torch.tensor(float("nan")))
    # the same mismatch per position bin of the response: does it grow with depth? (exact KL where TRM computed it)
    metrics.update(position_metrics(scored.old_logp, scored.rollout_logp, mask, token_kl=scored.token_divergence))
    # the whole correction in every correction's vocabulary (correction/kept_frac, /masked_frac, /capped_frac, …)
    metrics.update(drop_metrics("correction", corrected if corrected is not None else CorrectionResult.identity(at_old),
                                mask))
    if state.alp is not None:
        metrics.update(state.alp.metrics())
    step_seconds = time.perf_counter() - started
    metrics["time/step_s"] = step_seconds
    metrics["time/rollout_s"] = rollout.seconds
    metrics["time/tokens_per_s"] = float(mask.sum()) / max(step_seconds, 1e-9)
    metrics.update(rollout.sync_metrics)
    metrics.update(rollout.staleness)
    if rollout.versions is not None and rollout.trainer_version is not None:
        metrics.update(_by_staleness(rollout, scored, corrected))
    return metrics


def _by_staleness(rollout: Rollout, scored: Scored, corrected: Any) -> dict[str, Tensor]:
    """Per staleness d present, ``staleness/d<d>/k3_kl`` (π_old against μ), ``/clipped_frac`` and ``/masked_frac`` of
    the correction at π_old, ``/tokens`` — the split the TRL integration logs
    (:func:`offpolicy.metrics.metrics_by_staleness`)."""
    assert rollout.versions is not None and rollout.trainer_version is not None
    t = scored.mask.shape[1]
    versions = rollout.versions[:, :t].to(scored.mask.device)
    stale = torch.where(versions >= 0, rollout.trainer_version - versions, -1)
    out = metrics_by_staleness(stale, scored.old_logp, scored.rollout_logp, scored.mask, corrected)
    return {k: v for k, v in out.items() if k.startswith("staleness/d")}


def kl_metric_name(naming: str) -> str:
    """The key of the direct KL estimate under ``naming`` (the progress bar shows it)."""
    return NAMINGS[naming].key("kl")

