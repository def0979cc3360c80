"""The trainer's state and its four steps — rollout, scoring, update, metrics — each a function of the state.

:func:`build_state` builds everything from the config (before any rollout, so errors surface first). The steps read
the state and return plain records; only :func:`update_step` changes it (the weights, the optimizer). Between steps a
caller — :func:`offpolicy.train.loop.train`'s ``on_step_end``, or a loop of one's own — may change the state:
:meth:`TrainState.set_corrections` rebuilds the correction chain from specs with new parameters,
:meth:`TrainState.set_lr` sets the policy's learning rate.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import Correction
from offpolicy.losses import policy_loss
from offpolicy.metrics import NAMINGS, offpolicy_metrics
from offpolicy.perturbation import LayerwisePerturbation, alp_policy_loss
from offpolicy.position import position_metrics
from offpolicy.ratios import masked_mean
from offpolicy.registry import build_correction
from offpolicy.rollout.routing import RouteRecorder, replay_routes
from offpolicy.rollout.sampling import SamplingConfig, process_logits
from offpolicy.rollout.scoring import sequence_logprobs
from offpolicy.rollout.sync_check import SyncCheck, SyncProbe
from offpolicy.train.config import TrainConfig, objective_call
from offpolicy.train.data import Prompt, compute_rewards, load_task, step_prompts
from offpolicy.train.presets import PRESETS, SCORE_CENTERING_TOPK, Preset, chain_specs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    engine = engine if engine is not None else build_engine(cfg, model, tokenizer)
    if cfg.rollout.sync_every > 1 and not isinstance(getattr(engine, "model", None), torch.nn.Module):
        raise ValueError("rollout.sync_every > 1 needs an engine whose weights are a module at engine.model "
                         "(they are saved in checkpoints)")
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
    if action != "off":
        if not can_score:
            raise ValueError(f"rollout.sync_check={cfg.rollout.sync_check!r}: the engine {type(engine).__name__} cannot "
                             "score given tokens (no score()), so its syncs cannot be checked; set rollout.sync_check=off")
        sync_check = SyncCheck(z=cfg.rollout.sync_check_z, max_baseline=cfg.rollout.sync_check_max_baseline,
                               on_failure=action)
    return TrainState(
        cfg=cfg, model=model, tokenizer=tokenizer, task=task if task is not None else load_task(cfg.task),
        engine=engine, sampling=sampling_config(cfg),
        optimizer=torch.optim.AdamW(groups, betas=cfg.optim.betas), alp=alp, correction_specs=specs,
        correction=build_correction(specs), objective=objective, objective_params=objective_params,
        advantage_fn=advantage_fn(cfg.algorithm.advantage), sync_check=sync_check,
    )


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
        from offpolicy.models import get_recipe
        from offpolicy.models import load_model as load_embedded

        model, tok = load_embedded(get_recipe(m.path).with_overrides(m.tiny_config), m.cache_dir)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = str(Path(m.path).expanduser())
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=DTYPES[m.dtype])
    model = model.to(device=cfg.run.device, dtype=DTYPES[m.dtype])
    model.eval()  # no dropout: the trainer's π must be a deterministic function of θ (and of σ·ε with ALP)
    return model, tok


def build_engine(cfg: TrainConfig, model: torch.nn.Module, tokenizer):  # -> HFRolloutEngine | LlamaCppRolloutEngine
    from offpolicy.rollout.hf import HFRolloutEngine

    r = cfg.rollout
    if r.engine == "llamacpp":  # real kernels: the model as GGUF in an in-process llama-server, re-exported per sync
        from offpolicy.rollout.llamacpp import LlamaCppRolloutEngine

        ll = r.llamacpp
        return LlamaCppRolloutEngine(model, tokenizer, weights=ll.weights, kv_cache_type=ll.kv_cache_type,
                                     threads=ll.threads or cfg.run.threads)
    if r.engine == "server":  # a running server, synced through a reload folder of the run's own
        from offpolicy.rollout.servers import connect_server

        sv = r.server
        assert sv.url is not None  # RolloutConfig's validator
        model_config: Any = model.config  # a transformers config
        weights_dir = sv.weights_dir or str(Path(cfg.run.out_dir) / "reload")
        return connect_server(sv.url, protocol=sv.protocol, vocab_size=model_config.vocab_size, timeout=sv.timeout,
                              tokenizer=tokenizer, weights_dir=weights_dir)
    if r.engine == "vllm":  # vLLM's kernels, paged KV cache and sampler in this process, started on the model's weights
        from offpolicy.rollout.vllm import VLLMRolloutEngine

        sampling = sampling_config(cfg)
        return VLLMRolloutEngine.from_model(model, tokenizer, dtype=r.dtype, kv_cache_dtype=r.vllm.kv_cache_dtype,
                                            max_model_len=r.vllm.max_model_len, seed=cfg.run.seed,
                                            max_logprobs=max(20, sampling.logprobs_topk))
    return HFRolloutEngine(
        model, dtype=r.dtype, kv_cache=r.kv_cache, kv_cache_bits=r.kv_cache_bits, weight_bits=r.weight_bits,
        quant=r.quant, logit_noise=r.logit_noise, tokenizer=tokenizer, record_routes=r.routing_replay != "none",
        sampler=r.sampler, compile=r.compile,
    )


def sampling_config(cfg: TrainConfig) -> SamplingConfig:
    """The engine's sampling config; DVP samples from (and scores with) the min-p safe set (arXiv 2512.23087 §5)."""
    s = cfg.rollout.sampling
    min_p = s.min_p if s.min_p > 0 else None
    if PRESETS[cfg.algorithm.preset].minp:
        # V_S = {a : π(a) ≥ ρ·max π}: exactly min-p with min_p = ρ, applied by the engine to its logits (μ^mp over
        # V'_S) and by the trainer to its logits (π^mp over V_S) — both policies constrained, as in the paper.
        min_p = max(min_p or 0.0, cfg.algorithm.dvp_rho)
    top_p = s.top_p if s.top_p < 1.0 else None
    # score_centering_topk: the engine reports q's top-K head at each sampled position (a server's logprobs=K; the
    # transformers engine takes it from the same processed log-probs it samples from, without touching the sampling)
    topk = SCORE_CENTERING_TOPK if PRESETS[cfg.algorithm.preset].score_centering == "topk" else 0
    if cfg.algorithm.dvp_coverage is not None:
        # entropy-adaptive safe set: top-p(1 − ε) ∩ min-p(ρ) — HF's order (top-p, then min-p) is the intersection,
        # because min-p compares p(a) / max p, which renormalising after top-p does not change
        top_p = 1.0 - cfg.algorithm.dvp_coverage
    return SamplingConfig(
        max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k or None, top_p=top_p, min_p=min_p,
        logprobs_topk=topk,
    )


def advantage_fn(name: str) -> Callable[[Tensor, int], Tensor]:
    from offpolicy import advantages

    return {"grpo": advantages.grpo_advantages, "dr_grpo": advantages.dr_grpo_advantages,
            "rloo": advantages.rloo_advantages}[name]


def step_seed(seed: int, step: int) -> int:
    """The seed of step ``step`` (0-based) of run ``seed``: prompts, sampling, ALP noise and the minibatch order."""
    return (seed * 1_000_003 + step * 7919 + 17) % (2**62)


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
    check, sync_metrics = state.sync_check, {}
    if sync_weights:
        state.engine.sync_weights(state.model)
        if check is not None and check.baseline is not None:
            sync_metrics = check.after_sync(state.engine, state.model, what=f"step {'?' if step is None else step + 1}'s weight sync")
    out = state.engine.generate(prompt_ids, state.sampling, seed=seed)
    if check is not None and check.baseline is None:  # the first rollout: same weights on both sides, no update yet
        sync_metrics = check.calibrate(state.engine, state.model,
                                       SyncProbe.from_rollout(out.prompt_ids, out.completion_ids))
    seconds = time.perf_counter() - t0
    rewards = compute_rewards(state.task, prompts, a.group_size, out.texts, out.completion_ids)
    return Rollout(prompts, prompt_ids, out.completion_ids, out.logp, rewards, state.advantage_fn(rewards, a.group_size),
                   getattr(out, "routed_experts", None), seconds, topk_ids=getattr(out, "topk_ids", None),
                   topk_logp=getattr(out, "topk_logp", None), sync_metrics=sync_metrics)


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
    records π_old's own routes for the π_θ forwards.
    """
    cfg = state.cfg
    mode = cfg.rollout.routing_replay
    routing = (replay_routes(state.model, rollout.routed_experts, mode="replay" if mode == "r3" else "compare")
               if mode != "none" else None)
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
                  roll_logits if state.preset.score_centering else None, theta=theta, sampler_head=head)


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

    adaptive = sampling.top_p is not None  # algorithm.dvp_coverage: V_S = top-p(1 − ε) ∩ min-p(ρ)
    # the forward only needs the raw logits: the safe set is applied once, below (a top-p sort per position costs
    # as much as the rest of the scoring)
    plain = replace(sampling, top_p=None, min_p=None) if adaptive else replace(sampling, min_p=None)
    _, mask, logits = sequence_logprobs(model, prompt_ids, completions, plain, dtype=dtype, return_logits=True)
    targets = pad_ids(completions, 0, side="right")[0].to(logits.device)[:, : mask.shape[1]]
    if adaptive:
        logp, extras = adaptive_dvp_fields(logits, targets, mask, sampling)
    else:  # the paper's fixed ρ: pruned logits get −50, not −inf
        fields = dvp_fields(logits, targets, mask, rho=dvp_rho, temperature=sampling.temperature)
        fixed_logp, fixed_extras = fields["logp"], fields["extras"]
        assert isinstance(fixed_logp, Tensor) and isinstance(fixed_extras, dict)
        logp, extras = fixed_logp, dict(fixed_extras)
    return logp, mask, (logits if return_logits else None), extras


def adaptive_dvp_fields(logits: Tensor, targets: Tensor, mask: Tensor,
                        sampling: SamplingConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """DVP over the entropy-adaptive safe set V_S = top-p(1 − ε) ∩ min-p(ρ) of the trainer's own raw logits
    ``[B, T, V]`` (``algorithm.dvp_coverage`` = ε; ``sampling`` carries top-p = 1 − ε and min-p = ρ): log π over V_S
    of the ``targets`` ``[B, T]`` (processed like the engine's μ over V'_S), with a finite stand-in (0) where the
    sampled token is outside V_S or masked, and the extras of :func:`~offpolicy.corrections.vocabulary.dvp_fields`:
    ``dvp_keep`` (y ∈ V_S: DVP's ratio is 0 otherwise) and ``dvp_mass`` (retained mass Z ≥ 1 − ε wherever ρ does not
    cut deeper; DVP Prop. 5.5 bounds the bias by R·T·(1 − Z_min)).

    >>> z = torch.tensor([[[3.0, 0.0, -1.0]]])                    # p = (0.9364, 0.0466, 0.0171)
    >>> cfg = SamplingConfig(top_p=0.95, min_p=1e-6)               # top-p keeps the first two: Z = 0.9829
    >>> logp, extras = adaptive_dvp_fields(z, torch.tensor([[2]]), torch.ones(1, 1, dtype=torch.bool), cfg)
    >>> extras["dvp_keep"], round(float(extras["dvp_mass"]), 4), float(logp)
    (tensor([[False]]), 0.9829, 0.0)
    """
    processed = process_logits(logits, sampling)  # log π over V_S, −inf outside it
    logp = processed.gather(-1, targets[..., None])[..., 0]
    keep = mask & torch.isfinite(logp)
    z = logits.detach().float() / sampling.temperature
    kept = torch.isfinite(processed.detach())
    mass = torch.exp(torch.logsumexp(z.masked_fill(~kept, float("-inf")), -1) - torch.logsumexp(z, -1))
    return torch.where(keep, logp, torch.zeros_like(logp)), {"dvp_keep": keep, "dvp_mass": mass}


def exact_token_kl(rollout_logits: Tensor, train_logits: Tensor, sampling: SamplingConfig) -> Tensor:
    """KL(μ‖π) per token ``[B, T]`` from two raw logit tensors ``[B, T, V]``, both at ``sampling``'s temperature.

    Why temperature only, not top-k / top-p / min-p: truncating the two logit sets separately cuts them at different
    tokens (a bf16 tie at the k-th logit, a shifted top-p crossing), and a token one keeps and the other drops makes
    the KL +inf. The KL between the two models' full tempered distributions is finite and is what the TRM paper
    (arXiv 2512.23075 §4) measures from logits.
    """
    full = replace(sampling, top_k=None, top_p=None, min_p=None)
    lmu = process_logits(rollout_logits, full)
    lpi = process_logits(train_logits, full)
    pmu = lmu.exp()
    terms = torch.where(pmu > 0, pmu * (lmu - lpi), torch.zeros_like(pmu))
    return terms.sum(-1).clamp(min=0.0)  # KL ≥ 0; float32 rounding can leave −1e-9


# -- 3. update ---------------------------------------------------------------------------------------------------------


def update_step(state: TrainState, rollout: Rollout, scored: Scored, seed: int) -> list[dict[str, Tensor]]:
    """``optim.epochs`` passes of ``optim.minibatches`` optimiser steps over the batch, in a seeded order: per
    minibatch a π_θ forward (ALP noise on), the correction chain and the objective, backward, clip, step. Returns
    each minibatch's loss metrics (tensors)."""
    cfg = state.cfg
    if state.alp is not None:
        state.alp.reseed(seed)
    order_generator = torch.Generator().manual_seed(seed)
    updates: list[dict[str, Tensor]] = []
    for _epoch in range(cfg.optim.epochs):
        order = torch.randperm(len(rollout.prompt_ids), generator=order_generator)
        for rows in order.tensor_split(cfg.optim.minibatches):
            batch = _minibatch(state, rollout, scored, rows)
            loss, metrics = _loss(state, batch)
            state.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            params = [p for g in state.optimizer.param_groups for p in g["params"]]
            max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm is not None else math.inf
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            state.optimizer.step()
            updates.append({"loss/loss": loss.detach(), "loss/grad_norm": grad_norm.detach(), **metrics})
    scored.theta = None  # the graph has served its one backward
    return updates


def _minibatch(state: TrainState, rollout: Rollout, scored: Scored, rows: Tensor) -> LogProbBatch:
    """The :class:`LogProbBatch` of some rows, with π_θ from a forward with the ALP noise on (and routes replayed)."""
    if scored.theta is not None:  # single pass: the scoring's forward, with its graph, is π_θ's
        logp, extras = scored.theta
        return LogProbBatch(logp=logp[rows], mask=scored.mask[rows], old_logp=scored.old_logp[rows],
                            rollout_logp=scored.rollout_logp[rows], advantages=rollout.advantages[rows],
                            token_divergence=None if scored.token_divergence is None else scored.token_divergence[rows],
                            extras={k: v[rows] for k, v in extras.items()})
    ids = rows.tolist()
    routes = replay_routes(state.model, [scored.theta_routes[i] for i in ids]) if scored.theta_routes is not None \
        else contextlib.nullcontext()
    with state.alp.active() if state.alp is not None else contextlib.nullcontext(), routes:
        logp, mask, logits, extras = score_policy(
            state.model, [rollout.prompt_ids[i] for i in ids], [rollout.completions[i] for i in ids], state.sampling,
            dtype=DTYPES[state.cfg.model.dtype], dvp_rho=state.cfg.algorithm.dvp_rho if state.preset.minp else None,
            return_logits=state.preset.score_centering is not None)
    t = logp.shape[1]
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
        token_divergence=None if scored.token_divergence is None else scored.token_divergence[rows, :t], extras=extras,
    )


def _score_centered(state: TrainState, logp: Tensor, logits: Tensor, sampler: Tensor | tuple[Tensor, Tensor],
                    extras: dict[str, Tensor], *, rollout_logp: Tensor,
                    targets: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """π_θ's log-probs carrying the centred score ∇log p(y) − E_q[∇log p] (arXiv 2609.20807; exact from the
    sampler's full logits, or its top-k head with the proportional tail), and the per-token drift ½‖q − p‖₁ and
    top-k tail error ½‖q − q̂‖₁ as extras (logged as ``score_centering/*``). ``sampler``: the raw logits ``[B, T, V]``
    of a re-score, or a server's head ``(ids, log q)`` ``[B, T, K]``: then the drift is the proportional-tail estimate
    ½‖q̂ − p‖₁ and the tail error, which needs the full q, is not logged."""
    from offpolicy.objectives.score_centering import (
        centered_logp,
        sampler_topk,
        score_center,
        score_center_topk,
        topk_drift_tv,
        topk_tail_gap,
    )

    temperature = state.sampling.temperature
    if state.preset.score_weighting is not None:  # the IS rule's weight and weighted centre (score_centering_is)
        return _weighted_centered(state, logp, logits, sampler, rollout_logp, extras, targets)
    if isinstance(sampler, tuple):  # the engine's own top-K, already tempered
        ids, logq = sampler
        center = score_center_topk(logits, ids, logq, temperature=temperature)
        drift = topk_drift_tv(logits.detach(), ids, logq, temperature=temperature)
        return centered_logp(logp, center), {**extras, "score_centering/drift_tv": drift}
    sampler_logits = sampler
    if state.preset.score_centering == "topk":
        ids, logq = sampler_topk(sampler_logits, SCORE_CENTERING_TOPK, temperature=temperature)
        center = score_center_topk(logits, ids, logq, temperature=temperature)
    else:
        center = score_center(logits, sampler_logits, temperature=temperature)
    drift, gap = topk_tail_gap(logits.detach(), sampler_logits, SCORE_CENTERING_TOPK, temperature=temperature)
    return centered_logp(logp, center), {**extras, "score_centering/drift_tv": drift,
                                         "score_centering/topk_gap_tv": gap}


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


def _loss(state: TrainState, batch: LogProbBatch) -> tuple[Tensor, dict[str, Tensor]]:
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


# -- 4. metrics --------------------------------------------------------------------------------------------------------


def metrics_step(state: TrainState, rollout: Rollout, scored: Scored, updates: list[dict[str, Tensor]], *,
                 started: float) -> dict[str, Tensor | float]:
    """The step's metrics (tensors, synced once by the caller): the mismatch diagnostics between π_old and μ under
    ``run.metric_naming`` (with the correction chain's result at π_old), the minibatches' mean loss metrics
    (which include each correction's own), rewards, response length, TRM's exact KL, the mismatch per position bin
    (``mismatch/by_position/…``, :func:`offpolicy.position.position_metrics`), the masked fraction, ALP's σ, MoE
    routing flips and timings."""
    naming = state.cfg.run.metric_naming
    mask = scored.mask
    at_old = LogProbBatch(logp=scored.old_logp, mask=mask, old_logp=scored.old_logp, rollout_logp=scored.rollout_logp,
                          advantages=rollout.advantages, token_divergence=scored.token_divergence,
                          extras=scored.extras)
    corrected = state.correction(at_old) if state.correction is not None else None
    metrics: dict[str, Tensor | float] = dict(
        offpolicy_metrics(scored.old_logp, scored.rollout_logp, mask, corrected, naming=naming))
    if scored.flip_rate is not None:  # the engine's routes that π_old's own router would change
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
    metrics["correction/masked_frac"] = (1.0 - masked_mean((corrected.coefficient != 0).float(), mask)
                                         if corrected is not None else torch.zeros(()))
    if state.alp is not None:
        metrics.update(state.alp.metrics())
    step_seconds = time.perf_counter() - started
    metrics["time/step_s"] = step_seconds
    metrics["time/rollout_s"] = rollout.seconds
    metrics["time/tokens_per_s"] = float(mask.sum()) / max(step_seconds, 1e-9)
    metrics.update(rollout.sync_metrics)
    return metrics


def kl_metric_name(naming: str) -> str:
    """The key of the direct KL estimate under ``naming`` (the progress bar shows it)."""
    return NAMINGS[naming].key("kl")

