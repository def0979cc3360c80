"""The plug-in inside verl's separated loops (:mod:`offpolicy.integrations.verl.async_loops`) and the CPU harness of
those loops (:mod:`offpolicy_testkit.verl_async`), without a live run (tests/vllm/test_verl_async_live.py runs them):

* refusals in one line naming the key (a correction under verl's bypass mode, ``topk_logprobs``);
* verl's per-trajectory ``min_global_steps`` / ``max_global_steps`` read and checked, and the staleness metrics of a
  corrected batch against hand-computed numbers (on-policy: k3 0, nothing clipped);
* the trainer mixin over a stand-in of verl's ``SeparateRayPPOTrainer`` steps (the correction after the advantages,
  the sync check after a synchronous and after an asynchronous weight sync, its metrics joined to the next step's);
* the CPU checkpoint engine's transfer (every tensor bit for bit), its topology, and the ``pause_generation`` bridge.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("verl")

from offpolicy_testkit import verl_async  # noqa: E402
from verl import DataProto  # noqa: E402

from offpolicy.integrations.verl import async_loops  # noqa: E402
from offpolicy.integrations.verl.async_loops import (  # noqa: E402
    AsyncSeparatedTrainerMixin,
    SeparatedTrainerMixin,
    make_separated_trainer_class,
    refuse_in_separated_loop,
    staleness_metrics,
    swapped,
    trajectory_versions,
)
from offpolicy.integrations.verl.driver import corrected  # noqa: E402
from offpolicy.integrations.verl.settings import parse_settings  # noqa: E402

TIS = parse_settings({"correction": {"name": "tis", "upper": 2.0}, "sync_check": "off"})
DECOUPLED = {"algorithm": {"rollout_correction": {"bypass_mode": False}},
             "actor_rollout_ref": {"actor": {"strategy": "fsdp2"}, "rollout": {"name": "vllm"}}}


def _batch(old, rollout, mask, versions=None) -> DataProto:
    old, rollout, mask = (torch.tensor(x, dtype=torch.float32) for x in (old, rollout, mask))
    tensors = {"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask,
               "advantages": torch.ones_like(old)}
    non_tensor = {}
    if versions is not None:
        non_tensor = {"min_global_steps": np.array(versions[0], dtype=object),
                      "max_global_steps": np.array(versions[1], dtype=object)}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensor)


def test_a_correction_under_bypass_mode_and_topk_are_refused_naming_the_key():
    bypass = {"algorithm": {"rollout_correction": {"bypass_mode": True}}}
    with pytest.raises(ValueError, match=r"^algorithm\.rollout_correction\.bypass_mode=True and OFFPOLICY_VERL's "
                                         r"correction are both set: .*verl's fully_async config sets it true\)$"):
        refuse_in_separated_loop(bypass, TIS, "fully_async")
    refuse_in_separated_loop(bypass, parse_settings({}), "fully_async")  # no correction: bypass is verl's business
    refuse_in_separated_loop(DECOUPLED, TIS, "one_step_off_policy")
    topk = parse_settings({"correction": "tis", "topk_logprobs": 4})
    with pytest.raises(ValueError, match=r"^OFFPOLICY_VERL: topk_logprobs=4 is not supported in verl's "
                                         r"one_step_off_policy loop"):
        refuse_in_separated_loop(DECOUPLED, topk, "one_step_off_policy")
    with pytest.raises(ValueError, match="loop must be one of"):
        refuse_in_separated_loop(DECOUPLED, TIS, "sync")


def test_trajectory_versions_are_read_and_bad_ones_refused_naming_the_field():
    assert trajectory_versions({}, 2) is None
    low, high = trajectory_versions({"min_global_steps": [1, 0], "max_global_steps": [1, 2]}, 2)
    assert low.tolist() == [1, 0] and high.tolist() == [1, 2] and low.dtype == torch.int64
    with pytest.raises(ValueError, match="batch field 'max_global_steps' is missing while 'min_global_steps'"):
        trajectory_versions({"min_global_steps": [1, 0]}, 2)
    with pytest.raises(ValueError, match="batch field 'min_global_steps' has 3 entries for 2 rows"):
        trajectory_versions({"min_global_steps": [1, 0, 0], "max_global_steps": [1, 2, 0]}, 2)
    with pytest.raises(ValueError, match="'max_global_steps' is below 'min_global_steps'"):
        trajectory_versions({"min_global_steps": [2, 0], "max_global_steps": [1, 0]}, 2)


def test_staleness_metrics_of_a_corrected_batch_match_hand_computed_numbers():
    """Row 0: generated at version 1 (staleness 1 at version 2), ratios e^1 (TIS caps at 2) and 1. Row 1: versions
    0..2 (a partial rollout resumed twice, staleness 2), ratio e^−0.5 and a padding token that must not count."""
    old = [[0.0, -1.0], [-1.5, 0.0]]
    rollout = [[-1.0, -1.0], [-1.0, 9.0]]  # the padding position holds garbage
    data = _batch(old, rollout, [[1, 1], [1, 0]], versions=([1, 0], [1, 2]))
    mask = data.batch["response_mask"].clone()
    corrected(data, TIS)
    out = staleness_metrics(data, mask, version=2)

    def k3(log_ratio):
        return math.exp(log_ratio) - log_ratio - 1

    assert out["offpolicy/staleness/mean"] == pytest.approx((1 + 1 + 2) / 3)
    assert out["offpolicy/staleness/max"] == 2.0
    assert out["offpolicy/staleness/d1/k3_kl"] == pytest.approx((k3(1.0) + k3(0.0)) / 2, rel=1e-5)
    assert out["offpolicy/staleness/d1/clipped_frac"] == pytest.approx(0.5)  # e > 2: capped
    assert out["offpolicy/staleness/d1/tokens"] == 2.0
    assert out["offpolicy/staleness/d2/k3_kl"] == pytest.approx(k3(-0.5), rel=1e-5)
    assert out["offpolicy/staleness/d2/clipped_frac"] == 0.0 and out["offpolicy/staleness/d2/tokens"] == 1.0
    assert out["offpolicy/staleness/span_mean"] == 1.0 and out["offpolicy/staleness/span_max"] == 2.0
    assert all(math.isfinite(v) for v in out.values())


def test_on_policy_staleness_metrics_are_zero_and_a_batch_without_versions_gives_none():
    data = _batch([[-0.3, -2.0]], [[-0.3, -2.0]], [[1, 1]], versions=([3], [3]))
    mask = data.batch["response_mask"].clone()
    corrected(data, TIS)
    out = staleness_metrics(data, mask, version=3)
    assert out["offpolicy/staleness/d0/k3_kl"] == 0.0 and out["offpolicy/staleness/d0/clipped_frac"] == 0.0
    assert out["offpolicy/staleness/mean"] == 0.0 and out["offpolicy/staleness/span_max"] == 0.0
    plain = _batch([[-0.3]], [[-0.3]], [[1]])
    corrected(plain, TIS)
    assert staleness_metrics(plain, plain.batch["response_mask"], version=3) == {}


class _Loop:
    """A stand-in of verl's ``SeparateRayPPOTrainer``'s step methods (one-step: a synchronous weight sync)."""

    def __init__(self, config, batch):
        self.config, self.batch, self.metrics, self.global_steps, self.synced = config, batch, {}, 0, 0

    def _fit_compute_advantage(self, batch):
        return batch

    def _fit_update_weights(self):
        self.synced += 1

    def _fit_collect_metrics(self, batch):
        self.metrics["verl/collected"] = 1.0


class _AsyncLoop(_Loop):
    """The fully async trainer's ``_fit_update_weights`` is a coroutine (None: this step did not sync); its version
    is ``current_param_version``."""

    current_param_version = 5
    sync_now = True

    async def _fit_update_weights(self):
        await asyncio.sleep(0)
        if not self.sync_now:
            return None
        self.synced += 1
        return {"timing": 1.0}


class _Check:
    def __init__(self, trainer):
        self.trainer, self.calls = trainer, []

    def after_sync(self, step):
        self.calls.append((step, self.trainer.synced))  # the push has happened when the check runs
        return {"sync/ok": 1.0, "sync/checks": float(len(self.calls))}


def _trainer(base, monkeypatch, settings=TIS, versions=None):
    monkeypatch.setattr(async_loops, "settings_from_environment", lambda: settings)
    cls = make_separated_trainer_class(base, "fully_async" if base is _AsyncLoop else "one_step_off_policy")
    data = _batch([[0.0, -1.0]], [[-1.0, -1.0]], [[1, 1]], versions=versions)
    trainer = cls(DECOUPLED, data)
    trainer._offpolicy_check = _Check(trainer)
    return trainer, data


def test_the_mixin_corrects_after_the_advantages_and_checks_each_sync(monkeypatch):
    settings = parse_settings({"correction": {"name": "tis", "upper": 2.0}})
    trainer, data = _trainer(_Loop, monkeypatch, settings, versions=([0], [0]))
    assert type(trainer).__name__ == "OffPolicy_Loop" and trainer.offpolicy_loop == "one_step_off_policy"
    trainer._fit_update_weights()  # the initial sync (before step 1)
    trainer.global_steps = 1
    trainer._fit_update_weights()
    out = trainer._fit_compute_advantage(data)
    assert torch.allclose(out.batch["rollout_is_weights"], torch.tensor([[2.0, 1.0]]))  # e capped at 2, then 1
    trainer._fit_collect_metrics(out)
    assert trainer._offpolicy_check.calls == [(0, 1), (1, 2)]
    assert trainer.metrics["sync/checks"] == 2.0 and trainer.metrics["verl/collected"] == 1.0
    assert trainer.metrics["rollout_corr/tis/capped_frac"] == pytest.approx(0.5)  # verl's names, TIS's metrics
    assert trainer.metrics["offpolicy/staleness/d1/tokens"] == 2.0  # version 1 trains data of version 0
    trainer.metrics = {}
    trainer._fit_collect_metrics(out)
    assert "sync/checks" not in trainer.metrics  # pending metrics join one step only


def test_the_mixin_checks_after_an_asynchronous_sync_and_reads_the_param_version(monkeypatch):
    settings = parse_settings({"correction": "tis"})
    trainer, data = _trainer(_AsyncLoop, monkeypatch, settings, versions=([3], [4]))
    assert inspect.iscoroutinefunction(type(trainer)._fit_update_weights)  # Ray awaits only coroutine functions
    assert isinstance(trainer, AsyncSeparatedTrainerMixin)
    assert asyncio.run(trainer._fit_update_weights()) == {"timing": 1.0}
    trainer.sync_now = False  # a step between syncs (trigger_parameter_sync_step > 1): nothing to check
    assert asyncio.run(trainer._fit_update_weights()) is None
    assert trainer._offpolicy_check.calls == [(5, 1)]
    trainer._fit_compute_advantage(data)
    assert trainer.metrics["offpolicy/staleness/d2/tokens"] == 2.0  # 5 − 3
    assert trainer.metrics["offpolicy/staleness/span_max"] == 1.0


def test_the_mixin_without_correction_or_check_leaves_verls_step_alone(monkeypatch):
    trainer, data = _trainer(_Loop, monkeypatch, parse_settings({"sync_check": "off"}))
    trainer._fit_update_weights()
    assert trainer._offpolicy_check.calls == [] and trainer.synced == 1
    assert "rollout_is_weights" not in trainer._fit_compute_advantage(data).batch.keys()
    assert trainer.metrics == {}


def test_the_mixin_refuses_at_construction(monkeypatch):
    monkeypatch.setattr(async_loops, "settings_from_environment", lambda: TIS)
    cls = make_separated_trainer_class(_Loop)
    with pytest.raises(ValueError, match=r"^algorithm\.rollout_correction\.bypass_mode=True"):
        cls({"algorithm": {"rollout_correction": {"bypass_mode": True}}}, None)
    with pytest.raises(ValueError, match="double correction"):
        cls({"algorithm": {"rollout_correction": {"rollout_is": "token", "bypass_mode": False}}}, None)
    with pytest.raises(ValueError, match="loop must be one of"):
        make_separated_trainer_class(_Loop, "sync")
    assert issubclass(cls, SeparatedTrainerMixin)


def test_swapped_restores_the_name_also_on_an_error():
    owner = SimpleNamespace(name="verl's")
    with pytest.raises(RuntimeError), swapped(owner, "name", "ours"):
        assert owner.name == "ours"
        raise RuntimeError
    assert owner.name == "verl's"


def test_the_sync_check_scores_the_fully_async_trainers_replicas():
    from offpolicy.integrations.verl.sync_check import ServerClient, engine_scorers

    replicas = [SimpleNamespace(_server_handle="server-0"), SimpleNamespace(_server_handle="server-1")]
    scorers = engine_scorers(SimpleNamespace(checkpoint_manager=SimpleNamespace(replicas=replicas)))
    assert [s.client.handle for s in scorers] == ["server-0", "server-1"]
    assert all(isinstance(s.client, ServerClient) for s in scorers)
    one = engine_scorers(SimpleNamespace(llm_server_manager=SimpleNamespace(server_handles=["only"])))
    assert [s.client.handle for s in one] == ["only"]  # no get_llm_client: the one server directly


def test_the_cpu_checkpoint_engine_moves_every_tensor_bit_for_bit():
    torch.manual_seed(0)
    weights = [("a.weight", torch.randn(3, 4)), ("b.bias", torch.randn(5).to(torch.bfloat16)),
               ("c", torch.arange(6, dtype=torch.int64))]
    master = verl_async.CPUCheckpointEngine(is_master=True)
    other = verl_async.CPUCheckpointEngine(is_master=False)  # an actor rank > 0: walks the generator, sends nothing
    receivers = [verl_async.CPUCheckpointEngine(), verl_async.CPUCheckpointEngine()]
    metadata = [master.prepare(), other.prepare()] + [r.prepare() for r in receivers]
    actor_kw, rollout_kw = verl_async.CPUCheckpointEngine.build_topology(2, 2, metadata)
    assert actor_kw["rank"] == [0, 1] and rollout_kw["rank"] == [2, 3] and rollout_kw["receivers"] == [2, 2]
    for i, engine in enumerate([master, other]):
        engine.init_process_group(**{k: v[i] for k, v in actor_kw.items()})
    for i, engine in enumerate(receivers):
        engine.init_process_group(**{k: v[i] for k, v in rollout_kw.items()})
    got: dict[int, list] = {}

    async def collect(i):
        got[i] = [(n, t) async for n, t in receivers[i].receive_weights()]

    threads = [threading.Thread(target=lambda i=i: asyncio.run(collect(i))) for i in range(2)]
    for t in threads:
        t.start()
    asyncio.run(master.send_weights(iter(weights)))
    walked = []
    asyncio.run(other.send_weights(w for w in weights if not walked.append(w[0])))
    for t in threads:
        t.join(timeout=30)
    master.finalize()
    assert walked == ["a.weight", "b.bias", "c"]
    for i in range(2):
        assert [n for n, _ in got[i]] == [n for n, _ in weights]
        for (_, sent), (_, received) in zip(weights, got[i]):
            assert received.dtype == sent.dtype and torch.equal(received, sent)
    with pytest.raises(RuntimeError, match="actor rank 0 is not the master"):
        verl_async.CPUCheckpointEngine.build_topology(1, 1, [{"address": None}, {"address": None}])


def test_the_pause_bridge_translates_verls_keyword():
    calls = []

    class Engine:
        async def pause_generation(self, *, mode="abort", clear_cache=True):
            calls.append((mode, clear_cache))

    bridged = verl_async.pause_generation_compat(Engine.pause_generation)
    asyncio.run(bridged(Engine(), wait_for_inflight_requests=False, clear_cache=False))
    asyncio.run(bridged(Engine(), wait_for_inflight_requests=True))
    asyncio.run(bridged(Engine(), mode="keep"))
    assert calls == [("abort", False), ("wait", True), ("keep", True)]


def test_loop_overrides_set_the_separated_loops_apart_and_refuse_what_they_cannot_run():
    assert verl_async.loop_overrides("main_ppo") == []
    stream = dict(item.split("=", 1) for item in verl_async.loop_overrides("fully_async", steps=3, prompts=2))
    assert stream["data.train_batch_size"] == "0" and stream["rollout.total_rollout_steps"] == "6"
    assert stream["async_training.trigger_parameter_sync_step"] == "1"
    assert verl_async.merged(["a=1", "+b=2", "c=3"], ["b=5", "d=4"]) == ["a=1", "c=3", "b=5", "d=4"]
    config = dict(item.split("=", 1) for item in verl_async.loop_overrides("one_step_off_policy"))
    assert config["actor_rollout_ref.hybrid_engine"] == "false"
    assert config["actor_rollout_ref.rollout.checkpoint_engine.backend"] == verl_async.BACKEND
    assert config["actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module"] == "offpolicy_testkit.verl_async"
    assert config["algorithm.rollout_correction.bypass_mode"] == "false"
    with pytest.raises(ValueError, match="loop must be one of"):
        verl_async.loop_overrides("async")
    with pytest.raises(ValueError, match="ranks must be 1 in the one_step_off_policy loop on a CPU, got 2"):
        verl_async.loop_overrides("one_step_off_policy", ranks=2)


def test_the_entry_point_finds_verls_base_config_in_the_package_unless_told():
    assert async_loops.hydra_overrides(["a=1"]) == [async_loops.SEARCHPATH, "a=1"]
    assert async_loops.hydra_overrides(["+hydra.searchpath=[file:///x]", "a=1"]) == ["+hydra.searchpath=[file:///x]",
                                                                                       "a=1"]
    with pytest.raises(SystemExit, match="usage: python -m offpolicy.integrations.verl.async_loops"):
        async_loops.main(["sync"])


def test_the_module_doctests_pass():
    import doctest

    assert doctest.testmod(async_loops).failed == 0
