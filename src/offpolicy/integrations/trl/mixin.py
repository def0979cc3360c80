"""``OffPolicyGRPOMixin``: what turns TRL's ``GRPOTrainer`` into offpolicy's — the loss, sampling replay / DVP, ALP,
top-k TRM and the vLLM sync check — as a class that imports no TRL; ``OffPolicyGRPOTrainer``
(:mod:`offpolicy.integrations.trl.grpo`) is ``class OffPolicyGRPOTrainer(OffPolicyGRPOMixin, GRPOTrainer)``, and a
user's own ``GRPOTrainer`` subclass composes the same way: ``class Mine(OffPolicyGRPOMixin, MyGRPOTrainer)``.

The mixin holds the constructor (the settings, checked before TRL's constructor runs) and the loss; its parts
(:mod:`offpolicy.integrations.trl.parts`) each override one family of TRL's methods and reach TRL's own through
``super()``:

* the loss — ``_compute_loss`` (:func:`~offpolicy.integrations.trl.loss.trl_policy_loss`'s batch, the correction
  chain, TRL's terms and normalisers: :mod:`~offpolicy.integrations.trl.parts.terms`);
* sampling replay / DVP — ``_get_per_token_logps_and_entropies`` (every π_old forward) and ``_compute_loss`` (the
  π_θ forward) score under the engine's recipe (:mod:`~offpolicy.integrations.trl.parts.scoring`); DVP sets
  ``min_p = ρ`` in the ``GRPOConfig`` before TRL builds its engines;
* ALP — hooks on the decoder layers switched on only around the update forward, σ's group added in
  ``create_optimizer``, σ saved in ``_save_checkpoint`` and restored in ``_load_optimizer_and_scheduler``
  (:mod:`~offpolicy.integrations.trl.parts.alp`);
* top-k TRM — ``_generate_single_turn`` asks vLLM for K log-probs and takes the sampled token's entry,
  ``_generate_and_score_completions`` puts the top-k into TRL's batch (:mod:`~offpolicy.integrations.trl.parts.topk`);
* the vLLM weight sync — ``VLLMGeneration.sync_weights`` replaced on the instance: through ``reload_weights`` on
  vLLM's CPU backend, and checked after every sync (:mod:`~offpolicy.integrations.trl.parts.vllm`);
* resume — the method settings saved in ``_save_checkpoint`` and compared in ``train(resume_from_checkpoint=...)``
  (:mod:`~offpolicy.integrations.trl.parts.resume`).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from offpolicy.batch import nonfinite_rollout_limit
from offpolicy.corrections.base import Correction, chain
from offpolicy.integrations.trl.loss import (
    _MODEL_INPUT_KEYS,
    TOKEN_COUNT_NORMALISED,
    TRL_LOSS_TYPES,
    TRL_MAX_TOKENS,
    _loss_mask,
    batch_from_trl_inputs,
    refuse_contradictions,
    trl_objective,
)
from offpolicy.integrations.trl.parts.alp import ALPWiring, _check_alp
from offpolicy.integrations.trl.parts.resume import ResumeCheck, _check_allowed, trl_recipe
from offpolicy.integrations.trl.parts.scoring import ReplayScoring, _check_plain_head, _grpo_args, _with_min_p
from offpolicy.integrations.trl.parts.sharding import head_options, model_sharding, refuse_sharded_head
from offpolicy.integrations.trl.parts.terms import TRLTerms
from offpolicy.integrations.trl.parts.topk import TopKGeneration, _check_score_centering
from offpolicy.integrations.trl.parts.transforms import trl_transforms
from offpolicy.integrations.trl.parts.vllm import VLLMWiring, _colocate_llm_kwargs
from offpolicy.integrations.trl.patches import check_request_timeout, extra_llm_kwargs, server_sync_choice
from offpolicy.integrations.trl.ranks import every_rank_raises
from offpolicy.integrations.trl.terms import kl_to_reference, trl_log_weight
from offpolicy.integrations.trl.topk import TOPK_IDS_KEY, TOPK_LOGP_KEY
from offpolicy.integrations.trl.vllm_sync import check_sync_setting
from offpolicy.integrations.versions import check_versions
from offpolicy.kernels.chunking import DEFAULT_MEMORY_BUDGET_BYTES
from offpolicy.losses import needs_rollout_logp, policy_loss
from offpolicy.metrics import check_naming, offpolicy_metrics
from offpolicy.perturbation import alp_policy_loss
from offpolicy.registry import AGGREGATIONS, CorrectionSpec, build_correction
from offpolicy.rollout.sync_check import SyncCheck
from offpolicy.transforms import apply_transforms, forward_extras

__all__ = ["OffPolicyGRPOMixin"]


class OffPolicyGRPOMixin(ReplayScoring, TopKGeneration, ALPWiring, TRLTerms, VLLMWiring, ResumeCheck):
    """In front of a ``GRPOTrainer`` (``class T(OffPolicyGRPOMixin, GRPOTrainer)``: ``OffPolicyGRPOTrainer``, or one's
    own subclass of it), the loss is :func:`offpolicy.policy_loss` with an offpolicy correction chain.

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
    * ``vllm_request_timeout`` — server mode: seconds each request of TRL's vLLM client (generation, the weight
      push) may take before an error names the server, the request and the step (TRL's client sets none: a hung
      server would hold training forever); None (default) is ``GRPOConfig.vllm_server_timeout`` (240 s). Raise it
      when one generation batch takes longer.

    ``max_nonfinite_rollout`` — the largest share of a batch's valid tokens whose vLLM log-prob μ may be NaN / ±inf
    (left out of the loss, counted); past it the loss is refused naming this keyword. None (default):
    ``OFFPOLICY_MAX_NONFINITE_ROLLOUT``, else 1e-3; 1: no limit.

    ``recipe=`` — a :class:`~offpolicy.Recipe`, a mapping or a YAML / JSON file path — sets the method in one
    schema instead of the keywords above; it is mapped onto them through one table
    (:data:`offpolicy.recipe.hosts.OLD_SPELLINGS`), and a keyword that says otherwise is refused naming both. A
    recipe's plug-in transforms (:func:`offpolicy.register_transform`) run on every loss batch after the built-ins'
    batch steps (:func:`offpolicy.transforms.apply_transforms`); one whose input this run cannot fetch is refused.

    ``train(resume_from_checkpoint=...)`` refuses a checkpoint saved with other method settings (the correction,
    the objective and its clip range, the transforms), naming each; ``allow_changed=["correction.upper", …]``
    resumes with the new values and records them in ``output_dir/offpolicy_settings_changes.jsonl``.
    """

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
        vllm_request_timeout: float | None = None,
        max_nonfinite_rollout: float | None = None,
        allow_changed: list[str] | None = None,
        recipe: Any = None,
        **kwargs: Any,
    ) -> None:
        check_versions("trl", "torch", user="offpolicy's TRL trainer")  # before TRL's own init can fail on it
        the_recipe = None
        if recipe is not None:  # a Recipe, a mapping or a path: mapped onto the keywords below (recipe.hosts)
            from offpolicy.recipe import Recipe
            from offpolicy.recipe.hosts import trl_keywords

            the_recipe = Recipe.load(recipe, where="OffPolicyGRPOTrainer: recipe")
            mapped = trl_keywords(the_recipe, {
                "correction": correction, "objective": objective, "aggregation": aggregation, "clip_low": clip_low,
                "clip_high": clip_high, "dual_clip": dual_clip, "metric_naming": metric_naming,
                "sampling_replay": sampling_replay, "dvp_rho": dvp_rho, "alp": alp, "topk_logprobs": topk_logprobs,
                "topk_bound": topk_bound, "score_centering": score_centering, "sync_check": sync_check})
            correction, objective, aggregation = mapped["correction"], mapped["objective"], mapped["aggregation"]
            clip_low, clip_high, dual_clip = mapped["clip_low"], mapped["clip_high"], mapped["dual_clip"]
            metric_naming, sampling_replay, dvp_rho = mapped["metric_naming"], mapped["sampling_replay"], mapped["dvp_rho"]
            alp, topk_logprobs, topk_bound = mapped["alp"], mapped["topk_logprobs"], mapped["topk_bound"]
            score_centering, sync_check = mapped["score_centering"], mapped["sync_check"]
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
        _check_allowed(allow_changed)
        _check_score_centering(score_centering, topk_logprobs, sampling_replay or dvp_rho is not None)
        if dvp_rho is not None:
            args, kwargs = _with_min_p(args, kwargs, float(dvp_rho))
        check_sync_setting(sync_check)  # refuse a bad value before TRL builds its engine
        request_timeout = check_request_timeout(vllm_request_timeout)
        nonfinite_rollout_limit(max_nonfinite_rollout, setting="max_nonfinite_rollout")  # refused before TRL builds
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
        if the_recipe is not None:  # what this run can fetch from its engine, against what the recipe needs
            from offpolicy.recipe.hosts import HOSTS, check_host

            check_host(the_recipe, "trl", HOSTS["trl"].supplies | ({"rollout_logp"} if has_mu else set())
                       | ({"engine_topk"} if getattr(train_args, "use_vllm", False) else set()))
        self.offpolicy_method_recipe = the_recipe
        self.offpolicy_transforms = trl_transforms(the_recipe, topk_logprobs=topk_logprobs, topk_bound=topk_bound,
                                                   score_centering=score_centering)
        self.offpolicy_correction = correction
        self.offpolicy_metric_naming = metric_naming
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
        self._setup_trl_terms(train_args, name, objective, clip_low, clip_high)
        replay = sampling_replay or dvp_rho is not None
        self._setup_replay(train_args, replay, memory_budget_bytes)
        self._setup_topk(train_args, correction, topk_logprobs, topk_bound, score_centering)
        if replay or topk_logprobs:
            _check_plain_head(getattr(self, "model", None))
            refuse_sharded_head(head_options(sampling_replay=sampling_replay, dvp_rho=dvp_rho,
                                             topk_logprobs=topk_logprobs, score_centering=score_centering),
                                model_sharding(getattr(self, "model", None), getattr(self, "accelerator", None)))
        self.offpolicy_request_timeout = request_timeout
        self.offpolicy_max_nonfinite_rollout = max_nonfinite_rollout
        self._check_logprobs_mode(train_args)
        self._setup_alp(alp_cfg, aggregation, explicit)
        if self.offpolicy_alp is not None:
            # ALP's unified-ratio loss replaces the objective: TRL's loss-type weights and clip metrics do not
            # describe it (TRL's masks, KL, entropy bonus and router loss still apply)
            self._offpolicy_trls_loss = self._offpolicy_trls_clip = False
            self._offpolicy_cispo_cap = None
        self._setup_vllm_sync(train_args, sync_check, vllm_weights_dir)
        self._setup_resume_check(allow_changed, trl_recipe(
            correction, self.offpolicy_loss_kwargs, replay=replay, dvp_rho=dvp_rho, alp=alp_cfg,
            topk_logprobs=topk_logprobs, topk_bound=topk_bound, score_centering=score_centering))

    # -- the loss ---------------------------------------------------------------------------------------------
    @every_rank_raises()  # a rank whose loss raises stops every rank here, not in the backward's all-reduce
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
        batch = batch_from_trl_inputs(per_token_logps, inputs, max_nonfinite_rollout=self.offpolicy_max_nonfinite_rollout)
        if custom:  # what the scoring forward computed for the transforms, finished on the batch below
            replayed = self.offpolicy_recipe is not None
            fetched = (topk[0], topk[1]) if topk is not None and topk[0] is not None and topk[1] is not None \
                else None
            batch = batch.replace(extras=forward_extras(
                keep=s.inside if replayed else None, mass=s.mass if replayed else None, center=s.center,
                kl_lower=s.kl_lower, kl_upper=s.kl_upper, topk=fetched))
        batch = apply_transforms(batch, self.offpolicy_transforms)
        per_token_logps = batch.logp  # TRL's terms below read the transformed log-probs (centred: same value)
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
        if topk is not None:
            metrics.update(self._topk_metrics(s, batch.bool_mask, topk[0]))
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
