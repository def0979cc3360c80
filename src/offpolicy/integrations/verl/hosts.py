"""Which verl hosts the plug-in's parts run on: the actor's training strategy and the rollout backend, checked once
against verl's full config before anything is built.

Most of the plug-in's methods live in its training engine, :class:`~.engine.OffPolicyFSDPEngine`, which
:mod:`.plugin` registers for verl's ``fsdp`` / ``fsdp2`` backends only: verl's ``TrainingWorker`` builds its engine
with ``EngineRegistry.new(backend=actor.strategy)`` (verl 0.9.1 ``workers/engine_workers.py``), so under
``actor_rollout_ref.actor.strategy=megatron`` (or ``veomni``, ``torchtitan``) verl's own engine runs and every method
of the plug-in's engine would be silently skipped — DVP's min-p log-prob, sampling replay, the top-K KL bounds, ALP,
score centering, μ in the policy loss — and the sync check's actor probe would go through an engine it was never run
on. :func:`check_verl_host` refuses each of them in one line naming the key; a driver-side ``correction`` (it reads
only the step's tensors) is allowed on every strategy.

The sampling recipe is replayed in vLLM's order (min-p, then top-k, then top-p, each renormalising what the last
left) against the rollout's reported log-probs, which vLLM's ``processed_logprobs`` (verl's default
``logprobs_mode``) computes on that same truncated distribution. SGLang does neither (its sampler,
``python/sglang/srt/layers/sampler.py``, read for SGLang 0.5, the version verl 0.9.1's ``sglang`` extra pins:
``Sampler.forward`` returns ``log(probs)`` of the tempered softmax *before* truncation, so μ is not the distribution
that sampled; top-k and top-p are applied jointly on the untruncated probabilities — flashinfer's
``top_k_top_p_sampling_from_probs(filter_apply_order="joint")`` and the PyTorch fallback alike — and with min-p set
the flashinfer path applies top-k, then top-p, then min-p). Under ``actor_rollout_ref.rollout.name=sglang`` (or
``trtllm``, whose sampler was not read) a sampling recipe is refused. The agent loop also never sends a truncation the
actor does not replay: verl's own ``rollout.top_k`` / ``rollout.top_p`` must be off or equal to the recipe's.
"""

from __future__ import annotations

from typing import Any

from offpolicy.integrations.verl.settings import VerlSettings

FSDP_STRATEGIES = ("fsdp", "fsdp2")  # the backends the plug-in's engine is registered for (plugin.register_verl_engine)
REPLAYED_ROLLOUTS = ("vllm",)  # rollout backends whose truncation order and reported log-probs the engine replays
STRATEGY_KEY = "actor_rollout_ref.actor.strategy"
ROLLOUT_KEY = "actor_rollout_ref.rollout.name"
BYPASS_KEY = "algorithm.rollout_correction.bypass_mode"  # π_old is μ: verl runs no old-log-prob forward
LOSS_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"
AGENT_LOOP_KEY = "actor_rollout_ref.rollout.agent.default_agent_loop"
AGENT_NAME = "offpolicy_agent"  # the plug-in's agent loop in verl's registry (:mod:`.agent_loop`)


def plugin_policy_losses() -> dict[str, dict[str, Any]]:
    """verl loss name → :func:`~.loss.register_verl_policy_loss` arguments, for every loss the plug-in registers.

    >>> plugin_policy_losses()["offpolicy_m2po"]
    {'objective': 'ppo', 'correction': {'name': 'm2po', 'source': 'total'}}
    """
    from offpolicy.registry import OBJECTIVES

    return {"offpolicy": {"objective": "ppo"},
            **{f"offpolicy_{name}": {"objective": name} for name in OBJECTIVES},
            "offpolicy_m2po": {"objective": "ppo", "correction": {"name": "m2po", "source": "total"}}}


def config_value(config: Any, key: str) -> Any:
    """``key`` (dotted) of verl's config — an OmegaConf node or nested dicts; None where absent or ``???``.

    >>> config_value({"actor_rollout_ref": {"actor": {"strategy": "megatron"}}}, STRATEGY_KEY)
    'megatron'
    >>> config_value({}, ROLLOUT_KEY) is None
    True
    """
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf comes with verl
        pass
    else:
        if isinstance(config, DictConfig):
            return OmegaConf.select(config, key, default=None, throw_on_missing=False)
    node = config
    for part in key.split("."):
        if not hasattr(node, "get"):
            return None
        node = node.get(part, None)
        if node is None:
            return None
    return node


def engine_settings(settings: VerlSettings, config: Any, *, sync_check: bool) -> list[tuple[str, str]]:
    """The set keys that need the plug-in's engine, as ``(key, method)``: the settings' (``sampling.min_p`` → DVP …),
    the sync check when this caller runs it (the plug-in's trainer) and verl's ``loss_mode`` when it is one of the
    plug-in's losses that read μ.

    >>> from offpolicy.integrations.verl.settings import parse_settings
    >>> engine_settings(parse_settings({"sampling": {"min_p": 0.01}, "alp": {}}), {}, sync_check=False)
    [('sampling.min_p', 'DVP'), ('alp', 'ALP')]
    """
    from offpolicy.losses import needs_rollout_logp
    from offpolicy.registry import build_correction

    recipe = settings.sampling
    out: list[tuple[str, str]] = []
    if recipe.min_p is not None:
        out.append(("sampling.min_p", "DVP" if recipe.dvp_only else "sampling replay"))
    out += [(f"sampling.{k}", "sampling replay") for k in ("top_k", "top_p") if getattr(recipe, k) is not None]
    if settings.topk_logprobs > 0:
        out.append(("topk_logprobs", "top-K TRM bounds"))
    if settings.alp is not None:
        out.append(("alp", "ALP"))
    if settings.score_centering:
        out.append(("score_centering", "score centering"))
    if sync_check and settings.sync_check != "off":
        out.append(("sync_check", "the sync check's actor probe"))
    loss = config_value(config, LOSS_KEY)
    spec = plugin_policy_losses().get(str(loss))
    if spec is not None:
        reads = needs_rollout_logp(build_correction(spec.get("correction")), spec["objective"])
        if reads:
            out.append((f"{LOSS_KEY}={loss}", f"μ in the policy loss ({', '.join(reads)})"))
    return out


def _refuse_strategy(config: Any, settings: VerlSettings, *, sync_check: bool) -> None:
    strategy = config_value(config, STRATEGY_KEY)
    if strategy is None or str(strategy) in FSDP_STRATEGIES:
        return
    needs = engine_settings(settings, config, sync_check=sync_check)
    if needs:
        key, method = needs[0]
        remedy = "set sync_check: off" if key == "sync_check" else f"remove {key}"
        where = "" if key.startswith(LOSS_KEY) else "OFFPOLICY_VERL: "
        raise ValueError(f"{where}{key} ({method}) needs the plug-in's FSDP actor engine; {STRATEGY_KEY}={strategy} "
                         f"is not supported (use fsdp or fsdp2, or {remedy})")


def _refuse_rollout(config: Any, settings: VerlSettings) -> None:
    name = config_value(config, ROLLOUT_KEY)
    if name is None or str(name) in REPLAYED_ROLLOUTS or not settings.sampling.active:
        return
    key = next(f"sampling.{k}" for k in ("min_p", "top_k", "top_p") if getattr(settings.sampling, k) is not None)
    why = ("SGLang reports the log-probs of the untruncated tempered softmax and applies top-k and top-p jointly "
           "(python/sglang/srt/layers/sampler.py), not the renormalised vLLM-order recipe the plug-in's engine "
           "replays" if str(name) == "sglang" else "its sampler's truncation order is not one the engine replays")
    raise ValueError(f"OFFPOLICY_VERL: {key} is not supported with {ROLLOUT_KEY}={name}: {why} (use "
                     f"{ROLLOUT_KEY}=vllm, or remove sampling)")


def _refuse_unreplayed_truncation(config: Any, settings: VerlSettings) -> None:
    """verl's agent loop puts ``rollout.top_k`` / ``rollout.top_p`` in every training request; the plug-in's agent
    loop overrides them with the recipe's where it sets them, and the engine replays the recipe alone."""
    recipe = settings.sampling
    top_k, top_p = (config_value(config, f"actor_rollout_ref.rollout.{k}") for k in ("top_k", "top_p"))
    if top_k is not None and int(top_k) > 0 and recipe.top_k is None:
        sent = f"actor_rollout_ref.rollout.top_k={top_k}"
        fix = f"set it to -1 or put top_k: {top_k} in OFFPOLICY_VERL's sampling"
    elif top_p is not None and float(top_p) < 1.0 and recipe.top_p is None:
        sent = f"actor_rollout_ref.rollout.top_p={top_p}"
        fix = f"set it to 1.0 or put top_p: {top_p} in OFFPOLICY_VERL's sampling"
    else:
        return
    raise ValueError(f"{sent} truncates the rollout but the plug-in's engine does not replay it (its recipe is "
                     f"OFFPOLICY_VERL's sampling): {fix}")


def check_verl_host(config: Any, settings: VerlSettings, *, sync_check: bool, agent_loop: bool = False) -> None:
    """Refuse, in one ``ValueError`` naming the key, a setting the plug-in cannot honour on this verl config:

    * a method of the plug-in's engine under an actor strategy other than ``fsdp`` / ``fsdp2``
      (:func:`engine_settings`; ``sync_check``: whether this caller runs the sync check — the plug-in's trainer);
    * a sampling recipe with a rollout other than vLLM (see the module docstring);
    * verl's ``rollout.top_k`` / ``rollout.top_p`` truncating the rollout without the recipe's replaying it, where
      the plug-in's agent loop sends the requests (``agent_loop``: the caller is that loop; else the config's
      ``default_agent_loop`` names it).

    ``config`` is verl's full config (OmegaConf or dicts). The trainer calls this at construction, the agent loop at
    its own (it sends the truncation).

    >>> from offpolicy.integrations.verl.settings import parse_settings
    >>> fsdp = {"actor_rollout_ref": {"actor": {"strategy": "fsdp"}, "rollout": {"name": "vllm"}}}
    >>> check_verl_host(fsdp, parse_settings({"sampling": {"min_p": 0.01}}), sync_check=True)
    >>> mega = {"actor_rollout_ref": {"actor": {"strategy": "megatron"}, "rollout": {"name": "vllm"}}}
    >>> check_verl_host(mega, parse_settings({"sampling": {"min_p": 0.01}}), sync_check=True)
    Traceback (most recent call last):
    ...
    ValueError: OFFPOLICY_VERL: sampling.min_p (DVP) needs the plug-in's FSDP actor engine; actor_rollout_ref.actor.strategy=megatron is not supported (use fsdp or fsdp2, or remove sampling.min_p)
    """
    _refuse_strategy(config, settings, sync_check=sync_check)
    _refuse_rollout(config, settings)
    if agent_loop or config_value(config, AGENT_LOOP_KEY) == AGENT_NAME:
        _refuse_unreplayed_truncation(config, settings)


__all__ = ["AGENT_NAME", "FSDP_STRATEGIES", "REPLAYED_ROLLOUTS", "check_verl_host", "config_value",
           "engine_settings", "plugin_policy_losses"]
