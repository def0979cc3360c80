"""TRL integration: offpolicy's corrections and losses inside TRL's ``GRPOTrainer``.

Two levels, pick one:

* :func:`trl_policy_loss` — a pure function from TRL's per-step ``inputs`` dict (``completion_mask``, ``advantages``,
  ``old_per_token_logps``, ``sampling_per_token_logps``) and the current per-token log-probs to ``(loss, metrics)``.
  Use it from your own ``GRPOTrainer._compute_loss`` override.
* ``OffPolicyGRPOTrainer`` — a drop-in subclass of ``trl.GRPOTrainer`` (built on first access, so importing this module
  never imports TRL) that takes ``correction=``, ``objective=``, ``aggregation=``, ``metric_naming=`` and everything
  ``GRPOTrainer`` takes; corrections and objectives are registered names (a plug-in's too) or objects::

      from offpolicy.integrations.trl import OffPolicyGRPOTrainer
      trainer = OffPolicyGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(..., use_vllm=True,
                                     vllm_importance_sampling_correction=False),
                                     correction=[{"name": "icepop"}, {"name": "opsm", "delta": 1e-4}])

TRL's names map as follows: ``sampling_per_token_logps`` (vLLM's log-probs) is μ = ``rollout_logp``;
``old_per_token_logps`` is π_old (TRL leaves it out when there is a single update per generation — then π_old = π_θ
detached, as in TRL); without vLLM there is no separate μ and μ = π_old (every correction is then the identity). TRL's own IS correction must be off
(``vllm_importance_sampling_correction=False``) when an offpolicy correction is given, or the mismatch would be
corrected twice; the subclass refuses it (TRL's default ``sequence_mask`` at 3.0 is ``mis(level="sequence",
upper=3.0)``). Reproduced from TRL's loss: ``loss_type`` grpo / bnpo / dr_grpo / dapo with TRL's own normalisers
(gradient accumulation, dapo's generation-batch token count, dr_grpo's ``max_completion_length``), ``epsilon`` /
``epsilon_high``, ``delta`` (= ``dual_clip``), ``loss_type`` cispo (the ``cispo`` objective, ``epsilon_high`` TRL's
absolute cap) and sapo (``sapo``, TRL's two temperatures), the MoE router loss and vision inputs. When TRL hands over
the vLLM log-probs, the mismatch diagnostics are logged too, under TRL's ``sampling/…`` names by default
(``metric_naming``). Refused, because silently
ignoring them would train something else: ``beta`` ≠ 0 (no KL-to-reference term), other loss types, entropy-quantile
masking, the entropy bonus, ``off_policy_mask_threshold`` (use ``opsm``) and ``importance_sampling_level="sequence"``
except with ``objective="gspo"`` or CISPO (TRL's sequence level is the length-normalised ratio, our ``geometric``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import Correction
from offpolicy.losses import policy_loss
from offpolicy.metrics import check_naming, offpolicy_metrics
from offpolicy.registry import OBJECTIVES, CorrectionSpec, build_correction, split_spec


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
    correction: Correction | CorrectionSpec | list[CorrectionSpec] | None = None,
    **loss_kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """:func:`offpolicy.policy_loss` on TRL's inputs; ``loss_kwargs`` are policy_loss's (objective, clip_low, …);
    ``correction`` may be given by name (:func:`offpolicy.build_correction`).

    >>> lp = torch.zeros(1, 2, requires_grad=True)
    >>> loss, m = trl_policy_loss(lp, {"completion_mask": torch.ones(1, 2), "advantages": torch.tensor([2.0])})
    >>> loss.item()
    -2.0
    """
    correction = build_correction(correction) if not isinstance(correction, Correction) else correction
    return policy_loss(batch_from_trl_inputs(per_token_logps, inputs), correction=correction, **loss_kwargs)


# TRL loss_type → the offpolicy aggregation that reproduces it (with TRL's normaliser, see _trl_normalise)
TRL_LOSS_TYPES: dict[str, str] = {
    "grpo": "seq_mean_token_mean",
    "bnpo": "token_mean",
    "dr_grpo": "seq_mean_token_sum_norm",
    "dapo": "token_mean",
    "cispo": "token_mean",
    "sapo": "seq_mean_token_mean",
}
# TRL loss_type → its objective (the others are PPO-clip); TRL divides these two by the generation batch's tokens
TRL_OBJECTIVES: dict[str, str] = {"cispo": "cispo", "sapo": "sapo"}
TOKEN_COUNT_NORMALISED = ("dapo", "cispo")


def trl_objective(args: Any, objective: str | dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """The objective and parameters that reproduce ``args`` (a ``GRPOConfig``): ``objective`` if given, else the one
    of ``args.loss_type``; TRL's clip settings mapped onto the parameters the objective takes.

    >>> from types import SimpleNamespace as Args
    >>> trl_objective(Args(loss_type="cispo", epsilon=0.2, epsilon_high=5.0), None)
    ('cispo', {'clip_low': 1.0, 'clip_high': 4.0})
    >>> trl_objective(Args(loss_type="dapo", epsilon=0.2, epsilon_high=0.28, delta=None), None)
    ('ppo', {'clip_low': 0.2, 'clip_high': 0.28})
    """
    loss_type: str = getattr(args, "loss_type", None) or ""
    name, params = split_spec(objective if objective is not None else TRL_OBJECTIVES.get(loss_type, "ppo"), "objective")
    takes = OBJECTIVES[name].parameters()
    eps = getattr(args, "epsilon", 0.2)
    eps_high = getattr(args, "epsilon_high", None)
    eps_high = eps if eps_high is None else eps_high
    if name == "cispo" and loss_type == "cispo":  # TRL: w = min(r, epsilon_high), no lower bound
        trl = {"clip_low": 1.0, "clip_high": eps_high - 1.0}
    else:
        trl = {"clip_low": eps, "clip_high": eps_high, "dual_clip": getattr(args, "delta", None),  # TRL clamps r at δ
               "tau_pos": getattr(args, "sapo_temperature_pos", None),
               "tau_neg": getattr(args, "sapo_temperature_neg", None)}
    if getattr(args, "importance_sampling_level", "token") == "sequence":
        trl["level"] = "geometric"
    return name, {**{k: v for k, v in trl.items() if k in takes and v is not None}, **params}
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
    if getattr(args, "importance_sampling_level", "token") != "token" and objective not in ("gspo", "cispo"):
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
            from trl import GRPOTrainer as base
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
            correction: Correction | CorrectionSpec | list[CorrectionSpec] | None = None,
            objective: str | dict[str, Any] | None = None,
            aggregation: str | None = None,
            clip_low: float | None = None,
            clip_high: float | None = None,
            dual_clip: float | None = None,
            metric_naming: str = "trl",
            **kwargs: Any,
        ) -> None:
            check_naming(metric_naming)
            correction = correction if isinstance(correction, Correction) else build_correction(correction)
            super().__init__(*args, **kwargs)
            train_args = getattr(self, "args", None)
            name, params = trl_objective(train_args, objective)
            _refuse_unreproduced(train_args, name)
            self.offpolicy_correction = correction
            self.offpolicy_metric_naming = metric_naming
            loss_type: str = getattr(train_args, "loss_type", None) or ""
            # the generation batch's token normaliser applies only when the aggregation is TRL's own
            self._offpolicy_token_count = aggregation is None and loss_type in TOKEN_COUNT_NORMALISED
            if aggregation is None:
                aggregation = TRL_LOSS_TYPES.get(loss_type, "token_mean")
            explicit = {"clip_low": clip_low, "clip_high": clip_high, "dual_clip": dual_clip}
            params.update({k: v for k, v in explicit.items() if v is not None})
            self.offpolicy_loss_kwargs: dict[str, Any] = {"objective": {"name": name, **params},
                                                          "aggregation": aggregation}
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
            if inputs.get("sampling_per_token_logps") is not None and inputs.get("old_per_token_logps") is not None:
                mismatch = offpolicy_metrics(inputs["old_per_token_logps"], inputs["sampling_per_token_logps"],
                                             _loss_mask(inputs), naming=self.offpolicy_metric_naming)
                for name, value in mismatch.items():
                    self._metrics[mode][name].append(float(value))
            return loss

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


def __getattr__(name: str) -> Any:
    if name == "OffPolicyGRPOTrainer":
        return make_offpolicy_grpo_trainer()
    raise AttributeError(name)
