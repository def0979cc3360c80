"""The verl sync check under ``actor_rollout_ref.rollout.free_cache_engine=True`` (verl's default): it scores the
probe only while the rollout is awake.

verl 0.9.1's ``sync`` trainer sleeps every replica after sampling (``PPOTrainerSync.on_sample_end`` →
``sleep_replicas``; also once at start-up, before loading a checkpoint) and pushes in ``on_init_end`` /
``on_step_end`` through ``update_weights``, which for a colocated rollout resumes the weights, pushes, and resumes
the KV cache before it returns (``workers/engine_workers.py``: ``rollout.resume(tags=["weights"])`` …
``rollout.resume(tags=["kv_cache"])``). The plug-in's trainer runs its check after verl's hook returns, so the
replica is fully awake; this stand-in of verl's trainer keeps that order and a scorer that refuses a sleeping
replica, so a check moved before verl's push — or run from ``on_sample_end`` — fails here."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("verl")

from offpolicy.integrations.verl.sync_check import VerlSyncCheck  # noqa: E402
from offpolicy.models.tiny import build_tiny_model  # noqa: E402
from offpolicy.rollout.scoring import sequence_logprobs  # noqa: E402
from offpolicy.rollout.sync_check import SyncCheckError, SyncProbe  # noqa: E402


class Replica:
    """A rollout replica with verl's ``free_cache_engine`` states: ``sleep`` frees weights and KV cache,
    ``resume(tag)`` brings one back; scoring needs both (vLLM schedules nothing while memory sleeps)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = build_tiny_model(seed=0)[0]
        self.model.load_state_dict(model.state_dict())
        self.asleep: set[str] = set()
        self.push_works = True

    def sleep(self) -> None:
        self.asleep = {"weights", "kv_cache"}

    def resume(self, tag: str) -> None:
        self.asleep.discard(tag)

    def score(self, prompt_ids, completion_ids):
        if self.asleep:
            raise RuntimeError(f"scored while {sorted(self.asleep)} sleep")
        with torch.no_grad():
            return sequence_logprobs(self.model, prompt_ids, completion_ids)


def _trainer(monkeypatch):
    from offpolicy.integrations.verl.driver import make_trainer_class

    monkeypatch.setenv("OFFPOLICY_VERL", json.dumps({"correction": {"name": "tis", "upper": 2.0}}))
    actor, tok = build_tiny_model(seed=0)
    replica = Replica(actor)

    class StandInSyncTrainer:
        """verl's ``PPOTrainerSync`` hooks with ``free_cache_engine=True`` (naive checkpoint backend)."""

        def update_weights(self) -> None:  # ActorRolloutRefWorker.update_weights
            replica.resume("weights")
            if replica.push_works:
                replica.model.load_state_dict(actor.state_dict())
            replica.resume("kv_cache")

        def on_init_end(self) -> None:
            self.update_weights()

        def on_step_end(self) -> None:
            self.update_weights()

        def on_sample_end(self) -> None:
            replica.sleep()

    trainer = object.__new__(make_trainer_class(StandInSyncTrainer))
    trainer.config, trainer.global_steps, trainer._pending_sync_metrics = {}, 0, {}

    def actor_side(probe):
        with torch.no_grad():
            return sequence_logprobs(actor, probe.prompt_ids, probe.completion_ids)

    trainer._offpolicy_check = VerlSyncCheck(replica, actor_side, SyncProbe.from_text(tok))
    replica.sleep()  # PPOTrainer.init: "sleep all replicas to load checkpoint"
    return trainer, actor, replica


def _update(actor, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(torch.randn(p.shape, generator=g), alpha=0.02)


def test_every_sync_is_scored_on_an_awake_rollout_in_verls_order(monkeypatch):
    trainer, actor, replica = _trainer(monkeypatch)
    trainer.on_init_end()  # calibrates after verl's initial push woke the replica
    for step in range(1, 4):
        trainer.on_sample_end()  # generation done: verl frees the rollout's memory for the update
        assert replica.asleep == {"weights", "kv_cache"}
        _update(actor, seed=step)
        trainer.global_steps = step
        trainer.on_step_end()
        assert trainer._pending_sync_metrics["sync/ok"] == 1.0
    assert trainer._offpolicy_check.checks == 4 and trainer._offpolicy_check.passed == 4


def test_a_broken_push_is_still_caught(monkeypatch):
    trainer, actor, replica = _trainer(monkeypatch)
    trainer.on_init_end()
    trainer.on_sample_end()
    _update(actor, seed=1)
    replica.push_works = False
    trainer.global_steps = 1
    with pytest.raises(SyncCheckError, match="verl step 1"):
        trainer.on_step_end()
