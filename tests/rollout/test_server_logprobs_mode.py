"""The reference trainer's server engine refuses, at start, a vLLM server whose log-probs are not the sampling
distribution (``--logprobs-mode`` other than ``processed_logprobs``, or a server that cannot say): the check TRL's
server mode runs, one function for both."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
from offpolicy_testkit.stub_server import stub_servers

from offpolicy.rollout.http import ServerError
from offpolicy.rollout.protocols import vllm_logprobs_mode_verdict

MODELS = {"data": [{"id": "tiny", "owned_by": "vllm"}]}


def _info(mode):
    return {"vllm_config": {"model_config": {"logprobs_mode": mode}}}


@pytest.fixture
def stub():
    with stub_servers() as start:
        yield start


def _trainer_engine(url, tmp_path, tiny):
    from offpolicy.train.build import build_run_engine
    from offpolicy.train.config import load_config

    cfg = load_config(None, [f"run.out_dir={tmp_path}", "rollout.engine=server", f"rollout.server.url={url}",
                             "rollout.server.protocol=vllm", "rollout.server.timeout=5"])
    return build_run_engine(cfg, *tiny)


def test_the_trainer_refuses_a_server_with_raw_logprobs_before_any_request(stub, tmp_path, tiny):
    url, log = stub({"/v1/models": MODELS, "/server_info": _info("raw_logprobs")})
    with pytest.raises(ValueError) as info:
        _trainer_engine(url, tmp_path, tiny)
    assert str(info.value) == (f"logprobs_mode: the vLLM server at {url} runs with --logprobs-mode raw_logprobs; μ "
                               "must be the sampling distribution: restart it with --logprobs-mode processed_logprobs")
    assert [p for p, _ in log] == ["/server_info"]  # nothing generated, nothing built


def test_a_server_outside_dev_mode_is_refused_naming_how_to_start_it(stub, tmp_path, tiny):
    url, _ = stub({"/v1/models": MODELS})  # /server_info answers 404
    with pytest.raises(ServerError, match=r"^logprobs_mode: the vLLM server at .* has no /server_info \(not in dev "
                                          r"mode\).*VLLM_SERVER_DEV_MODE=1.*--logprobs-mode processed_logprobs$"):
        _trainer_engine(url, tmp_path, tiny)


def test_a_server_with_processed_logprobs_is_built(stub, tmp_path, tiny):
    url, log = stub({"/v1/models": MODELS, "/server_info": _info("processed_logprobs")})
    engine = _trainer_engine(url, tmp_path, tiny)
    assert engine.protocol.model == "tiny" and [p for p, _ in log] == ["/server_info", "/v1/models"]


def test_trls_check_and_the_server_engines_are_one_function():
    from offpolicy.integrations.trl.parts.vllm import logprobs_mode_verdict

    for mode in ("raw_logprobs", "processed_logits", None):
        config = {"model_config": {"logprobs_mode": mode}} if mode else {"model_config": {}}
        assert logprobs_mode_verdict(NS(get_server_info=lambda c=config: c)) == vllm_logprobs_mode_verdict(config)
        assert vllm_logprobs_mode_verdict(config).startswith("logprobs_mode: the vLLM server runs with")
    assert vllm_logprobs_mode_verdict({"model_config": {"logprobs_mode": "processed_logprobs"}}) is None
    assert "unknown (its /server_info has no model_config.logprobs_mode)" in vllm_logprobs_mode_verdict(None)
