"""The verl plug-in: name this module in ``actor_rollout_ref.model.external_lib`` and configure it in the config.

verl imports ``external_lib`` in every process that builds the model config — the driver (for the tokenizer), each
agent-loop worker and each training worker — so importing this module is the one switch. It registers, in verl's own
registries:

* the policy losses ``offpolicy`` (PPO), ``offpolicy_<objective>`` for every registered objective
  (``actor_rollout_ref.actor.policy_loss.loss_mode=offpolicy_cispo`` …; verl's actor config sets the clip range and
  aggregation) and ``offpolicy_m2po`` (PPO with M2PO's mask on log π_θ − log μ, arXiv 2510.01161, τ = 0.04); those
  that read μ (``offpolicy_ipo``, ``offpolicy_bypass``, ``offpolicy_m2po``) get it from the engine below;
* the training engine :class:`~offpolicy.integrations.verl.engine.OffPolicyFSDPEngine` for FSDP / FSDP2 language
  models on the current device and vendor (``EngineRegistry`` looks a (device, vendor) entry up before verl's own
  device-only one); it is verl's engine unchanged until the settings ask for a sampling recipe or ALP;
* the agent loop ``offpolicy_agent`` (``actor_rollout_ref.rollout.agent.default_agent_loop=offpolicy_agent``);
* the trainer ``offpolicy`` (``trainer.v1.trainer_mode=offpolicy``): verl's ``sync`` trainer with the settings'
  correction applied after the advantages (:mod:`.driver`); it refuses to be built when verl's own
  ``algorithm.rollout_correction`` (``rollout_is`` / ``rollout_rs``) is on as well (a double correction). verl picks the trainer class *before* it imports
  ``external_lib`` in the driver, so this one registration must happen at ``import verl``: the job environment
  ``VERL_USE_EXTERNAL_MODULES=offpolicy.integrations.verl.plugin`` (``ray_kwargs.ray_init.runtime_env.env_vars``) makes
  verl import this module on import in every process. (offpolicy declares no ``verl.plugins`` entry point on purpose:
  that would swap the engine of every verl run in an environment where offpolicy happens to be installed.)

Each registration is skipped (and reported by :func:`registered`) when the verl part it needs does not import here —
e.g. the v1 trainer needs ``transfer_queue`` (PyPI's ``transferqueue``, which the ``verl`` extra installs and
``pip install verl`` does not) — so a training worker without those packages still gets its engine. On a machine
without an accelerator verl 0.9.1 falls back to NVIDIA's platform, so the engine registers for ``(cuda, nvidia)``.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)
_REGISTERED: dict[str, str] = {}


def registered() -> dict[str, str]:
    """What this process registered: ``{"policy_loss": "offpolicy", "engine": "(cuda, nvidia)", …}`` or the reason
    a part was skipped (``"skipped: …"``)."""
    return dict(_REGISTERED)


def register_verl_engine(device: str | None = None, vendor: str | None = None) -> str:
    """Register the engine subclass for ``device`` / ``vendor`` (default: verl's current ones); idempotent."""
    from verl.utils.device import get_device_name, get_vendor
    from verl.workers.engine.base import EngineRegistry

    from offpolicy.integrations.verl.engine import OffPolicyFSDPEngine

    device = device or get_device_name()
    vendor = vendor or get_vendor()
    table = EngineRegistry._engines.get("language_model", {})
    if all((device, vendor) not in table.get(backend, {}) for backend in ("fsdp", "fsdp2")):
        EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device=device,
                                vendor=vendor)(OffPolicyFSDPEngine)
    return f"({device}, {vendor})"


def register_trainer(name: str = "offpolicy", base: str = "sync") -> str:
    """Register verl's ``base`` v1 trainer with the driver correction under ``name``; idempotent."""
    from verl.trainer.ppo.v1 import trainer_base

    from offpolicy.integrations.verl.driver import make_trainer_class

    if name not in trainer_base.TRAINER_REGISTRY:
        trainer_base.register_trainer(name)(make_trainer_class(trainer_base.get_trainer_cls(base)))
    return name


def install() -> dict[str, str]:
    """Register every part that imports here; returns :func:`registered`. Warns once per process when verl, vLLM or
    torch is installed outside the versions the plug-in was tested with (:mod:`offpolicy.integrations.versions`)."""
    from offpolicy.integrations.versions import check_versions

    check_versions("verl", "vllm", "torch", user="offpolicy's verl plug-in")
    parts = {
        "policy_loss": lambda: _policy_loss(),
        "engine": register_verl_engine,
        "agent_loop": _agent_loop,
        "trainer": register_trainer,
    }
    for part, fn in parts.items():  # each is idempotent; rerun because the device may have been set since
        try:
            _REGISTERED[part] = fn()
        except Exception as err:  # noqa: BLE001 - e.g. a verl component whose dependencies this process lacks
            _REGISTERED[part] = f"skipped: {type(err).__name__}: {err}"
            logger.warning("offpolicy verl plug-in: %s not registered (%s: %s)", part, type(err).__name__, err)
    return registered()


def _policy_loss() -> str:
    """``offpolicy`` (PPO), ``offpolicy_<objective>`` for every registered objective (cispo, sapo, dppo_tv, dppo_kl,
    gspo, reinforce, ipo, bypass …) and ``offpolicy_m2po`` (PPO + ``m2po(source="total")``). The ones that read μ
    need the plug-in's engine, which hands the loss the micro-batch's ``rollout_log_probs`` (refused under another
    actor strategy: :func:`~offpolicy.integrations.verl.hosts.check_verl_host`)."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    from offpolicy.integrations.verl.hosts import plugin_policy_losses
    from offpolicy.integrations.verl.loss import register_verl_policy_loss

    names = plugin_policy_losses()
    for loss_name, kwargs in names.items():
        if loss_name not in POLICY_LOSS_REGISTRY:
            register_verl_policy_loss(loss_name, **kwargs)
    return ", ".join(names)


def _agent_loop() -> str:
    from offpolicy.integrations.verl.agent_loop import AGENT_NAME

    return AGENT_NAME


install()
