"""The plug-ins' engine calls on a server that never answers: TRL's server scorer (through TRL's own
``VLLMClient``, which sets no timeout) and verl's replica scorer stop within their timeout with one line naming the
server or replica, the probe, the sync or step, and the setting."""

from __future__ import annotations

import asyncio
import time

import pytest
from offpolicy_testkit.silent_server import silent_server

SLACK = 2.0  # seconds past the timeout: thread start-up and the socket's wake-up on a loaded machine

from offpolicy.rollout.http import ServerError


def test_trls_server_scorer_stops_within_the_timeout_naming_the_server_and_the_sync():
    pytest.importorskip("requests")
    import requests
    from trl.generation.vllm_client import VLLMClient

    from offpolicy.integrations.trl.vllm_sync import ServerScorer

    client = VLLMClient.__new__(VLLMClient)  # TRL's own client on the silent server (its __init__ asks the server)
    with silent_server() as url:
        client.session, client.base_url, client.model = requests.Session(), url, "tiny"
        scorer = ServerScorer(client, timeout=0.5, sync=lambda: 3)
        start = time.monotonic()
        with pytest.raises(ServerError) as info:
            scorer.score([[1, 2], [1, 3]], [[4], [5]])
        assert time.monotonic() - start < 0.5 + SLACK
    assert str(info.value) == (f"vLLM server {url} did not answer the sync check's probe (2 sequences) "
                               "within 0.5 s at sync 3: is it running? (GRPOConfig.vllm_server_timeout)")


def test_verls_replica_scorer_names_the_replica_and_the_step():
    import torch

    from offpolicy.integrations.verl.sync_check import VerlClientScorer, VerlSyncCheck
    from offpolicy.rollout.sync_check import SyncProbe

    class Silent:
        async def generate(self, request_id, *, prompt_ids, sampling_params):
            await asyncio.sleep(3600)

    probe = SyncProbe(prompt_ids=[[1, 2], [1, 3]], completion_ids=[[4], [5]])
    replicas = [VerlClientScorer(Silent(), timeout=0.3), VerlClientScorer(Silent(), timeout=0.3)]
    check = VerlSyncCheck(replicas, lambda p: (torch.zeros(2, 1), torch.ones(2, 1, dtype=torch.bool)), probe)
    start = time.monotonic()
    with pytest.raises(ServerError) as info:
        check.after_sync(step=4)
    assert time.monotonic() - start < 0.3 + SLACK
    assert str(info.value) == ("verl step 4's weight sync (replica 0 of 2): verl's rollout server did not answer the "
                               "sync check's probe (2 sequences) within 0.3 s: is it running? "
                               "(OFFPOLICY_VERL: sync_check_timeout)")


def _trl_client(url):
    """TRL's own ``VLLMClient`` on ``url`` (its ``__init__`` would ask the server for its health and model)."""
    import requests
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient.__new__(VLLMClient)
    client.session, client.base_url, client.model = requests.Session(), url, "tiny"
    return client


def _outcome_within(call, seconds):
    """``call()``'s exception (None if it returned) when it ends within ``seconds``; a failed test, not a hang, when
    it does not (TRL's client without the patch waits forever)."""
    import threading

    box = {}

    def run():
        try:
            call()
            box["error"] = None
        except Exception as err:  # noqa: BLE001 - what the test inspects
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert "error" in box, f"still waiting after {seconds:g} s: the request has no timeout"
    return box["error"]


def test_trls_generation_and_weight_push_on_a_hung_server_stop_within_the_timeout_and_the_patch_goes():
    pytest.importorskip("requests")
    import requests

    from offpolicy.integrations.trl.patches import request_timeouts

    with silent_server() as url:
        client = _trl_client(url)
        with request_timeouts(client, 0.5, when=lambda: "training step 2"):
            assert "request" in vars(client.session)
            start = time.monotonic()
            err = _outcome_within(lambda: client.generate([[1, 2]], max_tokens=4), 0.5 + SLACK)
            assert time.monotonic() - start >= 0.5
            assert isinstance(err, ServerError) and str(err) == (
                f"vLLM server {url} did not answer TRL's POST /v1/completions within 0.5 s at training step 2: is it "
                "running? (vllm_request_timeout: 0.5 s)")
            err = _outcome_within(client._start_weight_update, 0.5 + SLACK)  # the weight push's first request
            assert isinstance(err, ServerError) and "TRL's POST /start_weight_update within 0.5 s" in str(err)
        # TRL's session is its own class's again: nothing of the patch stays
        assert "request" not in vars(client.session)
        assert client.session.request.__func__ is requests.Session.request


def test_the_trainers_train_bounds_trls_requests_by_its_setting_and_restores_them(monkeypatch):
    pytest.importorskip("requests")
    from types import SimpleNamespace as NS

    from offpolicy.integrations.trl.parts.vllm import VLLMWiring
    from offpolicy.integrations.trl.patches import check_request_timeout

    class TRLsTrain:  # stands in for GRPOTrainer.train: TRL's generation during training
        def train(self):
            return self.vllm_generation.vllm_client.generate([[1, 2]], max_tokens=4)

    class Trainer(VLLMWiring, TRLsTrain):
        pass

    with silent_server() as url:
        client = _trl_client(url)
        for keyword, expect in ((None, 0.4), (0.3, 0.3)):  # None: GRPOConfig.vllm_server_timeout
            trainer = Trainer()
            trainer.vllm_generation = NS(mode="server", vllm_client=client)
            trainer.args, trainer.state = NS(vllm_server_timeout=0.4), NS(global_step=7)
            trainer.offpolicy_request_timeout = keyword
            err = _outcome_within(trainer.train, expect + SLACK)
            assert isinstance(err, ServerError), err
            assert f"TRL's POST /v1/completions within {expect:g} s at training step 7" in str(err)
            assert f"(vllm_request_timeout: {expect:g} s)" in str(err)
            assert "request" not in vars(client.session)  # removed when train() ended, by an exception too
    for bad in (0, -1.0, float("inf"), "60", True):
        with pytest.raises(ValueError, match="^vllm_request_timeout must be a number of seconds > 0 or None"):
            check_request_timeout(bad)
    assert check_request_timeout(None) is None and check_request_timeout(5) == 5.0


def test_verls_replica_timeout_is_a_setting_of_the_block_and_reaches_every_replica():
    from types import SimpleNamespace as NS

    from offpolicy.integrations.verl.settings import SYNC_CHECK_TIMEOUT, parse_settings
    from offpolicy.integrations.verl.sync_check import engine_scorers

    assert parse_settings({}).sync_check_timeout == SYNC_CHECK_TIMEOUT == 600.0
    assert parse_settings({"sync_check_timeout": 45}).sync_check_timeout == 45.0
    for bad in (0, -5, "60", True, float("inf")):
        with pytest.raises(ValueError, match="^OFFPOLICY_VERL: sync_check_timeout must be a real number"):
            parse_settings({"sync_check_timeout": bad})
    one = NS(get_llm_client=lambda: "client")  # one replica: verl's LLMServerClient
    assert [s.timeout for s in engine_scorers(one, 45.0)] == [45.0]
    many = NS(llm_server_manager=NS(server_handles=["a", "b"]))  # one scorer per replica's server
    assert [s.timeout for s in engine_scorers(many, 7.5)] == [7.5, 7.5]
    assert [s.timeout for s in engine_scorers(one)] == [600.0]
