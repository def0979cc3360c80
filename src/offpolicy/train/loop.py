"""The GRPO training loop, top to bottom (nanochat / cleanrl style: one function, no trainer class).

One step:

1. rollout — ``engine.sync_weights(model)``; ``engine.generate`` samples ``group_size`` completions per prompt with
   the engine's own numerics (bf16 + KV cache by default) and reports μ = ``rollout_logp``;
2. rewards — the task's verifier, checked (a reward that raises or is NaN stops the run and names the sample);
3. advantages — GRPO / Dr.GRPO / RLOO over each group;
4. π_old — one fp32 full forward of the trainer, no grad, ALP noise off (this is what μ is compared with);
5. updates — per minibatch: π_θ forward (ALP noise on if enabled) → :class:`LogProbBatch` → the preset's
   correction chain → :func:`policy_loss` → backward → clip → optimiser step;
6. metrics — mismatch diagnostics (``rollout_correction/*``), correction, loss, reward, σ — synced once, written to
   JSONL/TensorBoard; checkpoints (atomic safetensors) at the configured cadence, at the end and on Ctrl-C.

What it simplifies: one process, one device, no reference-model KL penalty, no entropy bonus, no
sequence packing; prompts are drawn fresh each step from a seed (so resuming needs no data-loader state); the
minibatch schedule is a seeded permutation. Every source of randomness is derived from ``(run.seed, step)`` or saved
in the checkpoint, so an interrupted and resumed run reproduces the uninterrupted one exactly on CPU.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from offpolicy.batch import LogProbBatch
from offpolicy.losses import policy_loss
from offpolicy.metrics import offpolicy_metrics
from offpolicy.perturbation import LayerwisePerturbation, alp_policy_loss
from offpolicy.ratios import masked_mean
from offpolicy.rollout.sampling import SamplingConfig, process_logits
from offpolicy.rollout.routing import RouteRecorder, replay_routes
from offpolicy.rollout.scoring import sequence_logprobs
from offpolicy.train.checkpoint import (
    checkpoint_files,
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_info,
    save_checkpoint,
    temp_files,
)
from offpolicy.train.config import TrainConfig, config_to_yaml
from offpolicy.train.data import Prompt, compute_rewards, load_task, step_prompts
from offpolicy.train.logging import MetricLogger
from offpolicy.train.presets import PRESETS

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RunReplacedWarning(UserWarning):
    """A fresh run replaced an earlier run's files in its ``run.out_dir`` (the demo silences it: that is its job)."""


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


# -- set-up helpers (each small and replaceable) --------------------------------------------------------------------


def load_model(cfg: TrainConfig):  # -> (model, tokenizer)
    """``tiny`` / ``lab`` (embedded, warm-started, cached), ``tiny-random`` (random init from run.seed) or a local
    HF path.

    A local path is loaded with ``local_files_only=True``: offpolicy never downloads weights.
    """
    m = cfg.model
    if m.path == "tiny-random":
        from offpolicy.models.tiny import build_tiny_model

        model, tok = build_tiny_model(cfg.run.seed, **m.tiny_config)
    elif m.path in ("tiny", "lab"):
        from offpolicy.models import load_model as load_embedded, get_recipe

        model, tok = load_embedded(get_recipe(m.path).with_overrides(m.tiny_config), m.cache_dir)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = str(Path(m.path).expanduser())
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=_DTYPES[m.dtype])
    model = model.to(device=cfg.run.device, dtype=_DTYPES[m.dtype])
    model.eval()  # no dropout: the trainer's π must be a deterministic function of θ (and of σ·ε with ALP)
    return model, tok


def build_engine(cfg: TrainConfig, model: torch.nn.Module, tokenizer):  # -> HFRolloutEngine
    from offpolicy.rollout.hf import HFRolloutEngine

    r = cfg.rollout
    return HFRolloutEngine(
        model, dtype=r.dtype, kv_cache=r.kv_cache, kv_cache_bits=r.kv_cache_bits, weight_bits=r.weight_bits,
        logit_noise=r.logit_noise, tokenizer=tokenizer, record_routes=r.routing_replay != "none",
    )


def sampling_config(cfg: TrainConfig) -> SamplingConfig:
    """The engine's sampling config; DVP samples from (and scores with) the min-p safe set (seed 000 §5)."""
    s = cfg.rollout.sampling
    min_p = s.min_p if s.min_p > 0 else None
    if PRESETS[cfg.algorithm.preset].minp:
        # V_S = {a : π(a) ≥ ρ·max π}: exactly min-p with min_p = ρ, applied by the engine to its logits (μ^mp over
        # V'_S) and by the trainer to its logits (π^mp over V_S) — both policies constrained, as in the paper.
        min_p = max(min_p or 0.0, cfg.algorithm.dvp_rho)
    return SamplingConfig(
        max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k or None,
        top_p=s.top_p if s.top_p < 1.0 else None, min_p=min_p,
    )


def advantage_fn(name: str) -> Callable[[Tensor, int], Tensor]:
    from offpolicy import advantages

    return {"grpo": advantages.grpo_advantages, "dr_grpo": advantages.dr_grpo_advantages,
            "rloo": advantages.rloo_advantages}[name]


def exact_token_kl(rollout_logits: Tensor, train_logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """KL(μ‖π) per token ``[B, T]`` from two raw logit tensors ``[B, T, V]``, both at ``sampling``'s temperature.

    Why temperature only, not top-k / top-p / min-p: truncating the two logit sets separately cuts them at different
    tokens (a bf16 tie at the k-th logit, a shifted top-p crossing), and a token one keeps and the other drops makes
    the KL +inf — TRM then rejected nearly every sequence as soon as top-k or top-p was set. The KL between the two
    models' full tempered distributions is finite and is what the TRM paper measures from logits.
    """
    full = replace(sampling, top_k=None, top_p=None, min_p=None)
    lmu = process_logits(rollout_logits, full)
    lpi = process_logits(train_logits, full)
    pmu = lmu.exp()
    terms = torch.where(pmu > 0, pmu * (lmu - lpi), torch.zeros_like(pmu))
    return terms.sum(-1).clamp(min=0.0)  # KL ≥ 0; float32 rounding can leave −1e-9


def score_policy(model: torch.nn.Module, prompt_ids: list[list[int]], completions: list[list[int]],
                 sampling: SamplingConfig, *, dtype: torch.dtype, dvp_rho: float | None = None,
                 return_logits: bool = False) -> tuple[Tensor, Tensor, Tensor | None, dict[str, Tensor]]:
    """The trainer's log-probs ``[B, T]`` of the sampled tokens: ``(logp, mask, raw logits | None, extras)``.

    Plain: processed exactly like the engine (temperature, top-k/p, min-p). DVP (``dvp_rho``): min-p constrained
    log π^mp over the trainer's own safe set V_S (:func:`offpolicy.corrections.vocabulary.dvp_fields`), with
    ``extras["dvp_keep"]`` (sampled token inside V_S, else ratio 0) and ``extras["dvp_mass"]`` (retained mass Z).
    """
    if dvp_rho is None:
        out = sequence_logprobs(model, prompt_ids, completions, sampling, dtype=dtype, return_logits=return_logits)
        return out[0], out[1], (out[2] if return_logits else None), {}
    from offpolicy.corrections.vocabulary import dvp_fields
    from offpolicy.rollout.base import pad_ids

    plain = replace(sampling, min_p=None)  # the safe set replaces min-p; pruned logits get −50, not −inf
    _, mask, logits = sequence_logprobs(model, prompt_ids, completions, plain, dtype=dtype, return_logits=True)
    targets = pad_ids(completions, 0, side="right")[0].to(logits.device)[:, : mask.shape[1]]
    fields = dvp_fields(logits, targets, mask, rho=dvp_rho, temperature=sampling.temperature)
    extras = {k: v for k, v in fields["extras"].items()}  # type: ignore[union-attr]
    return fields["logp"], mask, (logits if return_logits else None), extras  # type: ignore[return-value]


def _step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7919 + 17) % (2**62)


class _DeferredInterrupt:
    """First Ctrl-C: finish the current step, checkpoint, stop. Second Ctrl-C: stop now (KeyboardInterrupt)."""

    def __init__(self, console: Any | None) -> None:
        self.requested = False
        self.console = console
        self._old: Any = None

    def __enter__(self) -> "_DeferredInterrupt":
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if self.console is not None:
            self.console.print("[yellow]Ctrl-C: finishing this step, saving a checkpoint, then stopping "
                               "(press again to stop at once)[/yellow]")

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


# -- the loop --------------------------------------------------------------------------------------------------------


def train(
    cfg: TrainConfig,
    *,
    resume: bool | str | Path = False,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    engine: Any = None,
    task: Any = None,
    console: Any = None,
    on_step_end: Callable[[int, dict[str, float]], None] | None = None,
) -> TrainResult:
    """Run ``cfg.run.steps`` GRPO steps (see the module docstring). ``resume=True`` continues from the latest
    checkpoint in ``out_dir/checkpoints`` (or from the given file). ``model``/``tokenizer``/``engine``/``task`` replace
    what the config would build (tests, notebooks). ``on_step_end(step, metrics)`` runs after each completed step; a
    ``KeyboardInterrupt`` raised there (or a Ctrl-C) checkpoints the completed step and stops cleanly.
    """
    a, run = cfg.algorithm, cfg.run
    preset = PRESETS[a.preset]
    out_dir = Path(run.out_dir)
    ckpt_dir = out_dir / "checkpoints"
    # both checked before the model loads: a bad out_dir or a checkpoint of another run fails at once
    resume_from = _resume_checkpoint(cfg, resume, ckpt_dir) if resume else None
    _writable_dir(out_dir)
    threads_before = torch.get_num_threads()
    if run.threads is not None:
        torch.set_num_threads(run.threads)
    random.seed(run.seed)
    torch.manual_seed(run.seed)

    # ---- build everything (before any rollout: errors surface here) ----
    if model is None:
        model, tokenizer = load_model(cfg)
    if tokenizer is None:
        raise ValueError("tokenizer: pass one together with model=")
    task = task if task is not None else load_task(cfg.task)
    sampling = sampling_config(cfg)
    engine = engine if engine is not None else build_engine(cfg, model, tokenizer)
    correction = preset.correction(a)
    dvp_rho = a.dvp_rho if preset.minp else None
    if preset.minp:
        from offpolicy.corrections.base import chain
        from offpolicy.corrections.vocabulary import dvp_keep

        # a sampled token outside the trainer's safe set has DVP ratio 0: dropped from the numerator
        correction = dvp_keep() if correction is None else chain(dvp_keep(), correction)
    adv_fn = advantage_fn(a.advantage)
    alp = None
    if cfg.alp.enabled:
        layers = cfg.alp.layers if isinstance(cfg.alp.layers, str) else list(cfg.alp.layers)
        alp = LayerwisePerturbation(model, layers=layers, init_std=cfg.alp.init_std, layers_path=cfg.model.layers_path,
                                    seed=run.seed)
        alp.to(run.device)
    groups = [{"params": [p for p in model.parameters() if p.requires_grad], "lr": cfg.optim.lr,
               "weight_decay": cfg.optim.weight_decay}]
    if alp is not None:
        groups.append(alp.param_group(lr=cfg.alp.lr))
    optimizer = torch.optim.AdamW(groups, betas=cfg.optim.betas)
    clip_low = a.clip_low if a.clip_low is not None else 0.2
    clip_high = a.clip_high if a.clip_high is not None else 0.28
    objective = a.objective or preset.objective
    dual_clip = a.dual_clip if a.dual_clip is not None else preset.dual_clip
    train_dtype = _DTYPES[cfg.model.dtype]

    # what a checkpoint holds besides the model and optimizer: ALP's σ, and the engine's own (lagging) weights when
    # rollout.sync_every > 1, so that a resumed run samples from the same stale policy as the uninterrupted one
    saved_modules = {"alp": alp} if alp is not None else {}
    if cfg.rollout.sync_every > 1:
        if not isinstance(getattr(engine, "model", None), torch.nn.Module):
            raise ValueError("rollout.sync_every > 1 needs an engine whose weights are a module at engine.model "
                             "(they are saved in checkpoints)")
        saved_modules["engine"] = engine.model
    start = 0
    if resume_from is not None:
        start = load_checkpoint(resume_from, model=model, optimizer=optimizer,
                                extra_modules=saved_modules or None)["step"]
        if start == run.steps:  # a finished run resumed again (e.g. a retry script): leave every file as it is
            warnings.warn(f"--resume: checkpoint {str(resume_from)!r} is already at run.steps={run.steps}; nothing "
                          "to do (raise run.steps to train further)", stacklevel=2)
            torch.set_num_threads(threads_before)
            return TrainResult(start, [], out_dir, resume_from, False, model, alp)
        for leftover in temp_files(ckpt_dir):  # half-written saves of the interrupted run: never usable
            leftover.unlink(missing_ok=True)
    else:
        # a fresh run replaces an earlier run in out_dir as a whole; otherwise a later --resume would continue the
        # earlier run's checkpoint under this run's config and metrics
        _clear_earlier_run(out_dir, ckpt_dir)
    (out_dir / "config.yaml").write_text(config_to_yaml(cfg))
    logger = MetricLogger(out_dir, tensorboard=run.tensorboard)
    if resume_from is not None:
        logger.truncate_after(start)  # the steps after the checkpoint are rewritten by this run
    else:
        logger.reset()

    def checkpoint(step: int) -> Path:
        return save_checkpoint(ckpt_dir, step=step, model=model, optimizer=optimizer,
                               extra_modules=saved_modules or None,
                               metadata={"preset": a.preset, "seed": run.seed}, keep_last=3)

    history: list[dict[str, float]] = []
    last_ckpt: Path | None = None
    interrupted = False
    progress = _progress(console, run.progress)
    task_id = progress.add_task(f"{a.preset}", total=run.steps, completed=start) if progress else None
    step = start
    in_step = False
    try:
        with _DeferredInterrupt(console) as stop, (progress or contextlib.nullcontext()):
            while step < run.steps:
                in_step = True
                t0 = time.perf_counter()
                seed = _step_seed(run.seed, step)

                # 1. rollout with the inference engine's numerics
                prompts: list[Prompt] = step_prompts(task, tokenizer, cfg.task.prompts_per_step, seed)
                prompt_ids = [p.ids for p in prompts for _ in range(a.group_size)]
                if step % cfg.rollout.sync_every == 0:  # an asynchronous engine samples with weights that lag
                    engine.sync_weights(model)
                ro = engine.generate(prompt_ids, sampling, seed=seed)
                completions = ro.completion_ids
                t_rollout = time.perf_counter() - t0

                # 2. rewards (checked: a raising / NaN reward names the sample)
                rewards = compute_rewards(task, prompts, a.group_size, ro.texts, completions)

                # 3. advantages over each group of group_size completions of one prompt
                advantages = adv_fn(rewards, a.group_size)

                # 4. π_old: fp32 full forward, no grad, ALP off (μ is compared with this)
                #    routing replay (MoE): r3 routes π_old as the engine did; r2 records π_old's own routes for π_θ
                need_logits = preset.divergence
                replay_mode = cfg.rollout.routing_replay
                routing = (replay_routes(model, ro.routed_experts, mode="replay" if replay_mode == "r3" else "compare")
                           if replay_mode != "none" else contextlib.nullcontext())
                recorder = (RouteRecorder(model, batch_size=len(prompt_ids)) if replay_mode == "r2"
                            else contextlib.nullcontext())
                with torch.no_grad(), routing as replayed, recorder as recorded:
                    old_logp, mask, old_logits, old_extras = score_policy(
                        model, prompt_ids, completions, sampling, dtype=train_dtype, dvp_rho=dvp_rho,
                        return_logits=need_logits)
                theta_routes = {"none": None, "r3": ro.routed_experts}.get(replay_mode)
                if replay_mode == "r2":
                    theta_routes = recorded.pop_rows([len(p) + len(c) - 1 for p, c in zip(prompt_ids, completions)])
                rollout_logp = ro.logp.to(old_logp.device)
                token_div, div_kind = None, "exact"
                if need_logits and hasattr(engine, "score"):
                    # TRM's exact KL(μ‖π_old) needs the rollout engine's full logits: re-score with its numerics.
                    roll_logits = engine.score(prompt_ids, completions, sampling, return_logits=True)[2]
                    token_div = exact_token_kl(roll_logits.to(old_logp.device), old_logits, sampling)
                del old_logits

                # full-batch diagnostics at π_old (before any update): the mismatch this step starts from
                full = LogProbBatch(logp=old_logp, mask=mask, old_logp=old_logp, rollout_logp=rollout_logp,
                                    advantages=advantages, token_divergence=token_div, token_divergence_kind=div_kind,
                                    extras=old_extras)
                # the result itself, not its coefficient: the metrics reuse the log-ratio its corrections computed
                corrected = correction(full) if correction is not None else None
                metrics: dict[str, Tensor | float] = dict(offpolicy_metrics(old_logp, rollout_logp, mask, corrected))
                if replay_mode != "none":  # the engine's routes that π_old's own router would change
                    metrics["routing/flip_rate"] = replayed.flip_rate

                # 5. minibatch updates
                if alp is not None:
                    alp.reseed(seed)
                b = len(prompt_ids)
                gen = torch.Generator().manual_seed(seed)
                updates: list[dict[str, Tensor]] = []
                for _epoch in range(cfg.optim.epochs):
                    order = torch.randperm(b, generator=gen)
                    for idx in order.tensor_split(cfg.optim.minibatches):
                        ids = idx.tolist()
                        mb_prompts = [prompt_ids[i] for i in ids]
                        mb_comp = [completions[i] for i in ids]
                        mb_routing = (replay_routes(model, [theta_routes[i] for i in ids]) if theta_routes is not None
                                      else contextlib.nullcontext())
                        with alp.active() if alp is not None else contextlib.nullcontext(), mb_routing:
                            logp, mb_mask, _, extras = score_policy(model, mb_prompts, mb_comp, sampling,
                                                                    dtype=train_dtype, dvp_rho=dvp_rho)
                        t = logp.shape[1]
                        batch = LogProbBatch(
                            logp=logp, mask=mb_mask, old_logp=old_logp[idx, :t], rollout_logp=rollout_logp[idx, :t],
                            advantages=advantages[idx],
                            token_divergence=None if token_div is None else token_div[idx, :t],
                            token_divergence_kind=div_kind, extras=extras,
                        )
                        if alp is not None:
                            loss, lm = alp_policy_loss(batch, level=cfg.alp.level, correction=correction,
                                                       clip_low=a.clip_low, clip_high=a.clip_high,
                                                       dual_clip=dual_clip, aggregation=a.aggregation)
                        else:
                            loss, lm = policy_loss(batch, correction=correction, objective=objective,  # type: ignore[arg-type]
                                                   clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
                                                   aggregation=a.aggregation, level=a.level or "token")  # type: ignore[arg-type]
                        optimizer.zero_grad(set_to_none=True)
                        loss.backward()
                        params = [p for g in optimizer.param_groups for p in g["params"]]
                        max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm is not None else math.inf
                        gnorm = torch.nn.utils.clip_grad_norm_(params, max_norm)
                        optimizer.step()
                        updates.append({"loss/loss": loss.detach(), "loss/grad_norm": gnorm.detach(), **lm})
                for k in updates[0]:
                    metrics[k] = torch.stack([u[k].float() for u in updates]).mean()

                # 6. metrics (one sync) + logging + checkpoint
                metrics["reward/mean"] = rewards.mean()
                metrics["reward/std"] = rewards.std(unbiased=False)
                metrics["reward/max"] = rewards.max()
                metrics["response/length_mean"] = mask.float().sum(-1).mean()
                metrics["mismatch/token_kl_exact_mean"] = (masked_mean(token_div, mask) if token_div is not None
                                                          else torch.tensor(float("nan")))
                if corrected is not None:
                    metrics["correction/masked_frac"] = 1.0 - masked_mean((corrected.coefficient != 0).float(), mask)
                else:
                    metrics["correction/masked_frac"] = torch.zeros(())
                if alp is not None:
                    metrics.update(alp.metrics())
                metrics["time/step_s"] = time.perf_counter() - t0
                metrics["time/rollout_s"] = t_rollout
                metrics["time/tokens_per_s"] = float(mask.sum()) / max(metrics["time/step_s"], 1e-9)  # type: ignore[arg-type]
                step += 1
                in_step = False
                floats = logger.log(step, metrics) if step % run.log_every == 0 or step == run.steps else \
                    _sync(metrics)
                floats["step"] = step
                history.append(floats)
                if progress is not None:
                    progress.update(task_id, advance=1, description=(
                        f"{a.preset} reward {floats['reward/mean']:.3f} kl {floats['rollout_correction/kl']:.2e}"))
                if run.checkpoint_every and step % run.checkpoint_every == 0:
                    last_ckpt = checkpoint(step)
                if on_step_end is not None:
                    on_step_end(step, floats)
                if stop.requested:
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        # Only ever raised between steps (the signal handler defers the first Ctrl-C), so `step` is consistent.
        interrupted = True
        if in_step:
            # A second Ctrl-C mid-update: the weights are between two steps, no exact checkpoint exists.
            if console is not None:
                console.print(f"[red]stopped inside step {step + 1}; last checkpoint: {_plain(last_ckpt)}[/red]")
        else:
            last_ckpt = checkpoint(step)
            if console is not None:
                console.print(f"[yellow]interrupted after step {step}; checkpoint {_plain(last_ckpt)} "
                              "(resume with --resume)[/yellow]")
    finally:
        logger.close()
        torch.set_num_threads(threads_before)
    if not interrupted and step > start and (last_ckpt is None or not last_ckpt.name.endswith(f"{step:08d}.safetensors")):
        last_ckpt = checkpoint(step)
    return TrainResult(step, history, out_dir, last_ckpt, interrupted, model, alp)


def _writable_dir(out_dir: Path) -> None:
    """Create ``run.out_dir`` (an OSError there used to surface as a traceback after the model had loaded)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"run.out_dir {str(out_dir)!r} cannot be created: {err.strerror or err}") from None
    if not os.access(out_dir, os.W_OK | os.X_OK):
        raise ValueError(f"run.out_dir {str(out_dir)!r} is not writable")


def _resume_checkpoint(cfg: TrainConfig, resume: bool | str | Path, ckpt_dir: Path) -> Path:
    """The checkpoint to resume from, checked against ``cfg`` before anything is built or written.

    Refuses a checkpoint written by another run (its stored preset / seed differ: continuing it would mix two runs
    in one folder) and a ``run.steps`` below the checkpoint's step (nothing could run, and the config would lie).
    """
    path = latest_checkpoint(ckpt_dir) if resume is True else Path(resume)
    if path is None:
        raise ValueError(f"--resume: no checkpoint in {str(ckpt_dir)!r}")
    info = read_checkpoint_info(path)  # names the file when it is corrupt or truncated
    stored = info.get("user", {})
    ours = {"algorithm.preset": cfg.algorithm.preset, "run.seed": cfg.run.seed}
    theirs = {"algorithm.preset": stored.get("preset"), "run.seed": stored.get("seed")}
    differ = [f"{k}={theirs[k]!r} (now {ours[k]!r})" for k in ours if theirs[k] is not None and theirs[k] != ours[k]]
    if differ:
        raise ValueError(f"--resume: checkpoint {str(path)!r} was written with {', '.join(differ)}; resume with the "
                         "same settings, or start a fresh run without --resume")
    if info["step"] > cfg.run.steps:
        raise ValueError(f"--resume: checkpoint {str(path)!r} is at step {info['step']}, past run.steps="
                         f"{cfg.run.steps}; set run.steps above {info['step']} to train further")
    return path


def _clear_earlier_run(out_dir: Path, ckpt_dir: Path) -> None:
    """Remove what an earlier run left in ``out_dir`` (its checkpoints, killed-save leftovers, TensorBoard events;
    its metrics.jsonl is emptied by the logger), with one warning naming the folder when there was anything."""
    metrics = out_dir / "metrics.jsonl"
    events = sorted((out_dir / "tensorboard").glob("events.out.tfevents.*"))
    stale = checkpoint_files(ckpt_dir) + temp_files(ckpt_dir) + events
    if not stale and not (metrics.is_file() and metrics.stat().st_size > 0):
        return
    warnings.warn(f"run.out_dir {str(out_dir)!r} holds an earlier run: replacing its metrics, checkpoints and "
                  "TensorBoard logs (use --resume to continue it instead)", RunReplacedWarning, stacklevel=3)
    for p in stale:
        p.unlink(missing_ok=True)


def _sync(metrics: dict[str, Any]) -> dict[str, float]:
    from offpolicy.train.logging import to_floats

    return to_floats(metrics)


def _plain(value: Any) -> str:
    """User text (a path may hold ``[…]``) printed literally, not as rich markup."""
    from rich.markup import escape

    return escape(str(value))


def _progress(console: Any, enabled: bool):  # -> rich Progress | None
    if not enabled:
        return None
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        return None
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False)
