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
corrected twice; the subclass refuses that combination. What the subclass does not reproduce from TRL's loss: the
KL-to-reference term (``beta`` must be 0, TRL's default), entropy-quantile masking, and TRL's loss types other than
the aggregation given here (``token_mean`` ≈ TRL ``dapo``/``bnpo`` per micro-batch, ``seq_mean_token_mean`` = ``grpo``,
``seq_mean_token_sum_norm`` = ``dr_grpo``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import Correction
from offpolicy.losses import policy_loss


def batch_from_trl_inputs(per_token_logps: Tensor, inputs: dict[str, Any]) -> LogProbBatch:
    """Map TRL's ``inputs`` dict and the current per-token log-probs [B, T] to a :class:`LogProbBatch`.

    >>> b = batch_from_trl_inputs(torch.zeros(2, 3), {"completion_mask": torch.ones(2, 3), "advantages": torch.ones(2)})
    >>> b.old_logp is None, torch.equal(b.rollout_logp, torch.zeros(2, 3))
    (True, True)
    """
    for key in ("completion_mask", "advantages"):
        if key not in inputs:
            raise ValueError(f"inputs is missing {key!r}: pass the dict GRPOTrainer gives _compute_loss")
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:  # TRL excludes tool output tokens from the loss the same way
        mask = mask * inputs["tool_mask"]
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
        """``GRPOTrainer`` whose loss is :func:`offpolicy.policy_loss` with an offpolicy correction chain."""

        def __init__(
            self,
            *args: Any,
            correction: Correction | None = None,
            objective: str = "ppo",
            aggregation: str = "token_mean",
            clip_low: float | None = None,
            clip_high: float | None = None,
            dual_clip: float | None = None,
            **kwargs: Any,
        ) -> None:
            super().__init__(*args, **kwargs)
            train_args = getattr(self, "args", None)
            if correction is not None and getattr(train_args, "vllm_importance_sampling_correction", False) and getattr(
                train_args, "use_vllm", False
            ):
                raise ValueError(
                    "correction: TRL's own vllm_importance_sampling_correction is on; set it to False so the mismatch "
                    "is not corrected twice"
                )
            if float(getattr(train_args, "beta", 0.0) or 0.0) != 0.0:
                raise ValueError("beta: OffPolicyGRPOTrainer has no KL-to-reference term; use beta=0.0")
            self.offpolicy_correction = correction
            eps = getattr(train_args, "epsilon", 0.2)
            self.offpolicy_loss_kwargs = {
                "objective": objective,
                "aggregation": aggregation,
                "clip_low": eps if clip_low is None else clip_low,
                "clip_high": getattr(train_args, "epsilon_high", eps) if clip_high is None else clip_high,
                "dual_clip": dual_clip,
            }

        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
            input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            logits_to_keep = inputs["completion_ids"].size(1)
            per_token_logps = self._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep)[0]
            loss, metrics = trl_policy_loss(
                per_token_logps, inputs, correction=self.offpolicy_correction, **self.offpolicy_loss_kwargs
            )
            mode = "train" if model.training else "eval"
            for name, value in metrics.items():  # the logging boundary: one sync per metric per step, as TRL does
                self._metrics[mode][f"offpolicy/{name}"].append(float(value.detach()))
            return loss

    return OffPolicyGRPOTrainer


def __getattr__(name: str) -> Any:
    if name == "OffPolicyGRPOTrainer":
        return make_offpolicy_grpo_trainer()
    raise AttributeError(name)
