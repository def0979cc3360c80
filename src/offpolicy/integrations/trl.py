"""TRL integration: offpolicy's corrections and losses inside TRL's ``GRPOTrainer``.

Two levels, pick one:

* :func:`trl_policy_loss` — a pure function from TRL's per-step ``inputs`` dict (``completion_mask``, ``advantages``,
  ``old_per_token_logps``, ``sampling_per_token_logps``) and the current per-token log-probs to ``(loss, metrics)``.
  Use it from your own ``GRPOTrainer._compute_loss`` override.
* ``OffPolicyGRPOTrainer`` — a drop-in subclass of ``trl.GRPOTrainer`` (built on first access, so importing this module
  never imports TRL) that takes ``correction=``, ``objective=``, ``aggregation=`` and everything ``GRPOTrainer`` takes::

      from offpolicy import chain, icepop, opsm
      from offpolicy.integrations.trl import OffPolicyGRPOTrainer
      trainer = OffPolicyGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(..., use_vllm=True,
                                     vllm_importance_sampling_correction=False),
                                     correction=chain(icepop(), opsm(delta=1e-4)))

TRL's names map as follows: ``sampling_per_token_logps`` (vLLM's log-probs) is μ = ``rollout_logp``;
``old_per_token_logps`` is π_old (TRL leaves it out when there is a single update per generation — then π_old = π_θ
detached, as in TRL); without vLLM there is no separate μ and μ = π_old (every correction is then the identity). TRL's own IS correction must be off
(``vllm_importance_sampling_correction=False``) when an offpolicy correction is given, or the mismatch would be
corrected twice; the subclass refuses it (TRL's default ``sequence_mask`` at 3.0 is ``mis(level="sequence",
upper=3.0)``). Reproduced from TRL's loss: ``loss_type`` grpo / bnpo / dr_grpo / dapo with TRL's own normalisers
(gradient accumulation, dapo's generation-batch token count, dr_grpo's ``max_completion_length``), ``epsilon`` /
``epsilon_high``, ``delta`` (= ``dual_clip``), the MoE router loss and vision inputs. Refused, because silently
ignoring them would train something else: ``beta`` ≠ 0 (no KL-to-reference term), other loss types, entropy-quantile
masking, the entropy bonus, ``off_policy_mask_threshold`` (use ``opsm``) and ``importance_sampling_level="sequence"``
without ``objective="gspo"`` (TRL's sequence level is the length-normalised ratio, our ``geometric``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import Correction
from offpolicy.losses import policy_loss


def _loss_mask(inputs: dict[str, Any]) -> Tensor:
    """TRL's loss mask: ``completion_mask``, without tool-output tokens (``tool_mask``) when there are any."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask


def batch_from_trl_inputs(per_token_logps: Tensor, inputs: dict[str, Any]) -> LogProbBatch:
    """Map TRL's ``inputs`` dict and the current per-token log-probs [B, T] to a :class:`LogProbBatch`.

    >>> b = batch_from_trl_inputs(torch.zeros(2, 3), {"completion_mask": torch.ones(2, 3), "advantages": torch.ones(2)})
    >>> b.old_logp is None, torch.equal(b.rollout_logp, torch.zeros(2, 3))
    (True, True)
    """
    for key in ("completion_mask", "advantages"):
        if key not in inputs:
            raise ValueError(f"inputs is missing {key!r}: pass the dict GRPOTrainer gives _compute_loss")
    mask = _loss_mask(inputs)
    old = inputs.get("old_per_token_logps")
    rollout = inputs.get("sampling_per_token_logps")
    if rollout is None:
        # no separate inference engine: μ = π_old, and π_old = π_θ (detached) when TRL skipped that forward
        rollout = old if old is not None else per_token_logps.detach()
    return LogProbBatch(logp=per_token_logps, mask=mask, old_logp=old, rollout_logp=rollout, advantages=inputs["advantages"])


def trl_policy_loss(
    per_token_logps: Tensor,
    inputs: dict[str, Any],
    *,
    correction: Correction | None = None,
    **loss_kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`offpolicy.policy_loss` on TRL's inputs; ``loss_kwargs`` are policy_loss's (objective, clip_low, …).

    >>> lp = torch.zeros(1, 2, requires_grad=True)
    >>> loss, m = trl_policy_loss(lp, {"completion_mask": torch.ones(1, 2), "advantages": torch.tensor([2.0])})
    >>> loss.item()
    -2.0
    """
    return policy_loss(batch_from_trl_inputs(per_token_logps, inputs), correction=correction, **loss_kwargs)


# TRL loss_type → the offpolicy aggregation that reproduces it (with TRL's normaliser, see _trl_normalise)
TRL_LOSS_TYPES: dict[str, str] = {
    "grpo": "seq_mean_token_mean",
    "bnpo": "token_mean",
    "dr_grpo": "seq_mean_token_sum_norm",
    "dapo": "token_mean",
}
# inputs TRL hands the model forward for vision-language models (passed through like TRL's own _compute_loss)
_MODEL_INPUT_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                     "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def _refuse_unreproduced(args: Any, objective: str) -> None:
    """Raise for GRPOConfig settings whose effect on TRL's loss this subclass does not reproduce (silently ignoring
    them would train something else than the config says)."""
    if getattr(args, "use_vllm", False) and getattr(args, "vllm_importance_sampling_correction", False):
        raise ValueError(
            "vllm_importance_sampling_correction: TRL's own vLLM importance-sampling correction is not applied by "
            "OffPolicyGRPOTrainer; set it to False and pass correction= instead (TRL's default, sequence_mask with "
            "clip_max 3.0, is correction=mis(level='sequence', upper=3.0))"
        )
    if float(getattr(args, "beta", 0.0) or 0.0) != 0.0:
        raise ValueError("beta: OffPolicyGRPOTrainer has no KL-to-reference term; use beta=0.0")
    if getattr(args, "importance_sampling_level", "token") != "token" and objective != "gspo":
        raise ValueError("importance_sampling_level: TRL's 'sequence' level is GSPO's length-normalised ratio; pass "
                         "objective='gspo' (or objective='ppo', level='geometric' via trl_policy_loss)")
    if float(getattr(args, "top_entropy_quantile", 1.0)) < 1.0:
        raise ValueError("top_entropy_quantile: entropy-quantile masking is not reproduced; use 1.0")
    if getattr(args, "off_policy_mask_threshold", None) is not None:
        raise ValueError("off_policy_mask_threshold: pass correction=opsm(delta=...) instead (the same mask)")
    if float(getattr(args, "entropy_coef", 0.0) or 0.0) != 0.0 or getattr(args, "use_adaptive_entropy", False):
        raise ValueError("entropy_coef: the entropy bonus is not reproduced; use entropy_coef=0.0")
    loss_type = getattr(args, "loss_type", None)
    if loss_type is not None and loss_type not in TRL_LOSS_TYPES:
        raise ValueError(f"loss_type: {loss_type!r} is not reproduced; use one of {tuple(TRL_LOSS_TYPES)}")


def make_offpolicy_grpo_trainer(base: type | None = None) -> type:
    """Build ``OffPolicyGRPOTrainer`` as a subclass of ``base`` (default ``trl.GRPOTrainer``).

    ``base`` must provide TRL's ``_get_per_token_logps_and_entropies`` and ``_metrics``; passing it explicitly lets the
    adapter be tested without TRL.
    """
    if base is None:
        try:
            from trl import GRPOTrainer as base  # type: ignore[no-redef]
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError("OffPolicyGRPOTrainer needs TRL: pip install 'offpolicy[trl]'") from err

    class OffPolicyGRPOTrainer(base):  # type: ignore[misc, valid-type]
        """``GRPOTrainer`` whose loss is :func:`offpolicy.policy_loss` with an offpolicy correction chain.

        ``aggregation`` defaults to the one that reproduces ``args.loss_type`` (grpo, bnpo, dr_grpo, dapo), with TRL's
        normaliser: divided by the gradient-accumulation steps (TRL scales the loss itself and tells the HF Trainer
        not to), dapo by the generation batch's token count, dr_grpo by ``max_completion_length``. ``args.delta`` (TRL's
        two-sided clip) is the dual clip. Settings whose effect is not reproduced raise (see the module docstring).
        """

        def __init__(
            self,
            *args: Any,
            correction: Correction | None = None,
            objective: str = "ppo",
            aggregation: str | None = None,
            clip_low: float | None = None,
            clip_high: float | None = None,
            dual_clip: float | None = None,
            **kwargs: Any,
        ) -> None:
            super().__init__(*args, **kwargs)
            train_args = getattr(self, "args", None)
            _refuse_unreproduced(train_args, objective)
            self.offpolicy_correction = correction
            loss_type = getattr(train_args, "loss_type", None)
            # dapo's global token normaliser applies only when the aggregation is dapo's own
            self._offpolicy_dapo = aggregation is None and loss_type == "dapo"
            if aggregation is None:
                aggregation = TRL_LOSS_TYPES.get(loss_type, "token_mean")
            eps = getattr(train_args, "epsilon", 0.2)
            delta = getattr(train_args, "delta", None)
            self.offpolicy_loss_kwargs = {
                "objective": objective,
                "aggregation": aggregation,
                "clip_low": eps if clip_low is None else clip_low,
                "clip_high": getattr(train_args, "epsilon_high", eps) if clip_high is None else clip_high,
                "dual_clip": delta if dual_clip is None else dual_clip,  # TRL clamps r at δ: the loss of A<0 ≤ δ|A|
            }
            if aggregation == "seq_mean_token_sum_norm":  # TRL's dr_grpo: B · max_completion_length
                self.offpolicy_loss_kwargs["max_tokens"] = getattr(train_args, "max_completion_length", None)

        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
            input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            logits_to_keep = inputs["completion_ids"].size(1)
            aux_enabled = bool(getattr(self, "aux_loss_enabled", False))
            per_token_logps, _, aux_loss = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, compute_aux_loss=aux_enabled,
                **{k: inputs.get(k) for k in _MODEL_INPUT_KEYS},
            )
            loss, metrics = trl_policy_loss(
                per_token_logps, inputs, correction=self.offpolicy_correction, **self.offpolicy_loss_kwargs
            )
            mode = "train" if model.training else "eval"
            loss = self._trl_normalise(loss, inputs, mode)
            if aux_enabled:  # MoE router loss, scaled for accumulation as TRL does
                loss = loss + self.router_aux_loss_coef * aux_loss / self._accumulation(mode)
            for name, value in metrics.items():  # the logging boundary: one sync per metric per step, as TRL does
                self._metrics[mode][f"offpolicy/{name}"].append(float(value.detach()))
            return loss

        def _accumulation(self, mode: str) -> float:
            return float(getattr(self, "current_gradient_accumulation_steps", 1) or 1) if mode == "train" else 1.0

        def _trl_normalise(self, loss: Tensor, inputs: dict[str, Any], mode: str) -> Tensor:
            """TRL's own loss scaling (HF auto-scaling is off for GRPOTrainer): a per-micro-batch mean divided by the
            accumulation steps; dapo's Σ over the micro-batch divided by the generation batch's token count, rescaled
            to one accumulation window."""
            if not self._offpolicy_dapo or "num_items_in_batch" not in inputs:
                return loss / self._accumulation(mode)
            mask = _loss_mask(inputs)
            processes = getattr(getattr(self, "accelerator", None), "num_processes", 1)
            normaliser = torch.as_tensor(inputs["num_items_in_batch"]).float().clamp(min=1.0) / processes
            if mode == "train":
                normaliser = normaliser * self._accumulation(mode) / self.args.steps_per_generation
            return loss * (mask.sum().float() / normaliser)  # token mean × tokens = Σ; then TRL's divisor

    return OffPolicyGRPOTrainer


def __getattr__(name: str) -> Any:
    if name == "OffPolicyGRPOTrainer":
        return make_offpolicy_grpo_trainer()
    raise AttributeError(name)
