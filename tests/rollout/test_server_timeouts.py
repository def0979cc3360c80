"""A server that takes the connection and never answers: every request of the server engine stops within its
timeout (plus a small slack), with one line naming the server, the request, the sync and the timeout's setting."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from offpolicy_testkit.silent_server import silent_server as stub

from offpolicy.rollout.http import ServerError, call_within, post_json
from offpolicy.rollout.protocols import VLLMProtocol
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.server_engine import ServerRolloutEngine

SLACK = 2.0  # seconds past the timeout: thread start-up and the socket's own wake-up on a loaded machine


@pytest.fixture
def silent_server() -> Iterator[str]:
    with stub() as url:
        yield url


def _raises_within(timeout: float, call) -> str:
    start = time.monotonic()
    with pytest.raises(ServerError) as info:
        call()
    elapsed = time.monotonic() - start
    assert timeout - 0.05 <= elapsed < timeout + SLACK, elapsed
    return str(info.value)


def test_a_request_to_a_silent_server_stops_within_its_timeout(silent_server):
    message = _raises_within(0.5, lambda: post_json(silent_server + "/v1/completions", {"prompt": [1]}, timeout=0.5,
                                                     what="probe"))
    assert message == f"probe: {silent_server}/v1/completions did not answer within 0.5 s: is it running?"


def test_the_server_engine_names_the_server_the_request_the_sync_and_the_setting(silent_server):
    engine = ServerRolloutEngine(silent_server, VLLMProtocol("tiny"), timeout=0.5)
    engine.timeout_setting = "rollout.server.timeout"
    message = _raises_within(0.5, lambda: engine.generate([[1, 2]], SamplingConfig(max_new_tokens=2), seed=0))
    assert message == (f"vllm request 0 (/v1/completions): {silent_server}/v1/completions did not answer within "
                       "0.5 s: is it running? (before the first sync; rollout.server.timeout: 0.5 s)")
    engine.syncs = 3
    message = _raises_within(0.5, lambda: engine.score([[1, 2]], [[3]]))
    assert message.startswith("vllm scoring request 0 (/v1/completions): ") and silent_server in message
    assert message.endswith("is it running? (at sync 3; rollout.server.timeout: 0.5 s)") and "\n" not in message
    message = _raises_within(0.5, lambda: engine.reload_weights("/nonexistent/reload"))
    assert message.startswith(f"vllm weight reload /pause: {silent_server}/pause did not answer")
    assert message.endswith("(at sync 3; rollout.server.timeout: 0.5 s)")


def test_the_trainers_server_engine_names_its_config_key(silent_server, monkeypatch):
    from offpolicy.rollout import servers
    from offpolicy.rollout.spec import EngineSpec

    monkeypatch.setattr(servers, "served_model", lambda url, timeout=10.0: "tiny")
    monkeypatch.setattr(servers, "check_vllm_logprobs_mode", lambda url, timeout=10.0: None)
    spec = EngineSpec(name="rollout.engine=server", backend="server", server=silent_server, protocol="vllm",
                      timeout=0.5)
    assert servers.build_server_engine(spec).timeout_setting == "rollout.server.timeout"
    assert servers.build_server_engine(EngineSpec(server=silent_server, protocol="vllm")).timeout_setting == "timeout"


def test_a_call_without_a_timeout_of_its_own_is_bounded():
    never = threading.Event()
    message = _raises_within(0.3, lambda: call_within(never.wait, 0.3, what="vLLM server http://h:1",
                                                      request="the probe (2 sequences)", when="sync 4",
                                                      setting="GRPOConfig.vllm_server_timeout"))
    assert message == ("vLLM server http://h:1 did not answer the probe (2 sequences) within 0.3 s at sync 4: is it "
                       "running? (GRPOConfig.vllm_server_timeout)")

    def refused():
        raise ConnectionError("Max retries exceeded\nwith url: /v1/completions")

    with pytest.raises(ServerError, match=r"^vLLM server http://h:1 failed on the probe \(2 sequences\) at sync 4 "
                                          r"\(ConnectionError: Max retries exceeded\): is it running\?$"):
        call_within(refused, 5.0, what="vLLM server http://h:1", request="the probe (2 sequences)", when="sync 4",
                    setting="GRPOConfig.vllm_server_timeout")
    assert call_within(lambda: 7, 5.0, what="w", request="r", when="sync 1", setting="s") == 7
