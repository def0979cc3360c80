"""``OffPolicyGRPOTrainer``: TRL's ``GRPOTrainer`` with offpolicy's loss, sampling replay / DVP, ALP and top-k TRM.

Each method plugs into one of TRL's own overridable methods (see the package docstring for what a user writes):

* the loss — ``_compute_loss`` (:func:`~offpolicy.integrations.trl.loss.trl_policy_loss`'s batch, the correction
  chain, TRL's normalisers);
* sampling replay / DVP — ``_get_per_token_logps_and_entropies`` (every π_old forward) and ``_compute_loss`` (the
  π_θ forward) score under the engine's recipe (:mod:`~offpolicy.integrations.trl.replay`); DVP sets ``min_p = ρ``
  in the ``GRPOConfig`` before TRL builds its engines;
* ALP — hooks on the decoder layers switched on only around the update forward, σ's group added in
  ``create_optimizer``, σ saved in ``_save_checkpoint`` and restored in ``_load_optimizer_and_scheduler``
  (:mod:`~offpolicy.integrations.trl.alp`);
* top-k TRM — ``_generate_single_turn`` asks vLLM for K log-probs and takes the sampled token's entry,
  ``_generate_and_score_completions`` puts the top-k into TRL's batch (:mod:`~offpolicy.integrations.trl.topk`);
* the vLLM weight sync — ``VLLMGeneration.sync_weights`` replaced on the instance: through ``reload_weights`` on
  vLLM's CPU backend, and checked after every sync (:mod:`~offpolicy.integrations.trl.vllm_sync`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from offpolicy.corrections.base import Correction, chain
from offpolicy.corrections.vocabulary import dvp_keep
from offpolicy.integrations.trl.alp import alp_callback, load_alp, save_alp
from offpolicy.integrations.trl.loss import (
    _MODEL_INPUT_KEYS,
    TOKEN_COUNT_NORMALISED,
    TRL_LOSS_TYPES,
    TRL_MAX_TOKENS,
    _loss_mask,
    batch_from_trl_inputs,
    cispo_cap,
    refuse_contradictions,
    trl_objective,
)
from offpolicy.integrations.trl.replay import ENGINE_ORDERS, ReplayHistory, replay_logp, trl_engine, trl_sampling_recipe
from offpolicy.integrations.trl.terms import (
    clip_fractions,
    coefficient,
    kl_to_reference,
    masked_stats,
    replay_entropy,
    sequence_means,
    trl_log_weight,
)
from offpolicy.integrations.trl.topk import (
    TOPK_IDS_KEY,
    TOPK_LOGP_KEY,
    own_slack_rows,
    pad_topk,
    sampled_token_logprobs,
    topk_divergence,
    topk_score_center,
)
from offpolicy.integrations.trl.vllm_sync import (
    FileSync,
    TRLSyncCheck,
    check_sync_setting,
    extra_llm_kwargs,
    install_vllm_sync,
    server_sync_choice,
    uses_files,
    vllm_on_cpu,
)
from offpolicy.integrations.versions import check_versions
from offpolicy.kernels.chunking import DEFAULT_MEMORY_BUDGET_BYTES
from offpolicy.losses import needs_rollout_logp, policy_loss
from offpolicy.metrics import check_naming, offpolicy_metrics
from offpolicy.objectives.score_centering import centered_logp
from offpolicy.perturbation import (
    DEFAULT_INIT_STD,
    DEFAULT_LR,
    LayerwisePerturbation,
    alp_clip_defaults,
    alp_policy_loss,
)
from offpolicy.ratios import masked_max, masked_mean
from offpolicy.registry import AGGREGATIONS, CorrectionSpec, build_correction
from offpolicy.rollout.sync_check import SyncCheck
from offpolicy.topk_advice import TopKAdvice, doubling_ks, topk_advice

ALP_KEYS = ("init_std", "lr", "layers", "layers_path", "seed", "level")


@dataclass
class Scores:
    """One forward's per-token outputs ``[B, T]``: the log-probs (replayed when the recipe is on), whether the token
    is inside the trainer's support, the retained mass, the top-k KL bounds (None without top-k), the MoE aux loss,
    score centering's top-k centre (None unless asked), the entropy (on the replayed support under the recipe; None
    unless asked)."""

    logp: Tensor
    inside: Tensor
    mass: Tensor
    kl_lower: Tensor | None
    kl_upper: Tensor | None
    aux_loss: Tensor | None
    center: Tensor | None = None
    own_slack: Tensor | None = None  # [len(ks), b, T]: π's own top-K' slack, for the top-k advice (first batch)
    entropy: Tensor | None = None


# TRL's loss types whose clip fractions TRL logs (clip_ratio/… for the PPO family, cispo_clip_ratio)
TRL_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo")


def _nan_reduce(x: Tensor, reduce: Any) -> float:
    """``reduce`` (torch.amin / amax) over the non-NaN entries of ``x``; NaN when there are none (TRL's nanmin)."""
    finite = x[~torch.isnan(x)]
    return float("nan") if finite.numel() == 0 else float(reduce(finite))


def _check_alp(alp: Any) -> dict[str, Any] | None:
    if alp is None or alp is False:
        return None
    if alp is True:
        return {}
    if not isinstance(alp, dict):
        raise ValueError(f"alp must be None, True or a dict with keys from {ALP_KEYS}, got {alp!r}")
    unknown = sorted(set(alp) - set(ALP_KEYS))
    if unknown:
        raise ValueError(f"alp has unknown keys {unknown}; choose from {ALP_KEYS}")
    return dict(alp)


def _check_score_centering(on: Any, topk: int, replay: bool, alp: dict[str, Any] | None) -> None:
    if not isinstance(on, bool):
        raise ValueError(f"score_centering must be a bool, got {on!r}")
    if not on:
        return
    if not topk:
        raise ValueError("score_centering: needs the sampler's top-K log-probs; set topk_logprobs=K (vLLM)")
    if replay:
        raise ValueError("score_centering: centres the full tempered π_θ; not with sampling_replay / dvp_rho")
    if alp is not None:
        raise ValueError("score_centering: not combined with alp (ALP's noisy forward is not centred)")


def _with_min_p(args: tuple, kwargs: dict, rho: float) -> tuple[tuple, dict]:
    """DVP: a copy of the ``GRPOConfig`` with ``min_p = max(min_p, ρ)`` (TRL reads it when it builds its engines)."""
    if "args" in kwargs and kwargs["args"] is not None:
        cfg = copy.copy(kwargs["args"])
        cfg.min_p = max(float(cfg.min_p or 0.0), rho)
        return args, {**kwargs, "args": cfg}
    if len(args) > 2 and args[2] is not None:
        cfg = copy.copy(args[2])
        cfg.min_p = max(float(cfg.min_p or 0.0), rho)
        return (*args[:2], cfg, *args[3:]), kwargs
    raise ValueError("dvp_rho: pass args=GRPOConfig(...) (DVP sets its min_p before TRL builds the engines)")


def _grpo_args(args: tuple, kwargs: dict) -> Any:
    """The ``GRPOConfig`` given to the trainer (keyword ``args`` or the third positional argument), or None."""
    if kwargs.get("args") is not None:
        return kwargs["args"]
    return args[2] if len(args) > 2 else None


def _colocate_llm_kwargs(cfg: Any, given: dict[str, Any] | None, topk: int) -> dict[str, Any]:
    """Extra ``vllm.LLM`` arguments for TRL's colocated engine: ``given``, and where it says nothing, on vLLM's CPU
    backend ``enforce_eager=True`` (start-up ≈ 25 s instead of ≈ 80 s), and ``max_logprobs`` ≥ ``topk``."""
    if given is not None and not isinstance(given, dict):
        raise ValueError(f"vllm_kwargs must be a dict of vllm.LLM arguments or None, got {given!r}")
    out = dict(given or {})
    if not (getattr(cfg, "use_vllm", False) and getattr(cfg, "vllm_mode", "colocate") == "colocate"):
        if out:
            raise ValueError("vllm_kwargs: TRL builds an LLM only with use_vllm=True, vllm_mode='colocate'")
        return out
    if vllm_on_cpu():
        out.setdefault("enforce_eager", True)
    if topk > 20:  # vLLM's default max_logprobs
        out.setdefault("max_logprobs", topk)
    return out


def _trm_thresholds(correction: Correction | None) -> tuple[float | None, float | None] | None:
    """TRM's ``(max_kl, avg_kl)`` if ``correction`` is or chains the ``trm`` preset, else None."""
    if correction is None:
        return None
    if correction.name == "trm":
        return correction.config.get("max_kl"), correction.config.get("avg_kl")  # type: ignore[return-value]
    for part in correction.parts:
        found = _trm_thresholds(part)
        if found is not None:
            return found
    return None


def _backbone_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, Tensor, Tensor | None]:
    wrapped: Any = model  # a transformers / PEFT model: its methods are not on ``torch.nn.Module``'s type
    core = wrapped.get_base_model() if hasattr(wrapped, "get_base_model") else wrapped
    head = core.get_output_embeddings()
    weight, bias = head.weight, head.bias
    if hasattr(weight, "full_tensor"):  # FSDP2 DTensor: gather the head, as TRL's fused head does
        weight = weight.full_tensor()
        bias = bias.full_tensor() if bias is not None and hasattr(bias, "full_tensor") else bias
    return core.base_model, weight, bias


def _check_plain_head(model: Any) -> None:
    """Replay and top-k recompute the head as h·Wᵀ + b: refuse models whose head also scales or soft-caps."""
    config = getattr(model, "config", None)
    if config is None:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"):
        value = getattr(text, key, None)
        if value is not None and value != 1.0:
            raise ValueError(f"model: its config sets {key}={value!r}, which the sampling replay / top-k scoring "
                             "does not apply; turn them off for this model")


def make_offpolicy_grpo_trainer(base: type | None = None) -> type:
    """Build ``OffPolicyGRPOTrainer`` as a subclass of ``base`` (default ``trl.GRPOTrainer``).

    ``base`` must provide TRL's ``_get_per_token_logps_and_entropies`` and ``_metrics``; passing it explicitly lets the
    adapter be tested without TRL.
    """
    if base is None:
        try:
            from trl import GRPOTrainer
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError("OffPolicyGRPOTrainer needs TRL: pip install 'offpolicy[trl]'") from err
        base = GRPOTrainer

    class OffPolicyGRPOTrainer(base):  # type: ignore[misc, valid-type]
        """``GRPOTrainer`` whose loss is :func:`offpolicy.policy_loss` with an offpolicy correction chain.

        ``aggregation`` defaults to the one that reproduces ``args.loss_type`` (grpo, bnpo, dr_grpo, dapo), with TRL's
        normaliser: divided by the gradient-accumulation steps (TRL scales the loss itself and tells the HF Trainer
        not to), dapo by the generation batch's token count, dr_grpo by ``max_completion_length``. ``args.delta`` (TRL's
        two-sided clip) is the dual clip. Every other ``GRPOConfig`` option TRL 1.16 trains with is reproduced with
        TRL's metrics (:meth:`_compute_loss`, :mod:`~offpolicy.integrations.trl.terms`); a contradictory combination
        raises naming both settings (:func:`~offpolicy.integrations.trl.loss.refuse_contradictions`).

        The seed methods (all off by default):

        * ``sampling_replay=True`` — every forward scores tokens under the engine's recipe in its filter order;
          tokens outside the trainer's support leave the loss (``dvp_keep``); ``dvp/…`` metrics.
        * ``dvp_rho=ρ`` — DVP (arXiv 2512.23087): ``min_p = ρ`` for the engine, plus sampling replay.
        * ``alp=True`` or ``{"init_std", "lr", "layers", "layers_path", "seed", "level"}`` — ALP (arXiv 2603.19470):
          noise in the update forward only, ALP's unified-ratio loss at ``level`` (token by default).
        * ``topk_logprobs=K`` — K log-probs per token from vLLM, TRM's divergence from them (``topk_bound``:
          ``"upper"``, certified, or ``"lower"``); pair with ``correction="trm"``. With the certified bound,
          ``topk/head_mass``, ``topk/slack_mean`` and ``topk/certifiable_frac`` are logged, and one warning says when
          the bound is vacuous at this K — its slack alone fails TRM's test — and which K would help
          (:mod:`offpolicy.topk_advice`).
        * ``score_centering=True`` (with ``topk_logprobs=K``) — score centering (arXiv 2609.20807) on vLLM's top-K
          with the proportional tail: π_θ's log-probs carry the centred score ∇log π_θ(y) − E_q̂[∇log π_θ] (value
          unchanged), for every objective and correction.

        With vLLM (``use_vllm=True``), every weight sync is checked (:mod:`~offpolicy.integrations.trl.vllm_sync`):

        * ``sync_check`` — ``"error"`` (default: a sync after which the engine is far from the trainer raises
          ``SyncCheckError`` naming the step), ``"warn"``, a ``SyncCheck``, or None; its numbers are logged as
          ``sync/gap``, ``sync/baseline``, ``sync/ok``, ``sync/seconds``, ``sync/push_seconds``.
        * ``vllm_kwargs`` — extra ``vllm.LLM`` arguments for TRL's colocated engine (``dtype``, ``max_logprobs``…);
          on vLLM's CPU build ``enforce_eager=True`` by default, and the colocate sync goes through
          ``reload_weights`` (TRL's ``load_weights`` fails there).
        * ``vllm_server_sync`` — server mode: ``"auto"`` (TRL's NCCL transfer on a CUDA trainer, else files),
          ``"nccl"``, or ``"files"``: the weights written to ``vllm_weights_dir`` (a temporary folder by default; the
          server must read it) and reloaded through vLLM's dev-mode endpoints.
        """

        _last_loaded_step: int  # TRL's: the global step whose weights the vLLM engine holds
        entropy_coef: float  # TRL's: the entropy bonus's coefficient (moved by the adaptive controller)
        _last_world_entropy: float  # TRL's: the window entropy the adaptive controller last measured
        _entropy_window_stats: Tensor | None  # TRL's: [Σ H, tokens] of the accumulation window so far

        def __init__(
            self,
            *args: Any,
            correction: Correction | CorrectionSpec | list[CorrectionSpec] | None = None,
            objective: str | dict[str, Any] | None = None,
            aggregation: str | None = None,
            clip_low: float | None = None,
            clip_high: float | None = None,
            dual_clip: float | None = None,
            metric_naming: str = "trl",
            sampling_replay: bool = False,
            dvp_rho: float | None = None,
            alp: bool | dict[str, Any] | None = None,
            topk_logprobs: int = 0,
            topk_bound: str = "upper",
            score_centering: bool = False,
            memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
            sync_check: str | SyncCheck | None = "error",
            vllm_kwargs: dict[str, Any] | None = None,
            vllm_server_sync: str = "auto",
            vllm_weights_dir: str | None = None,
            **kwargs: Any,
        ) -> None:
            check_versions("trl", "torch", user="offpolicy's TRL trainer")  # before TRL's own init can fail on it
            check_naming(metric_naming)
            correction = correction if isinstance(correction, Correction) else build_correction(correction)
            if dvp_rho is not None and not (isinstance(dvp_rho, (int, float)) and 0 < dvp_rho <= 1):
                raise ValueError(f"dvp_rho must be in (0, 1], got {dvp_rho!r}")
            if isinstance(topk_logprobs, bool) or not isinstance(topk_logprobs, int) or topk_logprobs < 0:
                raise ValueError(f"topk_logprobs must be an int >= 0, got {topk_logprobs!r}")
            if topk_bound not in ("upper", "lower"):
                raise ValueError(f"topk_bound must be 'upper' (certified) or 'lower', got {topk_bound!r}")
            if not (isinstance(memory_budget_bytes, int) and memory_budget_bytes > 0):
                raise ValueError(f"memory_budget_bytes must be an int > 0, got {memory_budget_bytes!r}")
            alp_cfg = _check_alp(alp)
            _check_score_centering(score_centering, topk_logprobs, sampling_replay or dvp_rho is not None, alp_cfg)
            if dvp_rho is not None:
                args, kwargs = _with_min_p(args, kwargs, float(dvp_rho))
            check_sync_setting(sync_check)  # refuse a bad value before TRL builds its engine
            cfg = _grpo_args(args, kwargs)
            with extra_llm_kwargs(_colocate_llm_kwargs(cfg, vllm_kwargs, topk_logprobs)), \
                    server_sync_choice(cfg, vllm_server_sync):
                super().__init__(*args, **kwargs)
            train_args = getattr(self, "args", None)
            if getattr(train_args, "use_vllm", False):
                check_versions("vllm", user="offpolicy's TRL trainer")
            name, params = trl_objective(train_args, objective)
            refuse_contradictions(train_args, name, correction is not None, objective is not None)
            self.offpolicy_needs_rollout = needs_rollout_logp(correction, name)
            has_mu = getattr(train_args, "use_vllm", False) or getattr(self, "rollout_func", None) is not None
            if self.offpolicy_needs_rollout and not has_mu:
                raise ValueError("use_vllm: the engine's log-probs μ, which TRL has only from vLLM or a rollout_func "
                                 f"(HF generate gives none), are read by {', '.join(self.offpolicy_needs_rollout)}; set "
                                 "use_vllm=True or pass rollout_func=engine_rollout(...)")
            self.offpolicy_correction = correction
            self.offpolicy_metric_naming = metric_naming
            self.offpolicy_budget = memory_budget_bytes
            loss_type = getattr(train_args, "loss_type", None)
            # the generation batch's token normaliser applies only when the aggregation is TRL's own
            self._offpolicy_token_count = aggregation is None and loss_type in TOKEN_COUNT_NORMALISED
            trls_aggregation = aggregation is None
            if aggregation is None:
                aggregation = TRL_LOSS_TYPES.get(loss_type, "token_mean") if loss_type is not None else "token_mean"
            explicit = {"clip_low": clip_low, "clip_high": clip_high, "dual_clip": dual_clip}
            params.update({k: v for k, v in explicit.items() if v is not None})
            self.offpolicy_loss_kwargs: dict[str, Any] = {"objective": {"name": name, **params}, "aggregation": aggregation}
            if trls_aggregation and loss_type in TRL_MAX_TOKENS:  # luspo: Σ_t per sequence, mean over sequences
                self.offpolicy_loss_kwargs["max_tokens"] = TRL_MAX_TOKENS[loss_type]
            elif aggregation == "seq_mean_token_sum_norm":  # TRL's dr_grpo: B · max_completion_length
                self.offpolicy_loss_kwargs["max_tokens"] = getattr(train_args, "max_completion_length", None)
            # TRL's own loss (objective from loss_type, TRL's clip range): its loss-type weights and clip metrics apply
            self._offpolicy_trls_loss = objective is None
            self._offpolicy_trls_clip = objective is None and clip_low is None and clip_high is None
            self._offpolicy_cispo_cap = cispo_cap(train_args) if objective is None else None
            # TRL's sequence level on a PPO-family objective: one loss value per sequence (the geometric ratio's)
            self._offpolicy_sequence_constant = (getattr(train_args, "importance_sampling_level", "token") == "sequence"
                                                 and name in ("ppo", "gspo"))
            # sampling replay / DVP
            replay = sampling_replay or dvp_rho is not None
            self.offpolicy_recipe = trl_sampling_recipe(train_args) if replay else None
            self.offpolicy_order = ENGINE_ORDERS[trl_engine(train_args)]
            self._offpolicy_keep = dvp_keep() if replay else None
            # top-k TRM
            self.offpolicy_topk = topk_logprobs
            self.offpolicy_topk_bound = topk_bound
            self.offpolicy_score_centering = score_centering
            self._offpolicy_pending_topk: tuple | None = None
            # the certified bound's diagnostic (offpolicy.topk_advice): TRM with the upper bound on the top-K
            self.offpolicy_trm = _trm_thresholds(correction) if topk_logprobs and topk_bound == "upper" else None
            self.offpolicy_topk_advice: TopKAdvice | None = None  # the latest batch's
            self._offpolicy_warned_vacuous = False
            self._offpolicy_advice_ks: list[int] | None = None  # the K' tried, until the first update has run
            if self.offpolicy_trm is not None:
                vocab = int(getattr(getattr(getattr(self, "model", None), "config", None), "vocab_size", 0) or 0)
                self._offpolicy_advice_ks = doubling_ks(topk_logprobs, vocab) if vocab > topk_logprobs else []
            if topk_logprobs:
                self._check_topk(train_args)
            if replay or topk_logprobs:
                _check_plain_head(getattr(self, "model", None))
            self._check_logprobs_mode(train_args)
            # ALP
            self.offpolicy_alp: LayerwisePerturbation | None = None
            self.offpolicy_alp_level = "token"
            if alp_cfg is not None:
                self._build_alp(alp_cfg, aggregation, explicit)
                # ALP's unified-ratio loss replaces the objective: TRL's loss-type weights and clip metrics do not
                # describe it (TRL's masks, KL, entropy bonus and router loss still apply)
                self._offpolicy_trls_loss = self._offpolicy_trls_clip = False
                self._offpolicy_cispo_cap = None
            # the vLLM weight sync: through reload_weights on the CPU backend, verified after every sync
            self.offpolicy_sync: TRLSyncCheck | None = None
            if getattr(train_args, "use_vllm", False) and hasattr(getattr(self, "vllm_generation", None), "sync_weights"):
                file_sync = FileSync(self.vllm_generation, vllm_weights_dir) if uses_files(self.vllm_generation) else None
                self.offpolicy_sync = install_vllm_sync(self, sync_check, files=file_sync)

        # -- construction helpers --------------------------------------------------------------------------------
        def _check_topk(self, train_args: Any) -> None:
            if not getattr(train_args, "use_vllm", False):
                raise ValueError("topk_logprobs: only vLLM returns top-k log-probs in TRL; set use_vllm=True")
            if getattr(self, "tools", None) or getattr(self, "rollout_func", None) is not None \
                    or getattr(self, "environment_factories", None) is not None:
                raise ValueError("topk_logprobs: not carried through tool calls, rollout_func or environments")
            generation = getattr(self, "vllm_generation", None)
            if generation is not None:
                generation.logprobs = self.offpolicy_topk  # vLLM returns K (or K + 1) entries per token

        def _check_logprobs_mode(self, train_args: Any) -> None:
            """μ must be vLLM's processed log-probs; TRL checks the server only with its own IS correction on."""
            if not (getattr(train_args, "use_vllm", False) and getattr(train_args, "vllm_mode", None) == "server"):
                return
            accelerator = getattr(self, "accelerator", None)
            if accelerator is not None and not accelerator.is_main_process:
                return
            client = getattr(getattr(self, "vllm_generation", None), "vllm_client", None)
            if client is None:
                return
            mode = client.get_server_info()["model_config"]["logprobs_mode"]
            if mode != "processed_logprobs":
                raise ValueError(f"logprobs_mode: the vLLM server runs with --logprobs-mode {mode}; μ must be the "
                                 "sampling distribution: restart it with --logprobs-mode processed_logprobs")

        def _build_alp(self, cfg: dict[str, Any], aggregation: str, explicit: dict[str, Any]) -> None:
            if aggregation == "seq_mean_token_sum_norm":
                raise ValueError("alp: loss_type dr_grpo's / luspo's constant normaliser is not reproduced with "
                                 "ALP's loss; use another loss_type or aggregation")
            if cfg.get("layers", "all") == "logits":  # TRL's fused head never calls the lm_head module
                raise ValueError("alp: layers='logits' hooks the lm_head module, which TRL's fused head bypasses; "
                                 "use 'all' or layer indices")
            level = cfg.get("level", "token")
            low, high = alp_clip_defaults(level)  # validates level
            model = self.model
            alp = LayerwisePerturbation(model, layers=cfg.get("layers", "all"),
                                        init_std=cfg.get("init_std", DEFAULT_INIT_STD),
                                        layers_path=cfg.get("layers_path"), seed=cfg.get("seed"))
            device = next(model.parameters()).device
            self.offpolicy_alp = alp.to(device)
            self.offpolicy_alp_level = level
            self.offpolicy_alp_lr = float(cfg.get("lr", DEFAULT_LR))
            delta = getattr(self.args, "delta", None)
            self.offpolicy_alp_clip = {
                "clip_low": low if explicit["clip_low"] is None else explicit["clip_low"],
                "clip_high": high if explicit["clip_high"] is None else explicit["clip_high"],
                "dual_clip": explicit["dual_clip"] if explicit["dual_clip"] is not None
                else (delta if delta is not None else 10.0),
            }
            if hasattr(self, "add_callback"):
                self.add_callback(alp_callback(self.offpolicy_alp))

        # -- TRL's extension points -------------------------------------------------------------------------------
        def create_optimizer(self, *args: Any, **kwargs: Any) -> Any:
            """TRL's optimiser plus σ's own group (lr ``alp["lr"]``, no weight decay) when ALP is on."""
            optimizer = super().create_optimizer(*args, **kwargs)
            if self.offpolicy_alp is not None and not any(g.get("name") == "alp" for g in optimizer.param_groups):
                optimizer.add_param_group(self.offpolicy_alp.param_group(lr=self.offpolicy_alp_lr))
            return optimizer

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            super()._save_checkpoint(model, trial)
            if self.offpolicy_alp is not None and self.args.should_save:
                from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

                folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
                save_alp(self.offpolicy_alp, folder)

        def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
            super()._load_optimizer_and_scheduler(checkpoint)
            if self.offpolicy_alp is not None and checkpoint is not None:
                load_alp(self.offpolicy_alp, checkpoint)

        def _generate_single_turn(self, prompt_ids: Any, images: Any, multimodal_fields: Any, num_generations: int,
                                  has_tool_images: bool = False) -> Any:
            if not self.offpolicy_topk:
                return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                     has_tool_images)
            # TRL's vLLM branch, keeping the sampled token's log-prob (TRL keeps lp[0], the top-1's, when K > 0)
            if self.state.global_step != self._last_loaded_step:
                self.vllm_generation.sync_weights()
                self._last_loaded_step = self.state.global_step
            _, completion_ids, logprobs, token_ids = self.vllm_generation.generate(
                prompts=prompt_ids, images=images, num_generations=num_generations)
            if logprobs is None or token_ids is None:
                raise ValueError("logprob_token_ids: the vLLM engine returned no log-prob ids; topk_logprobs needs them")
            sampled, top_lp, top_ids = sampled_token_logprobs(logprobs, token_ids, completion_ids, self.offpolicy_topk)
            self._offpolicy_pending_topk = (top_lp, top_ids)
            return completion_ids, sampled

        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            self._offpolicy_pending_topk = None
            output = super()._generate_and_score_completions(inputs)
            if self.offpolicy_topk:
                if self._offpolicy_pending_topk is None:
                    raise ValueError("topk_logprobs: no top-k log-probs came back from generation")
                top_lp, top_ids = self._offpolicy_pending_topk
                completion = output["completion_ids"]
                output[TOPK_LOGP_KEY], output[TOPK_IDS_KEY] = pad_topk(
                    top_lp, top_ids, completion.shape[1], self.offpolicy_topk, completion.device)
                self._offpolicy_pending_topk = None
            return output

        def _get_per_token_logps_and_entropies(self, model: Any, input_ids: Tensor, attention_mask: Tensor,
                                               logits_to_keep: int, batch_size: int | None = None,
                                               compute_entropy: bool = False, compute_aux_loss: bool = False,
                                               **model_inputs: Any) -> tuple[Tensor, Tensor | None, Tensor | None]:
            if self.offpolicy_recipe is None:
                return super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                    compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **model_inputs)
            s = self._offpolicy_scores(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                                       compute_aux_loss=compute_aux_loss, compute_entropy=compute_entropy,
                                       **model_inputs)
            return s.logp, s.entropy, s.aux_loss

        # -- the forward ------------------------------------------------------------------------------------------
        def _offpolicy_scores(self, model: Any, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int, *,
                              batch_size: int | None = None, compute_aux_loss: bool = False,
                              compute_entropy: bool = False,
                              topk: tuple[Tensor | None, Tensor | None] | None = None,
                              **model_inputs: Any) -> Scores:
            """Per-token scores ``[B, T]`` of the completion tokens: TRL's model call (its fused head; labels all
            ignored when the replay recomputes the head) with the backbone's last hidden state captured, then the
            replayed log-probs and the top-k bounds from it, chunked. ``compute_entropy``: the entropy of the
            distribution the tokens are scored under (TRL's fused head's, or on the replayed support), with a
            gradient only when TRL's entropy bonus is on."""
            if any(v is not None for v in model_inputs.values()):
                raise ValueError("model inputs: vision inputs are not supported with sampling replay or top-k TRM")
            recipe = self.offpolicy_recipe
            unwrapped = self.accelerator.unwrap_model(model) if hasattr(self, "accelerator") else model
            backbone, weight, bias = _backbone_and_head(unwrapped)
            captured: dict[str, Tensor] = {}

            def grab(module: Any, args: Any, output: Any) -> None:
                captured["h"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

            t_len = logits_to_keep
            batch_size = batch_size or input_ids.size(0)
            parts: list[Scores] = []
            for start in range(0, input_ids.size(0), batch_size):
                ids = input_ids[start:start + batch_size]
                att = attention_mask[start:start + batch_size]
                labels = ids.masked_fill(att == 0, -100)
                labels[:, :-t_len] = -100
                extra: dict[str, Any] = {"output_router_logits": True} if compute_aux_loss else {}
                if recipe is not None:
                    # the replay recomputes the head: the model's own forward with one position's logits (TRL's
                    # fused head would score every position off CUDA, where it does not drop the ignored labels)
                    extra.update(fused_lm_head=False, logits_to_keep=1, use_cache=False)
                else:
                    extra.update(fused_lm_head=True, labels=labels)
                handle = backbone.register_forward_hook(grab)
                try:
                    autocast = self.accelerator.autocast() if hasattr(self, "accelerator") else nullcontext()
                    with autocast:
                        out = model(input_ids=ids, attention_mask=att, **extra)
                finally:
                    handle.remove()
                valid = att[:, -t_len:].bool()
                targets = ids[:, -t_len:]
                rows = valid.reshape(-1).nonzero().squeeze(-1)
                h = captured.pop("h")[:, -t_len - 1:-1].reshape(-1, weight.shape[1])[rows]
                y = targets.reshape(-1)[rows]
                n_all = valid.numel()
                if recipe is not None:
                    history = None
                    if recipe.reads_history:
                        # HF generate's repetition penalty sees the left-padded prompt (pad tokens too); vLLM
                        # sees the prompt alone
                        prompt, seen = ids[:, :-t_len], att[:, :-t_len].bool()
                        if self.offpolicy_order != ENGINE_ORDERS["vllm"]:
                            seen = torch.ones_like(seen)
                        prompts = [p[k].tolist() for p, k in zip(prompt, seen)]
                        history = ReplayHistory(prompts, targets, valid, rows)
                    r = replay_logp(h, weight, y, recipe, order=self.offpolicy_order, bias=bias, history=history,
                                    memory_budget_bytes=self.offpolicy_budget)
                    logp = r.logp.new_zeros(n_all).index_copy(0, rows, r.logp).reshape(valid.shape)
                    inside = torch.ones(n_all, dtype=torch.bool, device=ids.device).index_copy(0, rows, r.inside)
                    mass = torch.ones(n_all, device=ids.device).index_copy(0, rows, r.mass.float())
                    inside, mass = inside.reshape(valid.shape), mass.reshape(valid.shape)
                    entropy = None
                    if compute_entropy:  # the bonus differentiates it; the metric and the quantile mask do not
                        with torch.set_grad_enabled(torch.is_grad_enabled() and self._offpolicy_entropy_grad()):
                            e = replay_entropy(h, weight, recipe, order=self.offpolicy_order, bias=bias,
                                               history=history, memory_budget_bytes=self.offpolicy_budget)
                        entropy = e.new_zeros(n_all).index_copy(0, rows, e).reshape(valid.shape)
                else:
                    logp = out.log_probs[:, -t_len:]
                    inside = torch.ones_like(valid)
                    mass = torch.ones(valid.shape, device=ids.device)
                    entropy = out.entropy[:, -t_len:] if compute_entropy else None
                lower = upper = center = own = None
                if topk is not None and topk[0] is not None:
                    topk_ids = topk[1]
                    assert topk_ids is not None  # stored with the log-probs (_generate_single_turn)
                    lp_k = topk[0][start:start + batch_size].reshape(n_all, -1)[rows]
                    id_k = topk_ids[start:start + batch_size].reshape(n_all, -1)[rows]
                    temperature = float(getattr(self.args, "temperature", 1.0) or 1.0)
                    lo, up = topk_divergence(h.detach(), weight.detach(), lp_k, id_k,
                                             bias=None if bias is None else bias.detach(), temperature=temperature,
                                             memory_budget_bytes=self.offpolicy_budget)
                    lower = lo.new_zeros(n_all).index_copy(0, rows, lo).reshape(valid.shape)
                    upper = up.new_zeros(n_all).index_copy(0, rows, up).reshape(valid.shape)
                    if self.offpolicy_score_centering:  # differentiable: the update forward's centre
                        c = topk_score_center(h, weight, lp_k, id_k, bias=bias, temperature=temperature,
                                              memory_budget_bytes=self.offpolicy_budget)
                        center = c.new_zeros(n_all).index_copy(0, rows, c).reshape(valid.shape)
                    if start == 0 and self._offpolicy_advice_ks and torch.is_grad_enabled():  # first update only
                        own = own_slack_rows(h.detach(), weight.detach(), rows, (valid.shape[0], valid.shape[1]),
                                             self._offpolicy_advice_ks, bias=None if bias is None else bias.detach(),
                                             temperature=temperature, memory_budget_bytes=self.offpolicy_budget)
                parts.append(Scores(logp, inside, mass, lower, upper, getattr(out, "aux_loss", None), center,
                                    own if start == 0 and topk is not None else None, entropy))

            def cat(name: str) -> Tensor | None:
                values = [getattr(p, name) for p in parts]
                return None if values[0] is None else torch.cat(values)

            def cat_present(name: str) -> Tensor:
                out = cat(name)
                assert out is not None, name  # set on every part
                return out

            aux: Tensor | None = None
            if compute_aux_loss:
                aux_losses: list[Tensor] = []
                for p in parts:
                    assert p.aux_loss is not None, "compute_aux_loss: the model returned no aux_loss"
                    aux_losses.append(p.aux_loss)
                aux = torch.stack(aux_losses).mean()
            return Scores(cat_present("logp"), cat_present("inside"), cat_present("mass"), cat("kl_lower"),
                          cat("kl_upper"), aux, cat("center"), parts[0].own_slack, cat("entropy"))

        def _offpolicy_entropy_grad(self) -> bool:
            """TRL's entropy bonus is on (static ``entropy_coef`` ≠ 0 or adaptive): the entropy needs its gradient."""
            return bool(getattr(self, "_entropy_bonus_enabled", False))

        # -- the loss ---------------------------------------------------------------------------------------------
        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
            """TRL's loss (:mod:`~offpolicy.integrations.trl.terms`): offpolicy's objective × the correction chain
            (the user's, DVP's support, TRL's masks and loss-type weights) aggregated as ``loss_type`` does, plus
            β·KL to the reference, minus the entropy bonus, plus the MoE router loss; TRL's metrics under TRL's
            names (``entropy``, ``kl``, ``aux_loss``, ``clip_ratio/…``, ``cispo_clip_ratio``, ``vespo/phi_seq_mean``,
            ``policy_loss``, ``entropy_coef``), offpolicy's under ``offpolicy/…``."""
            input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            logits_to_keep = inputs["completion_ids"].size(1)
            aux_enabled = bool(getattr(self, "aux_loss_enabled", False))
            alp = self.offpolicy_alp
            topk: tuple[Tensor | None, Tensor | None] | None = (
                (inputs.get(TOPK_LOGP_KEY), inputs.get(TOPK_IDS_KEY)) if self.offpolicy_topk else None)
            custom = self.offpolicy_recipe is not None or topk is not None
            # ALP's noise: the update forward only (π_old and μ come from the unperturbed model)
            noisy = alp.active(model.training and torch.is_grad_enabled()) if alp is not None else nullcontext()
            with noisy:  # the entropy as TRL's vanilla loss computes it: for its metric, quantile mask and bonus
                if custom:
                    s = self._offpolicy_scores(model, input_ids, attention_mask, logits_to_keep,
                                               compute_aux_loss=aux_enabled, compute_entropy=True, topk=topk,
                                               **{k: inputs.get(k) for k in _MODEL_INPUT_KEYS})
                    per_token_logps, aux_loss, entropies = s.logp, s.aux_loss, s.entropy
                else:
                    per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
                        model, input_ids, attention_mask, logits_to_keep, compute_entropy=True,
                        compute_aux_loss=aux_enabled, **{k: inputs.get(k) for k in _MODEL_INPUT_KEYS},
                    )
            if self.offpolicy_needs_rollout and inputs.get("sampling_per_token_logps") is None:
                raise ValueError("sampling_per_token_logps: TRL's batch has no vLLM log-probs μ, which "
                                 f"{', '.join(self.offpolicy_needs_rollout)} read (a rollout_func without logprobs?)")
            if custom and s.center is not None:  # score centering: same value, centred score as gradient
                per_token_logps = centered_logp(per_token_logps, s.center)
            batch = batch_from_trl_inputs(per_token_logps, inputs)
            extra: dict[str, Any] = {}
            if self.offpolicy_recipe is not None:
                extra["extras"] = {"dvp_keep": s.inside, "dvp_mass": s.mass}
            if topk is not None and s.kl_upper is not None:
                extra["token_divergence"] = s.kl_upper if self.offpolicy_topk_bound == "upper" else s.kl_lower
                extra["token_divergence_kind"] = "topk"
            if extra:
                batch = batch.replace(**extra)
            mode = "train" if model.training else "eval"
            mask = _loss_mask(inputs)
            args = self.args
            level = getattr(args, "importance_sampling_level", "token")
            old = inputs.get("old_per_token_logps")
            log_weight = trl_log_weight(per_token_logps, per_token_logps.detach() if old is None else old, mask, level)
            advantages = inputs["advantages"]
            advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
            entropy_mask = None
            if float(getattr(args, "top_entropy_quantile", 1.0)) < 1.0:  # TRL's own quantile (gathered over ranks)
                assert entropies is not None  # computed above
                entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - args.top_entropy_quantile)
            trl_terms, phi = self._trl_coefficients(inputs, per_token_logps, log_weight, advantages, mask,
                                                    entropy_mask)
            correction = self.offpolicy_correction
            if trl_terms is not None:
                correction = trl_terms if correction is None else chain(trl_terms, correction)
            if self._offpolicy_keep is not None:
                correction = self._offpolicy_keep if correction is None else chain(self._offpolicy_keep, correction)
            if alp is not None:
                loss, metrics = alp_policy_loss(batch, level=self.offpolicy_alp_level, correction=correction,
                                                aggregation=self.offpolicy_loss_kwargs["aggregation"],
                                                **self.offpolicy_alp_clip)
            else:
                loss, metrics = policy_loss(batch, correction=correction, **self.offpolicy_loss_kwargs)
            beta = float(getattr(args, "beta", 0.0) or 0.0)
            per_token_kl = None
            if beta != 0.0:  # added after TRL's masks and weights, aggregated as the policy term
                per_token_kl = kl_to_reference(per_token_logps, inputs["ref_per_token_logps"],
                                               torch.exp(log_weight) if getattr(args, "use_bias_correction_kl", False)
                                               else None)
                kept = mask.bool()
                aggregate = AGGREGATIONS[self.offpolicy_loss_kwargs["aggregation"]]
                loss = loss + beta * aggregate(torch.where(kept, per_token_kl.float(), 0.0), kept,
                                               self.offpolicy_loss_kwargs.get("max_tokens"))
            aggregated = loss
            loss = self._trl_normalise(loss, inputs, mode)
            if getattr(self, "_entropy_bonus_enabled", False):
                assert entropies is not None  # computed above
                # TRL logs the policy term as its loss_type aggregates it (before the accumulation divisor)
                policy_value = loss if self._offpolicy_token_count else aggregated
                loss = loss - self._trl_entropy_bonus(entropies, mask, entropy_mask, policy_value.detach(), mode)
            if aux_enabled:  # MoE router loss, scaled for accumulation as TRL does
                assert aux_loss is not None  # aux_loss_enabled
                loss = loss + self.router_aux_loss_coef * aux_loss / self._accumulation(mode)
                self._metrics[mode]["aux_loss"].append(self._gather(aux_loss.detach()).mean().item())
            self._trl_metrics(mode, mask, entropies, per_token_kl, log_weight, advantages, phi)
            if alp is not None:
                metrics.update(alp.metrics())
            if topk is not None and s.kl_upper is not None:
                m = batch.bool_mask
                assert s.kl_lower is not None  # computed together with kl_upper
                metrics.update({"topk/kl_lower_mean": masked_mean(s.kl_lower, m),
                                "topk/kl_upper_mean": masked_mean(s.kl_upper, m),
                                "topk/kl_upper_max": masked_max(s.kl_upper, m)})
                if s.center is not None and topk[0] is not None:  # how much of q the top-K holds (the rest: κ·p)
                    metrics["score_centering/head_mass_q"] = masked_mean(topk[0].exp().sum(-1), m)
                if self.offpolicy_trm is not None and topk[0] is not None:
                    metrics.update(self._topk_advice(s, m, topk[0]))
            for name, value in metrics.items():  # the logging boundary: one sync per metric per step, as TRL does
                self._metrics[mode][f"offpolicy/{name}"].append(float(value.detach()))
            if old is None and self.offpolicy_alp is None:  # one update per generation: π_old is π_θ detached (TRL)
                old = per_token_logps.detach()  # (under ALP π_θ carries the noise: no noise-free π_old to compare)
            trl_logs_is = self._trl_is_on() and self.offpolicy_metric_naming == "trl"  # TRL logs its sampling/…
            if inputs.get("sampling_per_token_logps") is not None and old is not None and not trl_logs_is:
                mismatch = offpolicy_metrics(old, inputs["sampling_per_token_logps"], _loss_mask(inputs),
                                             naming=self.offpolicy_metric_naming)
                for name, value in mismatch.items():
                    self._metrics[mode][name].append(float(value))
            return loss

        def _trl_is_on(self) -> bool:
            return bool(getattr(self.args, "use_vllm", False)
                        and getattr(self.args, "vllm_importance_sampling_correction", False))

        def _trl_coefficients(self, inputs: dict[str, Any], logp: Tensor, log_weight: Tensor, advantages: Tensor,
                              mask: Tensor, entropy_mask: Tensor | None) -> tuple[Correction | None, Tensor | None]:
            """TRL's per-token factors on the objective's term as one correction (None when there are none), and
            VESPO's φ [B, 1] (for its metric): CISPO's cap below 1, VESPO's φ(w) (TRL's ``get_gamma_weights``), the
            off-policy mask (TRL's ``get_off_policy_mask``: μ vs π_θ, NaN tokens count 0), the entropy-quantile
            mask and TRL's vLLM importance weight (``importance_sampling_ratio``; VESPO reads it inside φ)."""
            args = self.args
            loss_type = getattr(args, "loss_type", None)
            weights: list[Tensor] = []
            keeps: list[Tensor] = []
            phi = None
            if self._offpolicy_cispo_cap is not None:  # −sg[min(r, cap)]·A·log π: REINFORCE × the capped weight
                weights.append(torch.clamp(torch.exp(log_weight.detach()), max=self._offpolicy_cispo_cap))
            if loss_type == "vespo" and self._offpolicy_trls_loss:
                old = inputs.get("old_per_token_logps")
                phi = self.get_gamma_weights(
                    advantages=advantages, log_ratio_per_token=logp - (logp.detach() if old is None else old),
                    mask=mask, importance_sampling_ratio=inputs.get("importance_sampling_ratio"),
                    k_pos=args.vespo_k_pos, lambda_pos=args.vespo_lambda_pos, k_neg=args.vespo_k_neg,
                    lambda_neg=args.vespo_lambda_neg)
                weights.append(phi)
            threshold = getattr(args, "off_policy_mask_threshold", None)
            if threshold is not None:
                old = inputs.get("old_per_token_logps")
                old = logp.detach() if old is None else old
                mu = inputs.get("sampling_per_token_logps")
                keeps.append(self.get_off_policy_mask(advantages=advantages, per_token_logps=logp,
                                                      sampling_per_token_logps=old if mu is None else mu, mask=mask,
                                                      off_policy_threshold=threshold).bool())
            if entropy_mask is not None:
                keeps.append(entropy_mask.bool())
            if self._trl_is_on() and loss_type != "vespo":
                weights.append(inputs["importance_sampling_ratio"])
            if not weights and not keeps:
                return None, phi
            w = None
            for x in weights:
                w = x.detach().float() if w is None else w * x.detach().float()
            k = None
            for y in keeps:
                k = y if k is None else k & y
            if self._offpolicy_sequence_constant and (w is not None and w.shape[-1] > 1 or
                                                      k is not None and k.shape[-1] > 1):
                # TRL multiplies its [B, 1] sequence-level loss by per-token factors c_t, so the sequence ratio's
                # gradient reaches every token scaled by their mean; the GSPO-token form gives each token its own c_t.
                # The per-sequence mean c̄ (over the loss mask) on every token gives TRL's value and gradient.
                c = torch.ones_like(mask, dtype=torch.float32) if w is None else w.expand(mask.shape).float()
                c = c if k is None else c * k.expand(mask.shape).float()
                m = mask.float()
                w, k = ((c * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)), None
            return coefficient("trl", w, k, weight_level="mixed" if w is not None else None), phi

        def _trl_entropy_bonus(self, entropies: Tensor, mask: Tensor, entropy_mask: Tensor | None,
                               policy_value: Tensor, mode: str) -> Tensor:
            """TRL's entropy bonus c_H · H̄ (to subtract from the loss): H̄ the mean entropy over the tokens the
            policy term acts on, divided by the accumulation steps; c_H ``entropy_coef``, or under
            ``use_adaptive_entropy`` the coefficient TRL's controller set at the previous optimiser step (0 while the
            window's entropy is above ``entropy_target``). Updates the controller and logs ``policy_loss`` and
            ``entropy_coef`` as TRL does."""
            args = self.args
            effective = mask if entropy_mask is None else mask * entropy_mask
            bonus = (entropies * effective).sum() / effective.sum().clamp(min=1.0) / self._accumulation(mode)
            adaptive = bool(getattr(args, "use_adaptive_entropy", False))
            if adaptive:
                coef = self.entropy_coef if self._last_world_entropy <= args.entropy_target else 0.0
            else:
                coef = self.entropy_coef
            self._metrics[mode]["policy_loss"].append(self._gather(policy_value).nanmean().item())
            sync = bool(getattr(getattr(self, "accelerator", None), "sync_gradients", True))
            if adaptive and mode == "train":  # the window's entropy: summed over micro-batches, reduced over ranks
                stats = torch.stack([(entropies * effective).sum(), effective.sum()]).detach()
                window = getattr(self, "_entropy_window_stats", None)
                self._entropy_window_stats = stats if window is None else window + stats
                if sync:
                    total = self._reduce_sum(self._entropy_window_stats)
                    world = (total[0] / total[1].clamp(min=1.0)).item()
                    if world <= args.entropy_target:
                        self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
                    else:
                        self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
                    self._last_world_entropy = world
                    self._entropy_window_stats = None
            if mode == "train" and sync:
                self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
            return coef * bonus

        def _trl_metrics(self, mode: str, mask: Tensor, entropies: Tensor | None, per_token_kl: Tensor | None,
                         log_weight: Tensor, advantages: Tensor, phi: Tensor | None) -> None:
            """TRL's own metrics, global masked means over the ranks: ``kl``, ``entropy``, and for TRL's own loss
            its clip fractions (``clip_ratio/…`` for the PPO family, ``cispo_clip_ratio``) or VESPO's mean φ."""
            logged = self._metrics[mode]

            def global_mean(x: Tensor) -> float:
                total = self._reduce_sum(masked_stats(x, mask))
                return (total[0] / total[1].clamp(min=1.0)).item()

            if per_token_kl is not None:
                logged["kl"].append(global_mean(per_token_kl))
            if entropies is not None:
                logged["entropy"].append(global_mean(entropies))
            loss_type = getattr(self.args, "loss_type", None)
            if phi is not None:
                logged["vespo/phi_seq_mean"].append(global_mean(phi))
            if not self._offpolicy_trls_clip or loss_type not in TRL_CLIPPED:
                return
            eps_low = float(getattr(self, "epsilon_low", self.args.epsilon))
            eps_high = float(getattr(self, "epsilon_high", getattr(self.args, "epsilon_high", None) or eps_low))
            delta = getattr(self.args, "delta", None)
            if delta is not None and loss_type != "cispo":  # TRL counts its clips on r clamped at δ
                log_weight = log_weight.clamp(max=math.log(delta))
            held = clip_fractions(log_weight, advantages, loss_type, eps_low, eps_high)
            if loss_type == "cispo":
                logged["cispo_clip_ratio"].append(global_mean(held["cispo"].float()))
                return
            for name in ("low", "high", "region"):
                logged[f"clip_ratio/{name}_mean"].append(global_mean(held[name].float()))
            low = self._gather(sequence_means(held["low"].float(), mask))
            high = self._gather(sequence_means(held["high"].float(), mask))
            logged["clip_ratio/low_min"].append(_nan_reduce(low, torch.amin))
            logged["clip_ratio/high_max"].append(_nan_reduce(high, torch.amax))

        def _reduce_sum(self, x: Tensor) -> Tensor:
            accelerator = getattr(self, "accelerator", None)
            return x if accelerator is None else accelerator.reduce(x, reduction="sum")

        def _gather(self, x: Tensor) -> Tensor:
            accelerator = getattr(self, "accelerator", None)
            return x.reshape(-1) if accelerator is None else accelerator.gather(x).reshape(-1)

        def _topk_advice(self, s: Scores, mask: Tensor, topk_logp: Tensor) -> dict[str, Any]:
            """The certified bound's diagnostic on this batch (:mod:`offpolicy.topk_advice`): its metrics, and one
            warning the first time the bound is vacuous. The suggested K is estimated on the first update."""
            assert s.kl_lower is not None and s.kl_upper is not None and self.offpolicy_trm is not None
            max_kl, avg_kl = self.offpolicy_trm
            ks = self._offpolicy_advice_ks or []
            own = s.own_slack if s.own_slack is not None and ks else None
            advice = topk_advice(s.kl_lower.detach(), s.kl_upper.detach(), mask, topk_logp, max_kl=max_kl,
                                 avg_kl=avg_kl, own_slack=own, ks=ks if own is not None else ())
            if own is not None:
                self._offpolicy_advice_ks = None
            elif self.offpolicy_topk_advice is not None:
                first = self.offpolicy_topk_advice
                advice = dataclasses.replace(advice, suggested_k=first.suggested_k,
                                             suggested_k_max_only=first.suggested_k_max_only)
            if advice.vacuous and not self._offpolicy_warned_vacuous:
                warnings.warn(advice.message(), stacklevel=2)
                self._offpolicy_warned_vacuous = True
            self.offpolicy_topk_advice = advice
            return {"topk/head_mass": torch.tensor(advice.head_mass), "topk/slack_mean": torch.tensor(advice.slack),
                    "topk/certifiable_frac": torch.tensor(advice.certifiable)}

        def _accumulation(self, mode: str) -> float:
            return float(getattr(self, "current_gradient_accumulation_steps", 1) or 1) if mode == "train" else 1.0

        def _trl_normalise(self, loss: Tensor, inputs: dict[str, Any], mode: str) -> Tensor:
            """TRL's own loss scaling (HF auto-scaling is off for GRPOTrainer): a per-micro-batch mean divided by the
            accumulation steps; dapo's Σ over the micro-batch divided by the generation batch's token count, rescaled
            to one accumulation window."""
            if not self._offpolicy_token_count or "num_items_in_batch" not in inputs:
                return loss / self._accumulation(mode)
            mask = _loss_mask(inputs)
            processes = getattr(getattr(self, "accelerator", None), "num_processes", 1)
            normaliser = torch.as_tensor(inputs["num_items_in_batch"]).float().clamp(min=1.0) / processes
            if mode == "train":
                normaliser = normaliser * self._accumulation(mode) / self.args.steps_per_generation
            return loss * (mask.sum().float() / normaliser)  # token mean × tokens = Σ; then TRL's divisor

    return OffPolicyGRPOTrainer
