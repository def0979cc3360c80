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
                               "(VerlClientScorer.TIMEOUT)")
