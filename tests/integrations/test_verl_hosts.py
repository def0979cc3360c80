"""The verl plug-in refuses what its actor strategy or rollout backend cannot honour, on verl 0.9.1's own configs.

The configs are verl's: ``ppo_trainer`` (FSDP actor) and ``ppo_megatron_trainer`` composed by Hydra from
verl/trainer/config, with the overrides a user would pass on the command line. Every method of the plug-in's FSDP
engine under Megatron is refused in one line naming its key; a driver-side correction is not; FSDP passes. A
sampling recipe under SGLang is refused; verl's own top-k / top-p that the engine does not replay are refused where
the plug-in's agent loop sends them.
"""

from __future__ import annotations

import json
import os

import pytest

verl = pytest.importorskip("verl")
hydra = pytest.importorskip("hydra")

from offpolicy.integrations.verl.hosts import check_verl_host, engine_settings  # noqa: E402
from offpolicy.integrations.verl.settings import parse_settings  # noqa: E402

CONFIG_DIR = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")


def verl_config(name: str = "ppo_trainer", *overrides: str):
    """verl's trainer config ``name`` as its ``main_ppo`` composes it, with ``overrides`` (vLLM rollout unless
    overridden: verl's ``rollout.name`` is mandatory)."""
    from hydra import compose, initialize_config_dir

    if not any(o.startswith("actor_rollout_ref.rollout.name=") for o in overrides):
        overrides = ("actor_rollout_ref.rollout.name=vllm", *overrides)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name=name, overrides=list(overrides))


@pytest.fixture(scope="module")
def configs():
    return {"fsdp": verl_config(), "fsdp2": verl_config("ppo_trainer", "actor_rollout_ref.actor.strategy=fsdp2"),
            "megatron": verl_config("ppo_megatron_trainer"),
            "megatron_override": verl_config("ppo_trainer", "actor_rollout_ref.actor.strategy=megatron")}


# each setting of the plug-in that needs its FSDP engine, and the key its refusal must name
ENGINE_SETTINGS = [
    ({"sampling": {"min_p": 0.01}, "sync_check": "off"}, "sampling.min_p (DVP)"),
    ({"sampling": {"top_k": 20}, "sync_check": "off"}, "sampling.top_k (sampling replay)"),
    ({"sampling": {"top_p": 0.9}, "sync_check": "off"}, "sampling.top_p (sampling replay)"),
    ({"sampling": {"min_p": 0.01, "top_k": 20}, "sync_check": "off"}, "sampling.min_p (sampling replay)"),
    ({"topk_logprobs": 8, "correction": {"name": "trm"}, "sync_check": "off"}, "topk_logprobs (top-K TRM"),
    ({"alp": {"init_std": 0.03}, "sync_check": "off"}, "alp (ALP)"),
    ({"score_centering": True, "topk_logprobs": 4, "sync_check": "off"}, "topk_logprobs"),
    ({"correction": {"name": "tis", "upper": 2.0}}, "sync_check (the sync check's actor probe)"),
]


@pytest.mark.parametrize("block, named", ENGINE_SETTINGS)
@pytest.mark.parametrize("which", ["megatron", "megatron_override"])
def test_every_engine_setting_is_refused_under_megatron_naming_its_key(configs, block, named, which):
    settings = parse_settings(block)
    with pytest.raises(ValueError) as err:
        check_verl_host(configs[which], settings, sync_check=True)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"OFFPOLICY_VERL: {named}")
    assert "actor_rollout_ref.actor.strategy=megatron is not supported (use fsdp or fsdp2" in text


@pytest.mark.parametrize("block, named", ENGINE_SETTINGS)
@pytest.mark.parametrize("which", ["fsdp", "fsdp2"])
def test_fsdp_passes_every_setting(configs, block, named, which):
    check_verl_host(configs[which], parse_settings(block), sync_check=True)


def test_score_centering_alone_is_named_when_it_is_the_only_engine_method_left(configs):
    # topk_logprobs is named first; engine_settings lists score centering too
    needs = engine_settings(parse_settings({"score_centering": True, "topk_logprobs": 4}), configs["megatron"],
                            sync_check=False)
    assert ("score_centering", "score centering") in needs


def test_a_driver_correction_alone_runs_under_megatron_and_the_sync_check_is_the_trainers(configs):
    tis = parse_settings({"correction": {"name": "tis", "upper": 2.0}, "sync_check": "off"})
    check_verl_host(configs["megatron"], tis, sync_check=True)
    # the agent loop runs no sync check: its default "error" is not refused there
    check_verl_host(configs["megatron"], parse_settings({"correction": {"name": "tis", "upper": 2.0}}),
                    sync_check=False, agent_loop=True)
    with pytest.raises(ValueError, match="set sync_check: off"):
        check_verl_host(configs["megatron"], parse_settings({}), sync_check=True)


@pytest.mark.parametrize("loss", ["offpolicy_ipo", "offpolicy_bypass", "offpolicy_m2po"])
def test_a_plugin_loss_that_reads_mu_is_refused_under_megatron(loss):
    config = verl_config("ppo_megatron_trainer", f"actor_rollout_ref.actor.policy_loss.loss_mode={loss}")
    settings = parse_settings({"sync_check": "off"})
    with pytest.raises(ValueError, match=rf"^actor_rollout_ref.actor.policy_loss.loss_mode={loss} \(μ in the policy "
                                         r"loss .*strategy=megatron is not supported"):
        check_verl_host(config, settings, sync_check=True)
    # a plug-in loss that reads only π_old passes; on FSDP the μ-reading one passes
    check_verl_host(verl_config("ppo_megatron_trainer", "actor_rollout_ref.actor.policy_loss.loss_mode=offpolicy"),
                    settings, sync_check=True)
    check_verl_host(verl_config("ppo_trainer", f"actor_rollout_ref.actor.policy_loss.loss_mode={loss}"), settings,
                    sync_check=True)


@pytest.mark.parametrize("sampling", [{"min_p": 0.01}, {"top_k": 20}, {"top_p": 0.9}, {"min_p": 0.01, "top_p": 0.9}])
def test_a_sampling_recipe_under_sglang_is_refused_naming_both_settings(sampling):
    config = verl_config("ppo_trainer", "actor_rollout_ref.rollout.name=sglang")
    settings = parse_settings({"sampling": sampling, "sync_check": "off"})
    first = next(k for k in ("min_p", "top_k", "top_p") if k in sampling)
    with pytest.raises(ValueError, match=rf"^OFFPOLICY_VERL: sampling.{first} is not supported with "
                                         r"actor_rollout_ref.rollout.name=sglang: SGLang reports"):
        check_verl_host(config, settings, sync_check=True)
    check_verl_host(verl_config("ppo_trainer"), settings, sync_check=True)  # the same recipe under vLLM


def test_sglang_without_a_recipe_passes(configs):
    config = verl_config("ppo_trainer", "actor_rollout_ref.rollout.name=sglang")
    check_verl_host(config, parse_settings({"correction": {"name": "tis", "upper": 2.0}, "topk_logprobs": 4}),
                    sync_check=True)


@pytest.mark.parametrize("override, named", [("actor_rollout_ref.rollout.top_k=50", "rollout.top_k=50"),
                                             ("actor_rollout_ref.rollout.top_p=0.9", "rollout.top_p=0.9")])
def test_verls_own_truncation_the_engine_does_not_replay_is_refused_for_the_plugins_agent_loop(override, named):
    config = verl_config("ppo_trainer", override)
    dvp = parse_settings({"sampling": {"min_p": 0.01}})
    with pytest.raises(ValueError, match=rf"^actor_rollout_ref.{named} truncates the rollout but the plug-in's "
                                         "engine does not replay it"):
        check_verl_host(config, dvp, sync_check=True, agent_loop=True)
    # the trainer refuses it too once the config names the plug-in's agent loop, and not with verl's own loop
    with pytest.raises(ValueError, match="does not replay it"):
        check_verl_host(verl_config("ppo_trainer", override,
                                    "actor_rollout_ref.rollout.agent.default_agent_loop=offpolicy_agent"),
                        dvp, sync_check=True)
    check_verl_host(config, dvp, sync_check=True)
    # the recipe that replays verl's value passes
    key, value = override.removeprefix("actor_rollout_ref.rollout.").split("=")
    replayed = parse_settings({"sampling": {"min_p": 0.01, key: int(value) if key == "top_k" else float(value)}})
    check_verl_host(config, replayed, sync_check=True, agent_loop=True)


def test_the_trainer_refuses_before_verl_builds_anything(monkeypatch, configs):
    from offpolicy.integrations.verl.driver import make_trainer_class

    built = []

    class StandInVerlTrainer:
        def __init__(self, config):
            built.append(config)

    cls = make_trainer_class(StandInVerlTrainer)
    monkeypatch.setenv("OFFPOLICY_VERL", json.dumps({"alp": {}, "sync_check": "off"}))
    with pytest.raises(ValueError, match="^OFFPOLICY_VERL: alp"):
        cls(configs["megatron"])
    assert built == []
    cls(configs["fsdp"])
    assert len(built) == 1


def test_the_agent_loop_refuses_at_construction(monkeypatch, configs):
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    from offpolicy.integrations.verl.agent_loop import OffPolicyAgentLoop

    def verls_init(self, *args, config=None, **kwargs):  # what verl's AgentLoopBase keeps: the whole config
        self.config = config

    monkeypatch.setattr(SingleTurnAgentLoop, "__init__", verls_init)
    monkeypatch.setenv("OFFPOLICY_VERL", json.dumps({"sampling": {"min_p": 0.01}}))
    with pytest.raises(ValueError, match="^OFFPOLICY_VERL: sampling.min_p .*strategy=megatron"):
        OffPolicyAgentLoop(config=configs["megatron"])
    with pytest.raises(ValueError, match="rollout.top_p=0.9 truncates the rollout"):
        OffPolicyAgentLoop(config=verl_config("ppo_trainer", "actor_rollout_ref.rollout.top_p=0.9"))
    OffPolicyAgentLoop(config=configs["fsdp"])
