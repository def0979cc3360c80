"""verl integration: an offpolicy policy loss for verl's ``POLICY_LOSS_REGISTRY`` and a rollout-correction function.

verl does the distribution (FSDP/Megatron workers, vLLM/SGLang rollout); offpolicy supplies the maths. Two hooks fit
verl's own extension points:

1. **Policy loss.** verl's actor calls ``policy_loss_fn(old_log_prob, log_prob, advantages, response_mask,
   loss_agg_mode, config, rollout_is_weights)`` looked up by ``actor_rollout_ref.actor.policy_loss.loss_mode``.
   :func:`register_verl_policy_loss` registers a function with that signature under a name of your choice::

       from offpolicy.integrations.verl import register_verl_policy_loss
       from offpolicy import chain, opsm
       register_verl_policy_loss("offpolicy_gspo", objective="gspo")
       # then: actor_rollout_ref.actor.policy_loss.loss_mode=offpolicy_gspo

   The clip range, dual-clip constant and aggregation are read from verl's actor config (``clip_ratio``,
   ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``, ``loss_agg_mode``, and ``global_batch_info`` — the global
   token / sequence counts, ``dp_size`` and ``loss_scale_factor`` of verl's newer worker path), and the loss is scaled to
   verl's own ``agg_loss`` for all four ``loss_agg_mode`` values, so existing configs keep working. verl passes its own
   rollout-correction weights as ``rollout_is_weights``; they multiply the loss like any correction. Metrics come back
   as Python floats, as verl's own losses return them.

   verl's actors are Ray workers: a registration made in the launch script does not reach them. Put the call in a
   module of your own and name it in ``actor_rollout_ref.model.external_lib`` (verl imports it in every worker).
   Unlike verl's built-in ``gspo`` (always seq-mean-token-mean, no dual clip), ``objective="gspo"`` here follows the
   config's ``loss_agg_mode`` and ``clip_ratio_c``.

2. **Rollout correction.** verl's policy-loss signature does not carry the rollout log-probs μ, so corrections that need
   μ (TIS/MIS/IcePop/OPSM/TRM) run where verl computes its ``rollout_is_weights``: :func:`rollout_correction` takes
   ``old_log_prob``, ``rollout_log_probs`` and ``response_mask`` from the batch and returns weights and a keep mask
   (fold ``keep`` into ``response_mask``-weighted weights: ``weights * keep``) plus metrics. The name table in
   ``offpolicy.corrections.importance`` says which offpolicy correction reproduces each verl ``rollout_is``/``rollout_rs``
   setting — with one difference on purpose: our ``mis(lower=L, upper=U)`` bounds act on ρ itself, never on 1/ρ.

Nothing here imports verl except :func:`register_verl_policy_loss`, so the adapters are testable without it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch  # noqa: F401  (the doctests below use it)
from torch import Tensor

from offpolicy.batch import LogProbBatch
from offpolicy.corrections.base import Correction, CorrectionResult
from offpolicy.losses import policy_loss
from offpolicy.ratios import masked_mean

# verl loss_agg_mode → (our aggregation, its max_tokens: None = default, "T" = the padded width, or a number)
VERL_AGGREGATIONS: dict[str, tuple[str, Any]] = {
    "token-mean": ("token_mean", None),
    "seq-mean-token-mean": ("seq_mean_token_mean", None),
    "seq-mean-token-sum": ("seq_mean_token_sum_norm", 1),  # Σ m·L / B: the mean over sequences of token sums
    "seq-mean-token-sum-norm": ("seq_mean_token_sum_norm", "T"),
}


def _verl_scale(mode: str, mask: Tensor, info: dict[str, Any]) -> Tensor | float:
    """Factor that turns our micro-batch aggregate into verl's ``agg_loss`` (core_algos.py) with its
    ``global_batch_info`` (``dp_size``, ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``; empty on
    verl's legacy worker path, where every default below is the micro-batch's own count and the factor is 1).

    token-mean: Σ m·L / batch_num_tokens · dp_size; seq-mean-token-mean / seq-mean-token-sum: Σ over non-empty
    sequences / global_batch_size · dp_size; seq-mean-token-sum-norm: Σ m·L / loss_scale_factor (default T), with no B.
    """
    m = mask.float()
    dp_size = float(info.get("dp_size") or 1)
    rows = m.sum(dim=-1)
    if mode == "token-mean":
        tokens = m.sum()
        total = info.get("batch_num_tokens")
        return tokens / (tokens if total is None else torch.as_tensor(total, dtype=m.dtype)).clamp(min=1.0) * dp_size
    if mode == "seq-mean-token-sum-norm":
        factor = info.get("loss_scale_factor") or mask.shape[-1]
        return mask.shape[0] * mask.shape[-1] / float(factor)
    nonempty = (rows > 0).float().sum()
    total = info.get("global_batch_size")
    # ours: seq-mean-token-mean divides by the non-empty sequences, seq-mean-token-sum (max_tokens=1) by all B
    ours = nonempty if mode == "seq-mean-token-mean" else torch.as_tensor(float(mask.shape[0]))
    verl = nonempty if total is None else torch.as_tensor(float(total))
    return ours / verl.clamp(min=1.0) * dp_size


def _config_value(config: Any, key: str, default: Any) -> Any:
    """Read ``key`` from a verl ActorConfig / DictConfig / dict / None; ``default`` when absent or None."""
    if config is None:
        return default
    value = config.get(key, None) if isinstance(config, dict) or hasattr(config, "get") else getattr(config, key, None)
    return default if value is None else value


def verl_policy_loss_fn(
    *, correction: Correction | None = None, objective: str = "ppo", legacy_tuple: bool = False
) -> Callable[..., Any]:
    """Build a function with verl's policy-loss signature that computes :func:`offpolicy.policy_loss`.

    Returned ``fn(old_log_prob [B,T], log_prob [B,T], advantages [B,T], response_mask [B,T], loss_agg_mode="token-mean",
    config=None, rollout_is_weights=None) -> (loss, metrics)`` where metrics (Python floats) uses verl's names
    (``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``) plus every offpolicy metric. ``legacy_tuple=True`` returns verl's older
    4-tuple ``(loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)`` instead.

    ``correction`` runs on (π_θ, π_old) only — verl gives the loss no μ — so use it for staleness-side corrections; put
    μ-side corrections in :func:`rollout_correction`.

    >>> fn = verl_policy_loss_fn()
    >>> lp = torch.zeros(1, 2, requires_grad=True)
    >>> loss, m = fn(torch.zeros(1, 2), lp, torch.ones(1, 2), torch.ones(1, 2), "token-mean", {"clip_ratio": 0.2})
    >>> loss.item(), m["actor/pg_clipfrac"]
    (-1.0, 0.0)
    """

    def compute_policy_loss(
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Tensor | None = None,
    ) -> Any:
        if loss_agg_mode not in VERL_AGGREGATIONS:
            raise ValueError(f"loss_agg_mode must be one of {tuple(VERL_AGGREGATIONS)}, got {loss_agg_mode!r}")
        aggregation, max_tokens = VERL_AGGREGATIONS[loss_agg_mode]
        if max_tokens == "T":
            max_tokens = response_mask.shape[-1]
        clip_ratio = float(_config_value(config, "clip_ratio", 0.2))
        clip_low = float(_config_value(config, "clip_ratio_low", clip_ratio))
        clip_high = float(_config_value(config, "clip_ratio_high", clip_ratio))
        dual_clip = _config_value(config, "clip_ratio_c", None)
        batch = LogProbBatch(logp=log_prob, old_logp=old_log_prob, mask=response_mask, advantages=advantages)
        result = correction(batch) if correction is not None else None
        if rollout_is_weights is not None:
            external = CorrectionResult(rollout_is_weights.detach().float(), batch.bool_mask, {})
            result = external if result is None else result.then(external)
        loss, metrics = policy_loss(
            batch,
            correction=result,
            objective=objective,  # type: ignore[arg-type]
            clip_low=clip_low,
            clip_high=clip_high,
            dual_clip=None if dual_clip is None or objective == "reinforce" else float(dual_clip),
            aggregation=aggregation,  # type: ignore[arg-type]
            max_tokens=max_tokens,
        )
        info = _config_value(config, "global_batch_info", None) or {}
        loss = loss * _verl_scale(loss_agg_mode, response_mask, dict(info))
        ppo_kl = masked_mean(old_log_prob.float() - log_prob.detach().float(), response_mask)
        pg_clipfrac = metrics["loss/clipfrac_low"] + metrics["loss/clipfrac_high"]
        pg_clipfrac_lower = metrics["loss/dual_clip_frac"]
        if legacy_tuple:
            return loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower
        verl_names = {"actor/pg_clipfrac": pg_clipfrac, "actor/ppo_kl": ppo_kl, "actor/pg_clipfrac_lower": pg_clipfrac_lower}
        # Python floats, as verl's own losses return (its driver averages them with numpy): the logging boundary
        return loss, {k: float(v.detach()) for k, v in {**metrics, **verl_names}.items()}

    return compute_policy_loss


def register_verl_policy_loss(name: str = "offpolicy", **kwargs: Any) -> Callable[..., Any]:
    """Register :func:`verl_policy_loss_fn` (``kwargs`` forwarded) in verl's registry under ``name``; returns the fn.

    Raises ``ImportError`` with the install hint when verl is not installed.
    """
    try:
        from verl.trainer.ppo.core_algos import register_policy_loss
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("register_verl_policy_loss needs verl: pip install 'offpolicy[verl]'") from err
    fn = verl_policy_loss_fn(**kwargs)
    return register_policy_loss(name)(fn)


def rollout_correction(
    old_log_prob: Tensor,
    rollout_log_probs: Tensor,
    response_mask: Tensor,
    correction: Correction,
    *,
    advantages: Tensor | None = None,
    prefix: str = "rollout_corr/",
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Apply an offpolicy correction to verl's batch tensors: ``(weights [B,T], keep [B,T] bool, metrics)``.

    π_θ is π_old here (the correction runs once per rollout, before the updates), so ``source="mismatch"`` and
    ``source="total"`` agree. ``advantages`` ([B] or [B,T]) is needed by OPSM.

    >>> from offpolicy.corrections.importance import tis
    >>> w, keep, m = rollout_correction(torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, -2.0]]), torch.ones(1, 2), tis(upper=2.0))
    >>> w
    tensor([[1., 2.]])
    """
    if not isinstance(correction, Correction):
        raise ValueError(f"correction must be an offpolicy Correction, got {type(correction).__name__}")
    batch = LogProbBatch(
        logp=old_log_prob.detach(),
        old_logp=old_log_prob,
        rollout_logp=rollout_log_probs,
        mask=response_mask,
        advantages=advantages,
    )
    result = correction(batch)
    return result.weights, result.keep, {prefix + k: v for k, v in result.metrics.items()}
