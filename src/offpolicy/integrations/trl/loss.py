"""TRL's loss, reproduced with offpolicy's corrections and objectives: the key mapping from TRL's per-step
``inputs`` dict to a :class:`~offpolicy.LogProbBatch`, :func:`trl_policy_loss`, and the ``GRPOConfig`` settings that
map onto an objective (``loss_type``, ``epsilon``, ``delta``, …) or are refused (see the package docstring)."""

from __future__ import annotations

from typing import Any

import torch  # noqa: F401 - the doctests use it
from torch import Tensor

from offpolicy.batch import LogProbBatch, nonfinite_fields
from offpolicy.corrections.base import Correction
from offpolicy.losses import policy_loss
from offpolicy.registry import OBJECTIVES, CorrectionSpec, build_correction, split_spec


def _loss_mask(inputs: dict[str, Any]) -> Tensor:
    """TRL's loss mask: ``completion_mask``, without tool-output tokens (``tool_mask``) when there are any."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask


NONFINITE_SETTING = "OffPolicyGRPOTrainer(max_nonfinite_rollout=...)"  # what a batch refused for non-finite μ names


def batch_from_trl_inputs(per_token_logps: Tensor, inputs: dict[str, Any], *,
                          max_nonfinite_rollout: float | None = None) -> LogProbBatch:
    """Map TRL's ``inputs`` dict and the current per-token log-probs [B, T] to a :class:`LogProbBatch`;
    ``max_nonfinite_rollout``: the trainer's limit on non-finite μ (None: the default), named on a refusal.

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
    return LogProbBatch(logp=per_token_logps, mask=mask, old_logp=old, rollout_logp=rollout, advantages=inputs["advantages"],
                        **nonfinite_fields(max_nonfinite_rollout, setting=NONFINITE_SETTING))


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


# TRL loss_type → the offpolicy aggregation that reproduces it (with TRL's normaliser, see _trl_normalise); luspo's
# Σ_t per sequence, mean over sequences is seq_mean_token_sum_norm with T_max = 1 (TRL_MAX_TOKENS)
TRL_LOSS_TYPES: dict[str, str] = {
    "grpo": "seq_mean_token_mean",
    "bnpo": "token_mean",
    "dr_grpo": "seq_mean_token_sum_norm",
    "dapo": "token_mean",
    "cispo": "token_mean",
    "sapo": "seq_mean_token_mean",
    "luspo": "seq_mean_token_sum_norm",
    "vespo": "token_mean",
}
TRL_MAX_TOKENS: dict[str, int] = {"luspo": 1}
# TRL loss_type → its objective (the others are PPO-clip); VESPO is −φ(w)·A·log π: REINFORCE times its detached
# sequence weight φ (a coefficient the trainer multiplies in); TRL divides these three by the generation batch's tokens
TRL_OBJECTIVES: dict[str, str] = {"cispo": "cispo", "sapo": "sapo", "vespo": "reinforce"}
TOKEN_COUNT_NORMALISED = ("dapo", "cispo", "vespo")


def trl_objective(args: Any, objective: str | dict[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """The objective and parameters that reproduce ``args`` (a ``GRPOConfig``): ``objective`` if given, else the one
    of ``args.loss_type``; TRL's clip settings mapped onto the parameters the objective takes.

    >>> from types import SimpleNamespace as Args
    >>> trl_objective(Args(loss_type="cispo", epsilon=0.2, epsilon_high=5.0), None)
    ('cispo', {'clip_low': 1.0, 'clip_high': 4.0})
    >>> trl_objective(Args(loss_type="dapo", epsilon=0.2, epsilon_high=0.28, delta=None), None)
    ('ppo', {'clip_low': 0.2, 'clip_high': 0.28})

    TRL's CISPO cap below 1 (its default ``epsilon_high=None`` makes it ``epsilon``, 0.2) is no ``cispo`` clip range:
    then the objective is REINFORCE and the trainer multiplies in the detached weight min(r, cap)
    (:func:`cispo_cap`), the same loss −sg[min(r, cap)]·A·log π.

    >>> trl_objective(Args(loss_type="cispo", epsilon=0.2, epsilon_high=None), None)
    ('reinforce', {})

    TRL's ``delta`` clamps r at δ before the min; above 1 + ε_high it is the dual clip, below it the upper clip of
    A > 0 while A < 0 is then held at 1 + ε_high:

    >>> trl_objective(Args(loss_type="dapo", epsilon=0.2, epsilon_high=0.28, delta=1.1), None)
    ('ppo', {'clip_low': 0.2, 'clip_high': 0.10000000000000009, 'dual_clip': 1.28})
    """
    loss_type = getattr(args, "loss_type", None)
    name, params = split_spec(objective if objective is not None
                              else TRL_OBJECTIVES.get(loss_type, "ppo") if loss_type is not None else "ppo",
                              "objective")
    takes = OBJECTIVES[name].parameters()
    eps = getattr(args, "epsilon", 0.2)
    eps_high = getattr(args, "epsilon_high", None)
    eps_high = eps if eps_high is None else eps_high
    if objective is None and cispo_cap(args) is not None:
        return "reinforce", {}
    if name == "cispo" and loss_type == "cispo":  # TRL: w = min(r, epsilon_high), no lower bound
        trl = {"clip_low": 1.0, "clip_high": eps_high - 1.0}
    else:
        delta = getattr(args, "delta", None)
        trl = {"clip_low": eps, "clip_high": eps_high, "dual_clip": delta,  # TRL clamps r at δ
               "tau_pos": getattr(args, "sapo_temperature_pos", None),
               "tau_neg": getattr(args, "sapo_temperature_neg", None)}
        if delta is not None and delta < 1.0 + eps_high:
            # −min(min(r, δ)·A, clip(r)·A) with δ < 1 + ε_high: A > 0 is held at δ, A < 0 at 1 + ε_high
            trl.update(clip_high=delta - 1.0, dual_clip=1.0 + eps_high)
    if getattr(args, "importance_sampling_level", "token") == "sequence":
        trl["level"] = "geometric"
    return name, {**{k: v for k, v in trl.items() if k in takes and v is not None}, **params}


def cispo_cap(args: Any) -> float | None:
    """TRL's CISPO cap (``epsilon_high``, else ``epsilon``) when ``args.loss_type`` is cispo and the cap is below 1
    (no ``cispo`` clip range reaches it: its weight is clip(r, 1 − ε_low, 1 + ε_high) with ε_high ≥ 0), else None.

    >>> from types import SimpleNamespace as Args
    >>> cispo_cap(Args(loss_type="cispo", epsilon=0.2, epsilon_high=None)), cispo_cap(Args(loss_type="cispo", epsilon_high=5.0))
    (0.2, None)
    """
    if getattr(args, "loss_type", None) != "cispo":
        return None
    cap = getattr(args, "epsilon_high", None)
    cap = float(getattr(args, "epsilon", 0.2) if cap is None else cap)
    return cap if cap < 1.0 else None


# inputs TRL hands the model forward for vision-language models (passed through like TRL's own _compute_loss)
_MODEL_INPUT_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                     "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def refuse_contradictions(args: Any, objective: str, corrected: bool, objective_given: bool) -> None:
    """Raise for the ``GRPOConfig`` settings that contradict the trainer's arguments; everything else TRL 1.16 trains
    with is reproduced. ``objective`` is the resolved objective's name, ``corrected`` whether ``correction=`` is set,
    ``objective_given`` whether ``objective=`` is."""
    if corrected and getattr(args, "use_vllm", False) and getattr(args, "vllm_importance_sampling_correction", False):
        raise ValueError("correction= with vllm_importance_sampling_correction=True: both correct the vLLM mismatch, "
                         "so it would be corrected twice; set vllm_importance_sampling_correction=False (TRL's "
                         "default, sequence_mask at 3.0, is correction=mis(level='sequence', upper=3.0))")
    delta = getattr(args, "delta", None)
    if delta is not None and delta < 1.0:
        raise ValueError(f"delta: TRL's two-sided clip must be >= 1 (r is clamped at δ for every token), got {delta!r}")
    loss_type = getattr(args, "loss_type", None)
    if loss_type is not None and loss_type not in TRL_LOSS_TYPES:
        raise ValueError(f"loss_type: {loss_type!r} is not one of TRL 1.16's {tuple(TRL_LOSS_TYPES)}")
    if getattr(args, "importance_sampling_level", "token") == "sequence" and objective not in ("gspo", "reinforce") \
            and "level" not in OBJECTIVES[objective].parameters():
        whose = "objective=" if objective_given else "loss_type="
        raise ValueError(f"importance_sampling_level='sequence' with {whose}{objective!r}: that objective has no "
                         "sequence-level ratio; use a PPO-family objective or importance_sampling_level='token'")
