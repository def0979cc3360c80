"""The sync check inside the verl plug-in's trainer (:mod:`offpolicy.integrations.verl.sync_check`).

* The trainer hooks: the plug-in's trainer class over a stand-in of verl's ``sync`` trainer whose ``on_init_end`` /
  ``on_step_end`` push the actor's weights (the embedded tiny model, fp32) into an engine that computes in bf16 and
  answers through a stand-in of verl's ``LLMServerClient`` (``TokenOutput`` with ``prompt_logprobs`` rows laid out as
  verl's ``extract_prompt_logprobs`` writes them); the actor side is a worker group whose ``compute_log_prob``
  returns verl's layout (log-probs over the whole sequence, row t predicting token t + 1). Six steps of a real
  optimizer pass and log ``sync/*``; a push that does nothing fails the run naming the step.
* The actor side against verl's own ``TrainingWorker`` (FSDP2 on CPU, fp32): :func:`actor_probe_logprobs` through
  its ``infer_batch`` equals the same model's HF forward on the probe.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

verl = pytest.importorskip("verl")
pytest.importorskip("hydra")
pytest.importorskip("transfer_queue")  # verl's v1 trainer imports it

from offpolicy.integrations.verl.settings import parse_settings  # noqa: E402
from offpolicy.integrations.verl.sync_check import VerlClientScorer, VerlSyncCheck, probe_batch  # noqa: E402
from offpolicy.rollout.scoring import sequence_logprobs  # noqa: E402
from offpolicy.rollout.sync_check import SyncCheckError, SyncProbe  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoTokenizer

    from offpolicy.models import load_model, model_path

    model, _ = load_model("tiny")
    return model.float().eval(), AutoTokenizer.from_pretrained(model_path("tiny"))


class StandInClient:
    """verl's ``LLMServerClient.generate`` for scoring requests, on ``engine`` (a bf16 copy of the model): the
    answer's ``extra_fields`` as verl's vLLM server writes them for ``prompt_logprobs=0`` (row r: token r + 1's
    id and log-prob; a dummy last row)."""

    def __init__(self, engine: torch.nn.Module) -> None:
        self.engine, self.requests = engine, []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        self.requests.append(dict(sampling_params))
        assert sampling_params["prompt_logprobs"] == 0 and sampling_params["temperature"] == 1.0
        with torch.no_grad():
            logits = self.engine(torch.tensor([prompt_ids])).logits[0, :-1].float()
        logp = logits.log_softmax(-1).gather(-1, torch.tensor(prompt_ids[1:])[:, None])[:, 0]
        rows_ids = [[t] for t in prompt_ids[1:]] + [[0]]
        rows_lp = [[float(v)] for v in logp] + [[0.0]]
        return TokenOutput(token_ids=[0], extra_fields={"prompt_ids": rows_ids, "prompt_logprobs": rows_lp})


class StandInWorkerGroup:
    """``compute_log_prob(TensorDict)`` as verl's actor answers it: ``log_probs`` jagged over prompt + response."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.calls = model, 0

    def compute_log_prob(self, data):
        from tensordict import TensorDict

        self.calls += 1
        assert data["temperature"] == 1.0 and data["compute_loss"] is False
        rows = []
        for ids in data["input_ids"].unbind(0):
            with torch.no_grad():
                logits = self.model(ids[None]).logits[0].float()
            logp = logits[:-1].log_softmax(-1).gather(-1, ids[1:, None])[:, 0]
            rows.append(torch.cat([logp, torch.zeros(1)]))  # row t predicts token t + 1; the last is padding
        return TensorDict({"log_probs": torch.nested.as_nested_tensor(rows, layout=torch.jagged)},
                          batch_size=len(rows))


class StandInServerHandle:
    """verl's vLLM server actor handle (one per rollout replica): ``generate.remote(...)`` answers as the server
    does, awaitable like Ray's reference."""

    def __init__(self, client: StandInClient) -> None:
        self.client, self.request_ids = client, []
        self.generate = SimpleNamespace(remote=self._remote)

    def _remote(self, *, prompt_ids, sampling_params, request_id):
        self.request_ids.append(request_id)
        return self.client.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)


def _stand_in_trainer(tiny, push_does_nothing_from: int | None = None, monkeypatch=None, replicas: int = 1,
                      missed_by: int | None = None):
    """The plug-in's trainer class over a stand-in of verl's sync trainer (its two sync hooks and the metrics
    stash); the actor an fp32 model with an Adam optimizer, the engine a bf16 copy. With ``replicas`` > 1 each
    replica is a bf16 copy behind a server handle of its own (``llm_server_manager.server_handles``, as verl's hybrid
    engine makes one per rank at TP = 1); ``missed_by``: the one replica whose push does nothing (None: all)."""
    from offpolicy.integrations.verl.driver import make_trainer_class

    model, tokenizer = tiny
    actor = copy.deepcopy(model)
    engines = [copy.deepcopy(model).to(torch.bfloat16) for _ in range(replicas)]
    engine = engines[0]

    class StandInSyncTrainer:
        def push(self) -> None:  # verl's checkpoint_manager.update_weights: every rank into its own replica
            broken = push_does_nothing_from is not None and self.global_steps >= push_does_nothing_from
            for i, replica in enumerate(engines):
                if not (broken and missed_by in (None, i)):
                    replica.load_state_dict(actor.state_dict())

        def on_init_end(self) -> None:
            self.push()

        def on_step_end(self) -> None:
            self.push()

        def _consume_sync_metrics(self) -> dict:
            metrics, self._pending_sync_metrics = self._pending_sync_metrics or {}, {}
            return metrics

        def get_llm_client(self):
            return self.client

    cls = make_trainer_class(StandInSyncTrainer)
    trainer = object.__new__(cls)  # verl's __init__ builds workers; the hooks read these
    trainer.config, trainer.tokenizer, trainer.global_steps = {}, tokenizer, 0
    trainer._pending_sync_metrics = {}
    trainer.client = StandInClient(engine)
    if replicas > 1:
        trainer.llm_server_manager = SimpleNamespace(
            server_handles=[StandInServerHandle(StandInClient(e)) for e in engines])
    trainer.actor_rollout_wg = StandInWorkerGroup(actor)
    trainer.actor = actor
    return trainer


def _train_step(actor: torch.nn.Module, optimizer, tokenizer) -> None:
    """One optimizer step on a fixed sentence's likelihood: the actor's weights move like a training step's."""
    ids = torch.tensor([tokenizer("The answer is 42 because six times seven is 42.")["input_ids"]])
    loss = actor(ids, labels=ids).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_every_sync_of_six_steps_is_checked_and_logged(tiny, monkeypatch):
    monkeypatch.setenv("OFFPOLICY_VERL", json.dumps({"correction": {"name": "tis", "upper": 2.0}}))
    trainer = _stand_in_trainer(tiny)
    trainer.on_init_end()
    calibration = trainer._consume_sync_metrics()
    assert 0 < calibration["sync/baseline"] < 0.05  # fp32 actor against a bf16 engine: a real mismatch
    assert calibration["sync/checks"] == 1.0
    optimizer = torch.optim.Adam(trainer.actor.parameters(), lr=1e-3)
    for step in range(1, 7):
        trainer.global_steps = step
        _train_step(trainer.actor, optimizer, trainer.tokenizer)
        trainer.on_step_end()
        metrics = trainer._consume_sync_metrics()
        assert metrics["sync/ok"] == 1.0, metrics
        assert metrics["sync/gap"] <= metrics["sync/threshold"]
        assert metrics["sync/checks"] == step + 1 and metrics["sync/passed"] == step + 1
    assert metrics["sync/step_rms"] > 0 and metrics["sync/engine_motion"] > 0.5  # the engine moved with the actor
    n_rows = len(SyncProbe.from_text(trainer.tokenizer).prompt_ids)
    # calibration scores the engine twice (repeatability), every later sync once; the actor once per sync
    assert len(trainer.client.requests) == n_rows * 8 and trainer.actor_rollout_wg.calls == 7


@pytest.mark.parametrize("broken_from", [1, 3])
def test_a_push_that_does_nothing_fails_the_run_naming_the_step(tiny, monkeypatch, broken_from):
    monkeypatch.setenv("OFFPOLICY_VERL", "{}")
    trainer = _stand_in_trainer(tiny, push_does_nothing_from=broken_from)
    trainer.on_init_end()
    optimizer = torch.optim.Adam(trainer.actor.parameters(), lr=1e-3)
    with pytest.raises(SyncCheckError, match=f"verl step {broken_from}: "):
        for step in range(1, 7):
            trainer.global_steps = step
            _train_step(trainer.actor, optimizer, trainer.tokenizer)
            trainer.on_step_end()
            trainer._consume_sync_metrics()
    assert trainer.global_steps == broken_from  # caught at the first sync that did not take


def test_warn_logs_sync_ok_0_and_off_checks_nothing(tiny, monkeypatch):
    monkeypatch.setenv("OFFPOLICY_VERL", "{sync_check: warn}")
    trainer = _stand_in_trainer(tiny, push_does_nothing_from=1)
    trainer.on_init_end()
    optimizer = torch.optim.Adam(trainer.actor.parameters(), lr=1e-3)
    trainer.global_steps = 1
    _train_step(trainer.actor, optimizer, trainer.tokenizer)
    trainer.on_step_end()
    metrics = trainer._consume_sync_metrics()
    assert metrics["sync/ok"] == 0.0 and metrics["sync/passed"] == 1.0 and metrics["sync/checks"] == 2.0

    monkeypatch.setenv("OFFPOLICY_VERL", "{sync_check: off}")
    trainer = _stand_in_trainer(tiny, push_does_nothing_from=1)
    trainer.on_init_end()
    trainer.global_steps = 1
    trainer.on_step_end()
    assert trainer._consume_sync_metrics() == {} and trainer.client.requests == []


def test_settings_parse_sync_check():
    assert parse_settings(None).sync_check == "error"
    assert parse_settings({"sync_check": "warn"}).sync_check == "warn"
    assert parse_settings({"sync_check": False}).sync_check == "off"  # YAML's bare off
    with pytest.raises(ValueError, match="OFFPOLICY_VERL: sync_check must be one of error, warn, off"):
        parse_settings({"sync_check": "strict"})
    with pytest.raises(ValueError, match="sync_check must be one of"):
        VerlSyncCheck(None, None, SyncProbe([[1]], [[2]]), on_failure="off")


def test_two_replicas_are_each_scored_on_their_own_server(tiny, monkeypatch):
    """verl's hybrid engine with two FSDP ranks at TP = 1 runs two rollout replicas: the check scores each on its own
    server (never through the load-balancing client) against one actor forward per sync."""
    monkeypatch.setenv("OFFPOLICY_VERL", "{}")
    trainer = _stand_in_trainer(tiny, replicas=2)
    trainer.on_init_end()
    assert trainer._consume_sync_metrics()["sync/replicas"] == 2.0
    optimizer = torch.optim.Adam(trainer.actor.parameters(), lr=1e-3)
    for step in range(1, 4):
        trainer.global_steps = step
        _train_step(trainer.actor, optimizer, trainer.tokenizer)
        trainer.on_step_end()
        metrics = trainer._consume_sync_metrics()
        assert metrics["sync/ok"] == 1.0 and metrics["sync/passed"] == step + 1, metrics
    handles = trainer.llm_server_manager.server_handles
    n_rows = len(SyncProbe.from_text(trainer.tokenizer).prompt_ids)
    # per replica: calibration twice, then once per sync; the actor once per sync for both replicas
    assert [len(h.request_ids) for h in handles] == [n_rows * 5] * 2 and trainer.actor_rollout_wg.calls == 4
    assert trainer.client.requests == []
    ids = [i for h in handles for i in h.request_ids]
    assert len(set(ids)) == len(ids)  # vLLM's request ids unique, as verl's client makes them


@pytest.mark.parametrize("missed_by", [0, 1])
def test_a_replica_that_missed_its_push_fails_the_run_naming_it(tiny, monkeypatch, missed_by):
    monkeypatch.setenv("OFFPOLICY_VERL", "{}")
    trainer = _stand_in_trainer(tiny, push_does_nothing_from=2, replicas=2, missed_by=missed_by)
    trainer.on_init_end()
    optimizer = torch.optim.Adam(trainer.actor.parameters(), lr=1e-3)
    with pytest.raises(SyncCheckError, match=rf"verl step 2: weight sync into the rollout engine \(replica "
                                             rf"{missed_by} of 2\): "):
        for step in range(1, 4):
            trainer.global_steps = step
            _train_step(trainer.actor, optimizer, trainer.tokenizer)
            trainer.on_step_end()
            trainer._consume_sync_metrics()
    assert trainer.global_steps == 2


def test_warn_reports_the_worst_replica(tiny, monkeypatch):
    monkeypatch.setenv("OFFPOLICY_VERL", "{sync_check: warn}")
    trainer = _stand_in_trainer(tiny, push_does_nothing_from=1, replicas=2, missed_by=1)
    trainer.on_init_end()
    optimizer = torch.optim.Adam(trainer.actor.parameters(), lr=1e-3)
    trainer.global_steps = 1
    _train_step(trainer.actor, optimizer, trainer.tokenizer)
    trainer.on_step_end()
    metrics = trainer._consume_sync_metrics()
    assert metrics["sync/ok"] == 0.0 and metrics["sync/checks"] == 2.0 and metrics["sync/passed"] == 1.0
    healthy, missed = trainer._offpolicy_check.replica_checks
    # the metrics are the missed replica's: its gap over its own threshold
    assert metrics["sync/gap"] > metrics["sync/threshold"] == missed.threshold
    with pytest.raises(ValueError, match="engine: at least one rollout replica"):
        VerlSyncCheck([], None, SyncProbe([[1]], [[2]]))


def test_client_scorer_reads_verls_prompt_logprob_rows(tiny):
    """Against the model's own forward: row len(p) − 1 + j is completion token j's log-prob; a server that scored
    other tokens is refused."""
    model, tokenizer = tiny
    probe = SyncProbe.from_text(tokenizer, max_tokens=12)
    logp, mask = VerlClientScorer(StandInClient(model)).score(probe.prompt_ids, probe.completion_ids)
    expected, expected_mask = sequence_logprobs(model, probe.prompt_ids, probe.completion_ids)
    assert torch.equal(mask, expected_mask.bool())
    torch.testing.assert_close(logp * mask, expected * mask, atol=1e-5, rtol=0)

    class Shifted(StandInClient):
        async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
            out = await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)
            out.extra_fields["prompt_ids"] = out.extra_fields["prompt_ids"][1:] + [[0]]
            return out

    with pytest.raises(ValueError, match="probe row 0: the server scored the tokens"):
        VerlClientScorer(Shifted(model)).score(probe.prompt_ids, probe.completion_ids)


def test_probe_batch_repeats_rows_to_the_data_parallel_size():
    probe = SyncProbe([[1, 2], [3]], [[4], [5, 6, 7]])
    data = probe_batch(probe, multiple=2)
    assert len(data) == 2
    data = probe_batch(probe, multiple=4)
    assert len(data) == 4
    assert [r.tolist() for r in data["input_ids"].unbind(0)] == [[1, 2, 4], [3, 5, 6, 7], [3, 5, 6, 7], [3, 5, 6, 7]]
    assert [r.tolist() for r in data["position_ids"].unbind(0)][1] == [0, 1, 2, 3]
    assert data["global_token_num"] == [3, 4, 4, 4]
    assert data["micro_batch_size_per_gpu"] == 1  # 4 rows over 4 ranks
    assert probe_batch(probe)["micro_batch_size_per_gpu"] == 2


def _load_actor_harness():
    path = Path(__file__).with_name("test_verl_actor.py")
    spec = importlib.util.spec_from_file_location("verl_actor_harness_sync", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_actor_side_is_verls_training_worker_forward(tmp_path):
    """verl's ``TrainingWorker`` (FSDP2 on CPU, fp32) answers :func:`actor_probe_logprobs` with the model's own
    log-probs of the probe's completions (its HF forward, full precision) — also the plug-in's engine under DVP,
    whose other forwards score over the min-p safe set."""
    from offpolicy.integrations.verl.sync_check import actor_probe_logprobs

    harness = _load_actor_harness()
    harness.setup_cpu_verl()
    with harness.process_group():
        path = harness.tiny_qwen2(tmp_path / "qwen2")
        worker = harness.make_worker(path)
        probe = SyncProbe([[1, 2, 3], [5], [7, 8]], [[9, 10], [11, 12, 13, 14], [15]])

        class Group:  # the worker group's compute_log_prob is the actor's infer_batch (engine_workers.py)
            def compute_log_prob(self, data):
                return worker.infer_batch(data)

        logp, mask = actor_probe_logprobs(Group(), probe)
        dvp = harness.make_worker(path, {"sampling": {"min_p": 0.6}})  # the plug-in's engine under DVP

        class DVPGroup:
            def compute_log_prob(self, data):
                return dvp.infer_batch(data)

        dvp_logp, _ = actor_probe_logprobs(DVPGroup(), probe)
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()
        expected, expected_mask = sequence_logprobs(reference, probe.prompt_ids, probe.completion_ids)
    assert torch.equal(mask, expected_mask.bool())
    torch.testing.assert_close(logp, expected * mask, atol=1e-5, rtol=0)
    # under DVP the probe still gets the plain log-probs (vLLM's prompt log-probs have no min-p either)
    torch.testing.assert_close(dvp_logp, expected * mask, atol=1e-5, rtol=0)


def test_cpu_bridge_asks_for_gloo_once_and_restores_what_it_replaced(monkeypatch):
    """The CPU bridge of the end-to-end example: verl's process-group call gets ``cpu:gloo`` (not ``cpu:gloo,cpu:gloo``)
    unless the caller names a backend, and :func:`uninstall` puts verl's functions back."""
    import verl.models.transformers.monkey_patch as verl_patches
    import verl.utils.distributed as verl_distributed
    from offpolicy_testkit import verl_cpu_bridge as cpu_bridge

    calls = []
    wrapped = cpu_bridge._gloo_only(lambda timeout_second=None, backend=None: calls.append(backend))
    wrapped()
    wrapped(backend="nccl")
    assert calls == ["cpu:gloo", "nccl"]

    assert cpu_bridge.STATUS == "not installed"  # only where verl imports it by name (VERL_USE_EXTERNAL_MODULES)
    applies = cpu_bridge.applies
    monkeypatch.setattr(cpu_bridge, "applies", lambda: None)  # as on a CPU box with the pinned versions
    before = (verl_patches.is_trl_available, verl_distributed.initialize_global_process_group_ray)
    from verl.plugin.platform import platform_manager

    platform = platform_manager.get_platform()
    try:
        assert cpu_bridge.install().startswith("platform cpu")
        assert platform_manager.get_platform().device_name == "cpu"
        assert verl_distributed.initialize_global_process_group_ray is not before[1]
        assert verl_patches.is_trl_available() is False
    finally:
        cpu_bridge.uninstall()
        platform_manager.set_platform(platform)  # this test process's own platform again
    assert (verl_patches.is_trl_available, verl_distributed.initialize_global_process_group_ray) == before
    monkeypatch.setattr(cpu_bridge.torch.cuda, "is_available", lambda: True)
    assert applies() == "CUDA is available"
