"""TRL's own loss terms around offpolicy's objective (:mod:`offpolicy.integrations.trl.terms` has the formulas): the
loss-type weights and masks as one correction, the entropy bonus and its adaptive controller, TRL's normalisers and
TRL's metrics under TRL's names (``kl``, ``entropy``, ``clip_ratio/…``, ``cispo_clip_ratio``, ``vespo/phi_seq_mean``,
``policy_loss``, ``entropy_coef``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from offpolicy.corrections.base import Correction
from offpolicy.integrations.trl.loss import _loss_mask, cispo_cap
from offpolicy.integrations.trl.parts import TRLBase
from offpolicy.integrations.trl.terms import clip_fractions, coefficient, masked_stats, sequence_means

# TRL's loss types whose clip fractions TRL logs (clip_ratio/… for the PPO family, cispo_clip_ratio)
TRL_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo")


def _nan_reduce(x: Tensor, reduce: Any) -> float:
    """``reduce`` (torch.amin / amax) over the non-NaN entries of ``x``; NaN when there are none (TRL's nanmin)."""
    finite = x[~torch.isnan(x)]
    return float("nan") if finite.numel() == 0 else float(reduce(finite))


class TRLTerms(TRLBase):
    """TRL's loss terms, normalisers and metrics (a part of ``OffPolicyGRPOMixin``)."""

    entropy_coef: float  # TRL's: the entropy bonus's coefficient (moved by the adaptive controller)
    _last_world_entropy: float  # TRL's: the window entropy the adaptive controller last measured
    _entropy_window_stats: Tensor | None  # TRL's: [Σ H, tokens] of the accumulation window so far

    def _setup_trl_terms(self, train_args: Any, name: str, objective: Any, clip_low: float | None,
                         clip_high: float | None) -> None:
        """Which of TRL's loss-type terms apply: they do with TRL's own loss (objective from ``loss_type``)."""
        # TRL's own loss (objective from loss_type, TRL's clip range): its loss-type weights and clip metrics apply
        self._offpolicy_trls_loss = objective is None
        self._offpolicy_trls_clip = objective is None and clip_low is None and clip_high is None
        self._offpolicy_cispo_cap = cispo_cap(train_args) if objective is None else None
        # TRL's sequence level on a PPO-family objective: one loss value per sequence (the geometric ratio's)
        self._offpolicy_sequence_constant = (getattr(train_args, "importance_sampling_level", "token") == "sequence"
                                             and name in ("ppo", "gspo"))

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
