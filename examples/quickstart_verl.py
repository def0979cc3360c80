"""verl quickstart: one correction (truncated importance sampling) switched on in verl 0.9 by five config keys —
checked as far as verl starts on a CPU. docs/quickstart-verl.md walks through it.

    python examples/quickstart_verl.py                  # 15-40 s on 2 cores (importing verl is most of it)
    python examples/quickstart_verl.py --print-command  # the GPU launch command, nothing else

What it runs, in the order ``python -m verl.trainer.main_ppo`` would:

1. the job environment of the launch command (``VERL_USE_EXTERNAL_MODULES``, ``OFFPOLICY_VERL``) is set and
   ``import verl`` imports the plug-in, which registers its policy losses, engine, agent loop and trainer in verl's
   own registries (what every Ray worker does);
2. verl's own ``ppo_trainer.yaml`` is composed with the launch command's overrides (Hydra, as ``main_ppo`` does) and
   checked by verl's ``validate_config``;
3. the plug-in reads its settings (``OFFPOLICY_VERL``) as the driver will, checks them against verl's own
   ``algorithm.rollout_correction`` as the plug-in's trainer does at construction (and shows the one-line refusal
   when verl's own IS is switched on too), and applies the correction to a made-up GRPO step whose advantages come
   from verl's own ``compute_grpo_outcome_advantage`` — what the plug-in's trainer does after verl's
   ``_compute_advantage`` at every step.

The trainer part registers only where ``transfer_queue`` imports (verl's v1 trainer imports it; PyPI's
``transferqueue``, which the ``verl`` extra installs — ``pip install verl`` alone does not). verl 0.9.1 has no CPU
platform: on a machine without an accelerator it falls back to NVIDIA's, so the engine is registered for
``(cuda, nvidia)``, the device a GPU worker looks up.

Where it stops: ``main_ppo`` would now call ``ray.init`` and start verl's ``TaskRunnerV1``, which starts the
TransferQueue's Ray actors and places the FSDP training workers and the vLLM / SGLang rollout servers on GPUs.
Nothing after that point runs on a CPU.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import shlex
import time

# The launch command: verl's GRPO example (examples/grpo_trainer in verl's repository, GSM8K, one GPU) …
VERL_OVERRIDES = [
    "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=false",
    "data.train_files=$HOME/data/gsm8k/train.parquet",
    "data.val_files=$HOME/data/gsm8k/test.parquet",
    "data.train_batch_size=64",
    "data.max_prompt_length=512",
    "data.max_response_length=1024",
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=32",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.actor.use_kl_loss=false",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "trainer.n_gpus_per_node=1",
    "trainer.nnodes=1",
    "trainer.total_epochs=1",
    "trainer.logger=console",
]
# … plus offpolicy's five keys: the plug-in in every process, μ kept, the correction after verl's advantages, and the
# settings as one environment variable of the Ray job (it reaches the driver and every worker)
OFFPOLICY_OVERRIDES = [
    "actor_rollout_ref.model.external_lib=offpolicy.integrations.verl.plugin",
    "actor_rollout_ref.rollout.calculate_log_probs=true",
    "trainer.v1.trainer_mode=offpolicy",
    "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES=offpolicy.integrations.verl.plugin",
    "+ray_kwargs.ray_init.runtime_env.env_vars.OFFPOLICY_VERL='{correction: {name: tis, upper: 2.0}}'",
]
ENV_PREFIX = "+ray_kwargs.ray_init.runtime_env.env_vars."


def launch_command() -> str:
    """The GPU launch command, one override per line."""
    lines = ["python -m verl.trainer.main_ppo"] + [f"  {_shell(o)}" for o in VERL_OVERRIDES + OFFPOLICY_OVERRIDES]
    return " \\\n".join(lines)


def _shell(override: str) -> str:
    """As a user types it: ``$HOME`` left to the shell, a value in single quotes (Hydra's string) inside double."""
    if "'" in override:
        return f'"{override}"'
    return override if "$" in override else shlex.quote(override)


def job_environment() -> dict[str, str]:
    """What Ray puts in every process's environment: the ``env_vars`` of the launch command."""
    env = {}
    for override in OFFPOLICY_OVERRIDES:
        if override.startswith(ENV_PREFIX):
            key, value = override[len(ENV_PREFIX):].split("=", 1)
            env[key] = value.strip("'")
    return env


def compose_config(overrides: list[str]):
    """verl's ``ppo_trainer`` config with ``overrides``, as ``main_ppo``'s ``@hydra.main`` composes it."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    home = os.path.expanduser("~")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=[o.replace("$HOME", home) for o in overrides])


def made_up_step():
    """A GRPO step of two prompts × three responses: rewards, response mask, π_old and a μ that differs from it."""
    import torch

    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 3, 4, 5, 2, 4])
    mask = (torch.arange(5)[None] < lengths[:, None]).float()
    old = -torch.rand(6, 5, generator=g) * 2
    rollout = old + 0.5 * torch.randn(6, 5, generator=g)  # an engine whose log-probs differ by ~0.5 nats
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    rewards = torch.zeros(6, 5)
    rewards[torch.arange(6), lengths - 1] = scores  # verl's outcome reward sits on the last response token
    return {"old_log_probs": old, "rollout_log_probs": rollout * mask, "response_mask": mask,
            "token_level_rewards": rewards, "uid": ["p0", "p0", "p0", "p1", "p1", "p1"]}


def run() -> dict:
    """Steps 1–3 of the module docstring; returns what each produced (for the test and the printout)."""
    os.environ.update(job_environment())  # 1. Ray's job environment, then `import verl` imports the plug-in
    import numpy as np
    import verl  # noqa: F401  (imports VERL_USE_EXTERNAL_MODULES)
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from offpolicy.integrations.verl import plugin
    from offpolicy.integrations.verl.driver import apply_driver_correction, refuse_double_correction
    from offpolicy.integrations.verl.settings import settings_from_environment

    config = compose_config(VERL_OVERRIDES + OFFPOLICY_OVERRIDES)  # 2. verl's config and verl's own checks
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    settings = settings_from_environment()  # 3. what the driver reads, then one step of its correction
    refuse_double_correction(config.algorithm, settings)  # verl's own correction is off in this config: passes
    both_on = copy.deepcopy(config.algorithm)
    both_on.rollout_correction.rollout_is = "token"  # verl's own token IS as well: what the trainer refuses
    try:
        refuse_double_correction(both_on, settings)
        refused = "nothing (a double correction went through)"
    except ValueError as err:
        refused = str(err)
    step = made_up_step()
    advantages, _ = compute_grpo_outcome_advantage(step["token_level_rewards"], step["response_mask"],
                                                   np.array(step["uid"], dtype=object))
    updates, metrics = apply_driver_correction({**step, "advantages": advantages}, settings)
    trainer_base = None
    if importlib.util.find_spec("transfer_queue") is not None:
        from verl.trainer.ppo.v1 import get_trainer_cls

        from offpolicy.integrations.verl.driver import OffPolicyTrainerMixin

        # verl's own trainer: the first class in the MRO after the plug-in's mixin
        mro = get_trainer_cls(config.trainer.v1.trainer_mode).__mro__
        trainer_base = mro[mro.index(OffPolicyTrainerMixin) + 1].__name__
        stop = ("ray.init, then verl's TaskRunnerV1 starts the TransferQueue's Ray actors and asks Ray for GPUs for "
                "the FSDP workers and the vLLM server")
    else:
        stop = ("verl's TaskRunnerV1 imports transfer_queue (not installed here: pip install transferqueue==0.1.11), "
                "then asks Ray for GPUs for the workers")
    return {"config": config, "registered": plugin.registered(), "settings": settings, "refused": refused,
            "trainer_base": trainer_base, "step": step, "advantages": advantages, "updates": updates,
            "metrics": metrics, "stop": stop}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print-command", action="store_true", help="print the GPU launch command and exit")
    if parser.parse_args().print_command:
        print(launch_command())
        return
    started = time.perf_counter()
    out = run()
    cfg = out["config"]
    print("1. the plug-in in verl's registries (what every Ray worker registers on `import verl`):")
    import torch

    for part, what in out["registered"].items():
        if part == "engine" and not torch.cuda.is_available():
            what += "  (no accelerator here: verl 0.9.1 falls back to NVIDIA's device names, what a GPU worker uses)"
        if part == "trainer" and out["trainer_base"]:
            what += f"  (verl's {out['trainer_base']} + the correction after the advantages)"
        print(f"     {part:12s} {what}")
    print("2. verl's ppo_trainer config + the launch command's overrides: composed and validated by verl")
    print(f"     trainer.v1.trainer_mode = {cfg.trainer.v1.trainer_mode}, "
          f"actor_rollout_ref.model.external_lib = {cfg.actor_rollout_ref.model.external_lib}, "
          f"rollout.calculate_log_probs = {cfg.actor_rollout_ref.rollout.calculate_log_probs}")
    print(f"3. the driver's settings: correction = {out['settings'].correction}; verl's own rollout_correction "
          "off, as the trainer checks at construction")
    print(f"     with algorithm.rollout_correction.rollout_is=token as well, the trainer refuses: {out['refused']}")
    mask = out["step"]["response_mask"].bool()
    ratio = (out["step"]["old_log_probs"] - out["step"]["rollout_log_probs"]).exp()[mask]
    weights = out["updates"]["rollout_is_weights"][mask]
    print(f"     one made-up GRPO step, after verl's compute_grpo_outcome_advantage: {int(mask.sum())} response "
          f"tokens, ratio π_old/μ in [{ratio.min():.2f}, {ratio.max():.2f}]")
    print(f"     TIS weights (rollout_is_weights the actor's loss multiplies in) in [{weights.min():.2f}, "
          f"{weights.max():.2f}]; capped at 2.0: {int((ratio > 2.0).sum())} of {int(mask.sum())} tokens")
    for key in sorted(out["metrics"])[:6]:
        print(f"     {key} = {float(out['metrics'][key]):.4g}")
    print(f"stops here; next in main_ppo: {out['stop']}.")
    print(f"finished in {time.perf_counter() - started:.0f} s; the launch command on a GPU machine: "
          "python examples/quickstart_verl.py --print-command")


if __name__ == "__main__":
    main()
