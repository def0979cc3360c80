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
   verl's own ``agg_loss`` for all five ``loss_agg_mode`` values (of the installed verl's release: the rules changed in
   0.6, 0.7.1 and 0.9), so existing configs keep working. verl passes its own
   rollout-correction weights as ``rollout_is_weights``; they multiply the loss like any correction. Metrics come back
   as Python floats, as verl's own losses return them.

   verl's actors are Ray workers: a registration made in the launch script does not reach them. Put the call in a
   module of your own and name it in ``actor_rollout_ref.model.external_lib`` (verl imports it in every worker).
   Unlike verl's built-in ``gspo`` (always seq-mean-token-mean, no dual clip), ``objective="gspo"`` here follows the
   config's ``loss_agg_mode`` and ``clip_ratio_c``.

2. **Rollout correction.** verl's policy-loss signature does not carry the rollout log-probs μ, so corrections that need
   μ (TIS/MIS/IcePop/OPSM/TRM) run where verl computes its ``rollout_is_weights``: :func:`rollout_correction` takes
   ``old_log_prob``, ``rollout_log_probs`` and ``response_mask`` from the batch and returns weights and a keep mask
   plus metrics. Write ``response_mask * keep`` and ``weights`` back to the batch (as ``response_mask`` and
   ``rollout_is_weights``) to do what verl's ``compute_rollout_correction_and_add_to_batch`` does — a rejected token
   leaves the loss's denominators; or keep ``response_mask`` and pass ``weights * keep`` to leave it in them. The name table in
   ``offpolicy.corrections.importance`` says which offpolicy correction reproduces each verl ``rollout_is``/``rollout_rs``
   setting — with one difference on purpose: our ``mis(lower=L, upper=U)`` bounds act on ρ itself, never on 1/ρ.

Nothing here imports verl except :func:`register_verl_policy_loss`, so the adapters are testable without it.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor

from offpolicy.batch import LogProbBatch, nonfinite_fields, nonfinite_rollout_limit
from offpolicy.corrections.base import Correction, CorrectionResult
from offpolicy.integrations.verl.settings import (
    NONFINITE_SETTING,
    nonfinite_limit_from_environment,
    transforms_from_environment,
)
from offpolicy.losses import needs_rollout_logp, policy_loss
from offpolicy.metrics import check_naming, offpolicy_metrics
from offpolicy.ratios import LOG_RATIO_BOUND
from offpolicy.registry import OBJECTIVES, CorrectionSpec, build_correction, split_spec
from offpolicy.transforms import apply_transforms

# verl loss_agg_mode → the offpolicy aggregation computed before :func:`_verl_scale` rescales it to verl's agg_loss
VERL_AGGREGATIONS: dict[str, str] = {
    "token-mean": "token_mean",
    "token-sum": "token_sum",
    "seq-mean-token-mean": "seq_mean_token_mean",
    "seq-mean-token-sum": "token_sum",
    "seq-mean-token-sum-norm": "token_sum",
}
NEWEST_VERL_RULES = (0, 9, 1)  # the agg_loss rules used when verl is not installed and no version is given

# μ of the micro-batch whose loss is being computed: verl's ``ppo_loss`` calls the policy loss without the rollout
# log-probs, so the plug-in's engine (:class:`~offpolicy.integrations.verl.engine.OffPolicyFSDPEngine`) sets it around
# its ``forward_step`` from the micro-batch's ``rollout_log_probs`` field
_ROLLOUT_LOGP: ContextVar[Tensor | None] = ContextVar("offpolicy_verl_rollout_logp", default=None)


@contextmanager
def rollout_log_probs_in_loss(rollout_log_probs: Tensor | None) -> Iterator[None]:
    """Inside, policy losses built by :func:`verl_policy_loss_fn` read ``rollout_log_probs`` [B, T] (laid out as
    the ``old_log_prob`` verl passes them) as μ; None: no μ.

    >>> fn = verl_policy_loss_fn(objective={"name": "ipo", "kl_tau": 0.0})
    >>> with rollout_log_probs_in_loss(torch.log(torch.tensor([[0.45]]))):   # |0.5 − 0.45| ≤ 0.1: −1 · 0.5/0.45
    ...     loss, m = fn(torch.zeros(1, 1), torch.log(torch.tensor([[0.5]])), torch.ones(1, 1), torch.ones(1, 1))
    >>> round(loss.item(), 4), m["loss/ipo_masked"]
    (-1.1111, 0.0)
    """
    token = _ROLLOUT_LOGP.set(rollout_log_probs)
    try:
        yield
    finally:
        _ROLLOUT_LOGP.reset(token)


def _version_tuple(version: str) -> tuple[int, int, int]:
    """``"0.7.1"`` / ``"0.9.1.dev0"`` / ``"0.6"`` → (0, 7, 1) / (0, 9, 1) / (0, 6, 0)."""
    parts = re.findall(r"\d+", version)[:3]
    if not parts:
        raise ValueError(f"verl_version must look like '0.9.1', got {version!r}")
    return tuple(int(p) for p in parts + ["0"] * (3 - len(parts)))  # type: ignore[return-value]


def _installed_verl_version() -> tuple[int, int, int] | None:
    try:
        return _version_tuple(importlib.metadata.version("verl"))
    except importlib.metadata.PackageNotFoundError:
        return None


def _verl_scale(mode: str, mask: Tensor, info: dict[str, Any], version: tuple[int, int, int]) -> Tensor:
    """Factor that turns the :data:`VERL_AGGREGATIONS` aggregate of one micro-batch into verl's ``agg_loss``
    (``verl/trainer/ppo/core_algos.py``) at verl ``version``, given its ``global_batch_info`` (``dp_size``,
    ``batch_num_tokens``, ``global_batch_size``, ``loss_scale_factor``; empty before 0.7 and on the legacy worker path,
    where every count defaults to the micro-batch's own).

    With n tokens and S sequences with a token (S_all = B before 0.6, which averaged over every row) in the micro-batch,
    D = dp_size, N = batch_num_tokens (default n), G = global_batch_size (default S), F = loss_scale_factor (default T):

    * token-mean                  Σ/n  · n/N · D
    * token-sum (verl ≥ 0.9)      Σ    · D
    * seq-mean-token-mean         Σ_i mean_i/S · S/G · D
    * seq-mean-token-sum          Σ    · D/G
    * seq-mean-token-sum-norm     Σ    · D/(G·F)   since verl 0.7.1;  Σ/F before (no sequence count: B× larger)
    """
    m = mask.float()
    one = torch.ones((), dtype=torch.float32, device=mask.device)

    def count(key: str, default: Tensor) -> Tensor:
        value = info.get(key)
        return default if value is None else torch.as_tensor(value, dtype=torch.float32, device=mask.device)

    dp_size = count("dp_size", one)
    if mode == "token-mean":
        tokens = m.sum()
        return tokens / count("batch_num_tokens", tokens).clamp(min=1.0) * dp_size
    if mode == "token-sum":
        return dp_size
    nonempty = (m.sum(dim=-1) > 0).float().sum()
    sequences = count("global_batch_size", nonempty if version >= (0, 6, 0) else one * mask.shape[0]).clamp(min=1.0)
    if mode == "seq-mean-token-mean":
        return nonempty / sequences * dp_size
    if mode == "seq-mean-token-sum":
        return dp_size / sequences
    horizon = count("loss_scale_factor", one * mask.shape[-1])
    if version >= (0, 7, 1):
        return dp_size / (sequences * horizon)
    return 1.0 / horizon


def _config_value(config: Any, key: str, default: Any) -> Any:
    """Read ``key`` from a verl ActorConfig / DictConfig / dict / None; ``default`` when absent or None."""
    if config is None:
        return default
    value = config.get(key, None) if isinstance(config, dict) or hasattr(config, "get") else getattr(config, key, None)
    return default if value is None else value


# an objective's parameter → the verl actor-config keys that set it, first found wins (verl reuses clip_ratio as DPPO's
# divergence threshold and clip_ratio_c as its ratio cap, as its own dppo_tv / dppo_kl do)
VERL_PARAMETERS: dict[str, tuple[str, ...]] = {
    "clip_low": ("clip_ratio_low", "clip_ratio"),
    "clip_high": ("clip_ratio_high", "clip_ratio"),
    "dual_clip": ("clip_ratio_c",),
    "delta_low": ("clip_ratio_low", "clip_ratio"),
    "delta_high": ("clip_ratio_high", "clip_ratio"),
    "ratio_cap": ("clip_ratio_c",),
    "tau_pos": ("tau_pos",),
    "tau_neg": ("tau_neg",),
}


def verl_objective(objective: str | dict[str, Any], config: Any) -> dict[str, Any]:
    """The objective spec for :func:`~offpolicy.policy_loss`: its own parameters, then the ones verl's actor config
    sets among those the objective takes (:data:`VERL_PARAMETERS`); ``clip_ratio`` 0.2 when the config has none.

    >>> verl_objective("sapo", {"tau_pos": 1.0, "tau_neg": 1.05, "clip_ratio": 0.2})
    {'name': 'sapo', 'tau_pos': 1.0, 'tau_neg': 1.05}
    >>> verl_objective("ppo", None)
    {'name': 'ppo', 'clip_low': 0.2, 'clip_high': 0.2}
    """
    name, params = split_spec(objective, "objective")
    takes = OBJECTIVES[name].parameters()
    spec: dict[str, Any] = {"name": name}
    for parameter, keys in VERL_PARAMETERS.items():
        if parameter not in takes or parameter in params:
            continue
        default = 0.2 if keys[-1] == "clip_ratio" else None
        values = [_config_value(config, key, None) for key in keys]
        value = next((v for v in values if v is not None), default)
        if value is not None:
            spec[parameter] = float(value)
    return {**spec, **params}


# objectives whose ratio is π_θ/π_old per token under PPO's clip: verl's vanilla metrics apply to them as they stand
VANILLA_METRIC_OBJECTIVES = frozenset({"ppo", "decoupled"})


@torch.no_grad()
def verl_vanilla_metrics(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
                         spec: dict[str, Any] | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(pg_clipfrac, ppo_kl, pg_clipfrac_lower)`` as verl 0.9.1's ``compute_policy_loss_vanilla`` computes them
    (``verl/trainer/ppo/core_algos.py``), 0-d float32, from [B, T] tensors; ``spec`` is the objective's
    (``clip_low``, ``clip_high``, ``dual_clip``), None for ``ppo_kl`` alone (the fractions are then 0).

    verl clamps log r = log π_θ − log π_old to ±20 *before* both metrics: ``ppo_kl`` is the mean of −clamp(log r)
    and ``pg_clipfrac`` counts a token only where PPO's clip changes its surrogate for the sign of its advantage —
    A > 0 and r > 1 + ε_high, or A < 0 and r < 1 − ε_low, on the clamped r. offpolicy's own ``loss/clipfrac_*``
    also count a token whose |log r| > 20 whatever its advantage (it has no gradient: "held"), and its ``ppo_kl``
    would not clamp; the two agree until the policy moves by more than e^20 on a token, which a large step does
    (the second mini-batch of a ``token-sum`` run at a high learning rate). ``pg_clipfrac_lower``: A < 0 and
    max(r, clip(r)) > ``clip_ratio_c``. Means over ``response_mask`` as verl's ``masked_mean`` (Σ / (count + 1e−8)).

    >>> old, new = torch.zeros(1, 3), torch.tensor([[-25.0, 0.5, -0.5]])   # r = e^−25 (A > 0), e^0.5, e^−0.5
    >>> fr, kl, low = verl_vanilla_metrics(old, new, torch.tensor([[1.0, 1.0, -1.0]]), torch.ones(1, 3),
    ...                                    {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": 3.0})
    >>> round(fr.item(), 4), round(kl.item(), 4), low.item()   # clipped: tokens 1 (A>0, r>1.2), 2 (A<0, r<0.8)
    (0.6667, 6.6667, 0.0)
    """
    mask = response_mask.bool()
    denominator = mask.sum().float() + 1e-8
    log_r = (log_prob.detach().float() - old_log_prob.float()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ppo_kl = (-log_r * mask).sum() / denominator
    zero = torch.zeros((), dtype=torch.float32, device=log_r.device)
    if spec is None:
        return zero, ppo_kl, zero
    a = advantages.float()
    ratio = torch.exp(log_r)
    eps_low = float(spec.get("clip_low", 0.2))
    high = spec.get("clip_high")
    eps_high = eps_low if high is None else float(high)
    unclipped, clipped = -a * ratio, -a * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    pg_clipfrac = (torch.gt(clipped, unclipped).float() * mask).sum() / denominator
    c = spec.get("dual_clip")
    if c is None:
        return pg_clipfrac, ppo_kl, zero
    dual = torch.gt(torch.maximum(unclipped, clipped), -a * float(c)) & (a < 0)
    return pg_clipfrac, ppo_kl, (dual.float() * mask).sum() / denominator


def verl_policy_loss_fn(
    *,
    correction: Correction | CorrectionSpec | list[CorrectionSpec] | None = None,
    objective: str | dict[str, Any] = "ppo",
    legacy_tuple: bool = False,
    verl_version: str | None = None,
    max_nonfinite_rollout: float | None = None,
    transforms: Sequence[Any] | None = None,
) -> Callable[..., Any]:
    """Build a function with verl's policy-loss signature that computes :func:`offpolicy.policy_loss`.

    Returned ``fn(old_log_prob [B,T], log_prob [B,T], advantages [B,T], response_mask [B,T], loss_agg_mode="token-mean",
    config=None, rollout_is_weights=None) -> (loss, metrics)`` where metrics (Python floats) uses verl's names
    (``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``) plus every offpolicy metric. ``legacy_tuple=True`` returns verl's older
    4-tuple ``(loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)`` instead.

    verl's loss gives the policy loss no μ; the plug-in's engine supplies the micro-batch's ``rollout_log_probs``
    (:func:`rollout_log_probs_in_loss`), so that ``correction`` may read μ (``m2po(source="total")``: log π_θ − log μ)
    and ``objective`` may be one that reads it (``ipo``, ``bypass``); such a loss without μ raises. A correction here
    runs per micro-batch (M2PO's batch-level selection too); corrections that need only π_old and μ belong in the
    driver (:func:`rollout_correction`), once per step. ``objective`` is a registered name (``ppo``, ``cispo``,
    ``dppo_tv``, ``sapo``, a plug-in's …) or ``{"name": ..., **params}``; verl's actor config sets the parameters it
    takes (:func:`verl_objective`). Corrections may be given by name too (:func:`offpolicy.build_correction`).

    ``verl_version`` picks the ``agg_loss`` rules to match (they changed: ``seq-mean-token-sum-norm`` divides by the
    sequence count since verl 0.7.1, ``token-sum`` exists since 0.9); default: the installed verl's version, or the
    newest rules known here when verl is not installed. ``max_nonfinite_rollout``: the limit on non-finite μ (None:
    ``OFFPOLICY_VERL``'s ``max_nonfinite_rollout``, else the default), named ``OFFPOLICY_VERL: max_nonfinite_rollout``
    on a refusal. ``transforms``: plug-in transform specs run on each micro-batch's batch before the correction
    (:func:`offpolicy.transforms.apply_transforms`; None: ``OFFPOLICY_VERL``'s ``plugin_transforms``).

    >>> fn = verl_policy_loss_fn()
    >>> lp = torch.zeros(1, 2, requires_grad=True)
    >>> loss, m = fn(torch.zeros(1, 2), lp, torch.ones(1, 2), torch.ones(1, 2), "token-mean", {"clip_ratio": 0.2})
    >>> loss.item(), m["actor/pg_clipfrac"]
    (-1.0, 0.0)
    """

    if verl_version is not None:
        rules = _version_tuple(verl_version)
    else:
        rules = _installed_verl_version() or NEWEST_VERL_RULES
    correction = correction if isinstance(correction, Correction) else build_correction(correction)
    nonfinite_rollout_limit(max_nonfinite_rollout, setting="max_nonfinite_rollout")  # a bad value fails here
    spec = verl_objective(objective, None)  # an unknown objective or parameter fails here, not in the first step
    needs_mu = needs_rollout_logp(correction, spec["name"])

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
        mu = _ROLLOUT_LOGP.get()
        if needs_mu and mu is None:
            raise ValueError(f"rollout_log_probs: μ, read by {', '.join(needs_mu)} in verl's policy loss, reaches the "
                             "loss only through the plug-in's engine (external_lib=offpolicy.integrations.verl.plugin) "
                             "with rollout_log_probs in the batch (rollout.calculate_log_probs=True)")
        if mu is not None and mu.shape != log_prob.shape:
            raise ValueError(f"rollout_log_probs: shape {tuple(mu.shape)} differs from log_prob's "
                             f"{tuple(log_prob.shape)}")
        limit = max_nonfinite_rollout if max_nonfinite_rollout is not None else nonfinite_limit_from_environment()
        batch = LogProbBatch(logp=log_prob, old_logp=old_log_prob, mask=response_mask, advantages=advantages,
                             rollout_logp=None if mu is None else mu.to(log_prob.device).float(),
                             **nonfinite_fields(limit, setting=NONFINITE_SETTING))
        batch = apply_transforms(batch, transforms if transforms is not None else transforms_from_environment())
        result = correction(batch) if correction is not None else None
        if rollout_is_weights is not None:
            external = CorrectionResult(rollout_is_weights.detach().float(), batch.bool_mask, {})
            result = external if result is None else result.then(external)
        loss, metrics = policy_loss(batch, correction=result, objective=verl_objective(objective, config),
                                    aggregation=VERL_AGGREGATIONS[loss_agg_mode])
        info = _config_value(config, "global_batch_info", None) or {}
        loss = loss * _verl_scale(loss_agg_mode, response_mask, dict(info), rules)
        spec_now = verl_objective(objective, config)
        if spec_now["name"] in VANILLA_METRIC_OBJECTIVES and spec_now.get("level", "token") == "token":
            pg_clipfrac, ppo_kl, pg_clipfrac_lower = verl_vanilla_metrics(
                old_log_prob, log_prob, advantages, response_mask, spec_now)
        else:  # verl's ppo_kl; the clip fractions as the objective counts them
            ppo_kl = verl_vanilla_metrics(old_log_prob, log_prob, advantages, response_mask, None)[1]
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
    correction: Correction | CorrectionSpec | list[CorrectionSpec],
    *,
    advantages: Tensor | None = None,
    naming: str = "verl",
    prefix: str | None = None,
    diagnostics: bool = True,
    token_divergence: Tensor | None = None,
    max_nonfinite_rollout: float | None = None,
    extras: dict[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Apply an offpolicy correction to verl's batch tensors: ``(weights [B,T], keep [B,T] bool, metrics)``.

    π_θ is π_old here (the correction runs once per rollout, before the updates), so ``source="mismatch"`` and
    ``source="total"`` agree. ``advantages`` ([B] or [B,T]) is needed by OPSM; ``token_divergence`` [B,T] (bounds
    on KL(μ ‖ π_old) from the engine's top-K, :mod:`offpolicy.integrations.verl.topk`) is the divergence ``trm``
    tests; ``extras`` are the batch's extras (``dvp_keep`` / ``dvp_mass`` for :func:`~offpolicy.dvp_keep`). ``correction`` is a Correction or registered names (:func:`offpolicy.build_correction`). The metrics are the correction's, under the naming's prefix
    (``prefix`` replaces it), and — ``diagnostics`` — the mismatch diagnostics of :func:`offpolicy.offpolicy_metrics`
    under ``naming`` (verl's ``rollout_corr/…`` names by default), as verl's own helper returns both.
    ``max_nonfinite_rollout``: the limit on non-finite μ (``OFFPOLICY_VERL``'s; None: the default), named
    ``OFFPOLICY_VERL: max_nonfinite_rollout`` on a refusal.

    >>> from offpolicy.corrections.importance import tis
    >>> w, keep, m = rollout_correction(torch.tensor([[0.0, 0.0]]), torch.tensor([[0.0, -2.0]]), torch.ones(1, 2), tis(upper=2.0))
    >>> w
    tensor([[1., 2.]])
    """
    names = check_naming(naming)
    if not isinstance(correction, Correction):
        if not isinstance(correction, (str, dict, list, tuple)):
            raise ValueError(f"correction must be an offpolicy Correction or registered names, got "  # noqa: TRY004
                             f"{type(correction).__name__}")
        correction = build_correction(correction)  # type: ignore[assignment]
        if correction is None:
            raise ValueError("correction is an empty list: give at least one correction")
    batch = LogProbBatch(
        logp=old_log_prob.detach(),
        old_logp=old_log_prob,
        rollout_logp=rollout_log_probs,
        mask=response_mask,
        advantages=advantages,
        extras=dict(extras or {}),
        **nonfinite_fields(max_nonfinite_rollout, setting=NONFINITE_SETTING),
    )
    if token_divergence is not None:  # KL(μ ‖ π_old) bounds from the engine's top-K: what ``trm`` tests
        batch = batch.replace(token_divergence=token_divergence, token_divergence_kind="topk")
    result = correction(batch)  # type: ignore[operator]
    prefix = names.prefix if prefix is None else prefix
    metrics = {prefix + k: v for k, v in result.metrics.items()}
    if diagnostics:
        metrics.update(offpolicy_metrics(old_log_prob, rollout_log_probs, response_mask, result, naming=naming))
    return result.weights, result.keep, metrics
