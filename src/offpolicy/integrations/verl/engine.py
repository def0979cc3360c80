"""verl training engine with DVP / sampling replay in every log-prob forward and ALP in the update forward.

:class:`OffPolicyFSDPEngine` subclasses verl's ``FSDPEngineWithLMHead`` (FSDP / FSDP2 language-model engine) and is
registered with ``EngineRegistry.register`` for the current device and vendor by :mod:`.plugin`, so that verl's
``TrainingWorker`` builds it in place of its own. Without ``sampling`` or ``alp`` in ``OFFPOLICY_VERL`` it behaves
exactly as the parent class. What it changes:

* **Sampling recipe** (``sampling: {min_p | top_k | top_p}``): ``prepare_model_outputs`` — the one function verl runs
  for the old-log-prob forward (eval, no grad) *and* the update forward (train) — returns log π^recipe(y) instead of
  log softmax(z / T)_y: with ``min_p`` only, DVP's constrained log-prob over the trainer's own min-p safe set
  (arXiv 2512.23087 Def 5.2); with ``top_k`` / ``top_p``, π_θ renormalised on the support vLLM's filters leave
  (vLLM's order min-p → top-k → top-p). The
  temperature is verl's own (``micro_batch["temperature"]``, per sample allowed). A sampled token outside the
  trainer's set gets the finite stand-in those functions return (the ratio of two stand-ins stays finite).
* **ALP** (``alp: {...}``): a :class:`~offpolicy.perturbation.LayerwisePerturbation` on the FSDP-wrapped decoder
  layers (its pre-forward hook runs after FSDP2's, i.e. on the inputs already cast to ``param_dtype``), noise on only
  in a forward with ``forward_only=False``, grad enabled and the module in train mode (``train_mini_batch``), never in
  ``infer_batch`` (π_old, reference). log σ is its own optimiser group (lr ``alp.lr``, no weight decay), outside the
  model — not in ``module.parameters()`` (gradient clipping, weight sync to the rollout server and HF checkpoints do
  not see it). Its gradient is averaged over the data-parallel group before each optimiser step (as FSDP averages the
  model's); it is saved to ``offpolicy_alp.pt`` beside verl's checkpoint and restored with it.

* **μ in the policy loss**: verl's ``ppo_loss`` calls the policy loss without the rollout log-probs; around every
  ``forward_step`` that computes a loss, the engine hands the micro-batch's ``rollout_log_probs`` (padded like
  ``old_log_probs``) to the plug-in's policy losses (:func:`~offpolicy.integrations.verl.loss.rollout_log_probs_in_loss`),
  so that ``offpolicy_ipo``, ``offpolicy_bypass`` and a loss with ``m2po(source="total")`` see μ.
* **Top-K TRM** (``topk_logprobs: K``): in the old-log-prob forward (no grad, ``calculate_entropy`` on — verl's
  ``_compute_old_log_prob``; the reference forward asks for no entropy) of a batch that carries the rollout's top-K
  (:data:`~offpolicy.integrations.verl.topk.TOPK_IDS_FIELD`, put there by the agent loop), the engine adds two
  outputs laid out as ``log_probs``: the certified lower and upper bounds on KL(μ ‖ π_old) per token
  (:func:`offpolicy.topk_kl_lower_bound`, :func:`offpolicy.topk_kl_upper_bound`), from the same logits at verl's
  temperature: π_old is
  the full softmax(z / T), without the recipe's truncation. From vLLM the top-K is the raw model's (prompt log-probs
  skip the sampler), so the agent loop accepts it only from a rollout at T = 1, where the two agree. verl writes
  every output of the forward to the TransferQueue; the driver reads them (:mod:`.driver`).

* **Score centering** (``score_centering: true`` with ``topk_logprobs: K``, arXiv 2609.20807): in the update forward
  (grad on) of a batch that carries the rollout's top-K, ``log_probs`` becomes
  ``centered_logp(log_probs, score_center_topk(z / T, ids, logq))`` on every row (prompt rows hold a point mass and
  are dropped by verl like their log-probs): the value is verl's own, the gradient the centred score's
  (:mod:`offpolicy.objectives.score_centering`; the top-K's log-probs are taken as the tempered sampler's, z / T is
  verl's temperature — from vLLM they are the raw model's, which the agent loop accepts only at T = 1). Its drift
  and head mass (:func:`~offpolicy.objectives.score_centering.centering_token_metrics`, the names the trainer and
  TRL log) are averaged over each micro-batch's response tokens and added to verl's step metrics
  (``actor/score_centering/drift_tv``, ``…/head_mass_q``).

The recipe's log-probs, the bounds and the centre come from one row-chunked pass over the forward's logits
(:func:`offpolicy.forward_scores.token_scores`, the same function TRL's scoring calls on hidden states), so the extra
``[N, V]`` float32 work is a chunk at a time.

The fused-kernel path (``use_fused_kernels``) yields no logits: a recipe or top-K with it is refused at the first
forward. A batch flagged :data:`~offpolicy.integrations.verl.settings.PLAIN_LOG_PROBS` (the sync check's probe) gets
the parent's plain log-probs: the engine side of that check is vLLM's prompt log-probs, which no sampler touches.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor
from verl.utils import tensordict_utils as tu
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from offpolicy.corrections.vocabulary import SUPPORT_ORDER
from offpolicy.forward_scores import token_scores
from offpolicy.integrations.verl.loss import rollout_log_probs_in_loss
from offpolicy.integrations.verl.settings import (
    DVP_KEEP_FIELD,
    DVP_MASS_FIELD,
    PLAIN_LOG_PROBS,
    settings_from_environment,
)
from offpolicy.integrations.verl.topk import (
    KL_LOWER_FIELD,
    KL_UPPER_FIELD,
    TOPK_IDS_FIELD,
    TOPK_LOGP_FIELD,
    point_mass,
    topk_rows,
)
from offpolicy.kernels.chunking import DEFAULT_MEMORY_BUDGET_BYTES
from offpolicy.objectives.score_centering import centered_logp, centering_token_metrics
from offpolicy.perturbation import ALP_CHECKPOINT_FILE, LayerwisePerturbation, allreduce_sigma_grad, load_alp, save_alp


def rollout_log_probs(micro_batch: Any) -> Tensor | None:
    """μ of a micro-batch, padded [B, T] as verl's ``ppo_loss`` pads ``old_log_probs`` (both response-level fields
    of the same batch), or None when the batch has no ``rollout_log_probs``."""
    if "rollout_log_probs" not in micro_batch.keys():  # noqa: SIM118 - TensorDict keys
        return None
    return micro_batch.select("response_mask", "rollout_log_probs").to_padded_tensor()["rollout_log_probs"]


class OffPolicyFSDPEngine(FSDPEngineWithLMHead):
    """``FSDPEngineWithLMHead`` + the plug-in's sampling recipe and ALP (see the module docstring)."""

    def __init__(self, model_config: Any, *args: Any, **kwargs: Any) -> None:
        self.offpolicy = settings_from_environment()
        self.alp: LayerwisePerturbation | None = None
        self._offpolicy_metrics: dict[str, list[Tensor]] = {}  # the update forwards' (sum, count) this step
        super().__init__(model_config, *args, **kwargs)

    # -- ALP: σ group, noise only in the update forward, σ.grad averaged, σ in checkpoints ------------------------
    def _build_optimizer(self, module: torch.nn.Module) -> torch.optim.Optimizer:
        optimizer = super()._build_optimizer(module)
        settings = self.offpolicy.alp
        if settings is not None:
            seed = None if settings.seed is None else settings.seed + self.get_data_parallel_rank()
            layers = settings.layers if settings.layers == "all" else list(settings.layers)
            self.alp = LayerwisePerturbation(module, layers=layers, init_std=settings.init_std, seed=seed)
            device = next(module.parameters()).device
            self.alp.to(device)
            optimizer.add_param_group(self.alp.param_group(lr=settings.lr))
        return optimizer

    def forward_step(self, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
        mu = rollout_log_probs(micro_batch) if loss_function is not None else None
        if self.alp is None:
            with rollout_log_probs_in_loss(mu):
                return super().forward_step(micro_batch, loss_function, forward_only)
        noisy = not forward_only and torch.is_grad_enabled() and self.module.training
        with self.alp.active(noisy), rollout_log_probs_in_loss(mu):
            return super().forward_step(micro_batch, loss_function, forward_only)

    def optimizer_step(self) -> float:
        if self.alp is not None and self.get_data_parallel_size() > 1:
            allreduce_sigma_grad(self.alp, self.get_data_parallel_group())
        return super().optimizer_step()

    def train_batch(self, data: Any, loss_function: Any) -> Any:
        """verl's step, then the engine's metrics added to verl's step metrics (``actor/…``): score centering's per
        micro-batch (:meth:`_record_centering`, :meth:`_step_metrics`) and ALP's σ after the step (``alp/sigma_mean`` …, a one-element
        list: σ is the same on every rank), as lists, the form verl gathers over the data-parallel ranks."""
        self._offpolicy_metrics = {}
        outputs = super().train_batch(data, loss_function)
        if self.is_mp_src_rank_with_outputs():
            outputs["metrics"].update(self._step_metrics())
            if self.alp is not None:
                outputs["metrics"].update({k: [float(v)] for k, v in self.alp.metrics().items()})
        self._offpolicy_metrics = {}
        return outputs

    def save_checkpoint(self, local_path: str, *args: Any, **kwargs: Any) -> None:
        super().save_checkpoint(local_path, *args, **kwargs)
        if self.alp is not None and self.get_data_parallel_rank() == 0:
            save_alp(self.alp, local_path)

    def load_checkpoint(self, local_path: str, *args: Any, **kwargs: Any) -> None:
        super().load_checkpoint(local_path, *args, **kwargs)
        if self.alp is not None and os.path.exists(os.path.join(local_path, ALP_CHECKPOINT_FILE)):
            load_alp(self.alp, local_path, setting="trainer.resume_mode")

    # -- sampling recipe in every log-prob forward; top-K KL bounds in the old-log-prob forward --------------------
    def prepare_model_outputs(self, output: Any, output_args: dict, micro_batch: Any, logits_processor_func: Any):
        if tu.get_non_tensor_data(data=micro_batch, key=PLAIN_LOG_PROBS, default=False):  # the sync check's probe
            return super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
        recipe, topk = self.offpolicy.sampling.active, self._wants_topk_bounds(micro_batch)
        center = self._wants_score_centering(micro_batch)
        if not (recipe or topk or center):
            return super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
        if tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False):
            raise ValueError("offpolicy.sampling / topk_logprobs / score_centering need the logits: set "
                             "actor_rollout_ref.model.use_fused_kernels=False")
        # computed before the parent's, on the raw logits (the parent scales by temperature out of place): the
        # recipe's log-probs, the top-K bounds and the centre in one row-chunked pass (offpolicy.forward_scores);
        # without a recipe the log-prob stays the parent's, so the pass computes none
        flat, temperature, unpad = self._flat_logits(output, output_args, micro_batch)
        cu_seqlens = micro_batch["input_ids"].offsets()
        targets = output_args.get("input_ids_rmpad_rolled")
        if targets is None:  # verl's padded path: the plain log-prob stays the parent's, so any target will do
            if recipe:
                raise ValueError("offpolicy.sampling needs verl's packed path: set use_remove_padding=True")
            targets = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
        head = self._topk_head(flat, micro_batch) if topk or center else None
        support = recipe and self._is_old_log_prob_forward(micro_batch)  # π_old's support, for the driver
        s = token_scores(targets, logits=flat, temperature=temperature,
                         recipe=self.offpolicy.sampling.config if recipe else None, order=SUPPORT_ORDER,
                         topk=head, bounds=topk, center=center, drift=center, logp=recipe, mass=support,
                         memory_budget_bytes=DEFAULT_MEMORY_BUDGET_BYTES)
        if center:
            assert s.drift is not None and head is not None  # asked for
            self._record_centering(centering_token_metrics(s.drift, head[0]), unpad, micro_batch)
        model_output = super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
        if "log_probs" in model_output:
            logp = unpad(s.logp) if s.logp is not None else model_output["log_probs"].values()
            if center:
                assert s.center is not None  # asked for
                logp = centered_logp(logp, unpad(s.center).to(logp.dtype))
            model_output["log_probs"] = torch.nested.nested_tensor_from_jagged(logp, cu_seqlens)
        if topk:
            assert s.kl_lower is not None and s.kl_upper is not None  # asked for
            model_output[KL_LOWER_FIELD] = torch.nested.nested_tensor_from_jagged(unpad(s.kl_lower), cu_seqlens)
            model_output[KL_UPPER_FIELD] = torch.nested.nested_tensor_from_jagged(unpad(s.kl_upper), cu_seqlens)
        if support:  # which sampled tokens the recipe's support holds, and its mass: the driver's dvp_keep
            assert s.mass is not None  # asked for
            model_output[DVP_KEEP_FIELD] = torch.nested.nested_tensor_from_jagged(unpad(s.inside.float()), cu_seqlens)
            model_output[DVP_MASS_FIELD] = torch.nested.nested_tensor_from_jagged(unpad(s.mass.float()), cu_seqlens)
        return model_output

    def _record_centering(self, per_row: dict[str, Tensor], unpad: Any, micro_batch: Any) -> None:
        """Each per-row metric ``[N (+ pad)]`` summed over the micro-batch's response tokens, taken as verl's
        ``ppo_loss`` takes its log-probs and mask (``no_padding_2_padding``, ``response_mask`` padded; a token with
        mask 0 left out), kept with the token count until the step ends (no host sync in the forward:
        :meth:`_step_metrics` divides)."""
        from verl.workers.utils.padding import no_padding_2_padding

        mask = micro_batch.select("response_mask").to_padded_tensor()["response_mask"].bool()
        for key, value in per_row.items():
            response = no_padding_2_padding(unpad(value), micro_batch).to(mask.device)
            total = torch.stack([torch.where(mask, response, 0.0).sum(), mask.sum().float()])
            self._offpolicy_metrics.setdefault(key, []).append(total.detach())

    def _step_metrics(self) -> dict[str, list[float]]:
        """The step's per-micro-batch means (micro-batches without a response token left out), as verl's lists."""
        out = {}
        for key, totals in self._offpolicy_metrics.items():
            sums, counts = torch.stack(totals).cpu().unbind(-1)
            out[key] = (sums[counts > 0] / counts[counts > 0]).tolist()
        return {k: v for k, v in out.items() if v}

    @staticmethod
    def _is_old_log_prob_forward(micro_batch: Any) -> bool:
        """verl's ``_compute_old_log_prob``: no grad, the entropy asked for (the reference forward asks for none; the
        update forward runs with grad on)."""
        return not torch.is_grad_enabled() and bool(
            tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False))

    def _wants_topk_bounds(self, micro_batch: Any) -> bool:
        """The old-log-prob forward of a batch that carries the rollout's top-K."""
        present = TOPK_IDS_FIELD in micro_batch.keys()  # noqa: SIM118 - TensorDict keys
        return self.offpolicy.topk_logprobs > 0 and present and self._is_old_log_prob_forward(micro_batch)

    def _wants_score_centering(self, micro_batch: Any) -> bool:
        """The update forward (grad on) with ``score_centering``; its batch must carry the rollout's top-K."""
        if not (self.offpolicy.score_centering and torch.is_grad_enabled()):
            return False
        if TOPK_IDS_FIELD not in micro_batch.keys():  # noqa: SIM118 - TensorDict keys
            raise ValueError(f"offpolicy.score_centering: the update batch has no {TOPK_IDS_FIELD} (the agent loop "
                             "writes it when topk_logprobs > 0 and the server returns top-K log-probs)")
        return True

    def _topk_head(self, flat: Tensor, micro_batch: Any) -> tuple[Tensor, Tensor]:
        """The micro-batch's top-K (nested [bsz, j, K]) as rows ``(logp, ids)`` aligned with ``flat`` [N (+ pad), V]:
        the packed path's tail padding gets point-mass rows (dropped by the caller's ``unpad``)."""
        if getattr(self, "use_ulysses_sp", False):
            raise ValueError("offpolicy.topk_logprobs is not supported with Ulysses sequence parallelism "
                             "(ulysses_sequence_parallel_size > 1)")
        lengths = micro_batch["input_ids"].offsets().diff().tolist()
        mask = micro_batch.get("response_mask", None)
        padding = [False] * len(lengths) if mask is None else [bool(m.sum() == 0) for m in mask.unbind()]
        logp, ids = topk_rows(micro_batch[TOPK_LOGP_FIELD].unbind(), micro_batch[TOPK_IDS_FIELD].unbind(), lengths,
                              padding)
        pad = flat.shape[0] - ids.shape[0]
        if pad:
            filler_lp, filler_ids = point_mass(pad, ids.shape[1])
            logp, ids = torch.cat([logp, filler_lp]), torch.cat([ids, filler_ids])
        return logp.to(flat.device), ids.to(flat.device)

    def _flat_logits(self, output: Any, output_args: dict, micro_batch: Any) -> tuple[Tensor, Tensor, Any]:
        """The forward's raw logits as rows [N (+ pad), V], the temperature per row [N (+ pad)], and the function
        that turns a per-row result back into verl's flat layout (the packed path's padding dropped)."""
        from torch.distributed.tensor import DTensor

        logits = output.logits
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        cu_seqlens = micro_batch["input_ids"].offsets()
        if tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
            pad_size = output_args["pad_size"]
            flat = logits.squeeze(0)  # (total_nnz [/ sp] + pad, V)
            return flat, output_args["temperature_rmpad"], lambda x: self._gather_and_unpad_packed(x, pad_size)
        lengths = cu_seqlens.diff().tolist()
        flat = torch.cat([logits[i, :n] for i, n in enumerate(lengths)])
        temperature = output_args["temperature"].float()
        per_token = torch.repeat_interleave(temperature, cu_seqlens.diff().to(temperature.device))
        return flat, per_token, lambda x: x
