"""``offpolicy doctor`` against a live vLLM server (the session's tiny-model bf16 server, dev mode on): the answers
have the shapes tests/test_doctor.py's stub serves, the right TRL recipe passes, a wrong one fails its check."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from offpolicy.cli import app
from offpolicy.diagnose.doctor import read_server, run_checks
from offpolicy.integrations.versions import installed_version
from offpolicy.rollout.http import post_json

pytestmark = pytest.mark.slow


def _trl(server) -> dict:
    return {"model_name_or_path": str(server.model_dir), "bf16": True, "temperature": 0.9, "top_k": 0, "top_p": 1.0,
            "use_vllm": True, "vllm_mode": "server", "offpolicy": {"sync_check": "error"}}


def test_the_live_answers_have_the_stubs_shapes(vllm_servers):
    server = vllm_servers.get("tiny", "bfloat16")
    models = post_json(server.url + "/v1/models", None, timeout=30, what="test")
    assert models["data"][0]["root"] == str(server.model_dir) and models["data"][0]["owned_by"] == "vllm"
    info = post_json(server.url + "/server_info?config_format=json", None, timeout=30, what="test")["vllm_config"]
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert info["model_config"]["dtype"] == "torch.bfloat16"  # pydantic's fallback=str of a torch.dtype
    assert "hf_config" not in info["model_config"]  # an init=False field: the tied-head check reads /v1/models' root
    assert isinstance(info["cache_config"]["enable_prefix_caching"], bool)
    assert isinstance(info["scheduler_config"]["async_scheduling"], bool)
    assert isinstance(info["model_config"]["override_generation_config"], dict)
    facts = read_server(server.url)
    assert facts.version is not None and facts.version.startswith("0.")
    by_name = {c.name: c for c in run_checks(facts, {"model_name_or_path": str(server.model_dir), "bf16": True},
                                             "trl")}
    assert by_name["log-probs mode"].ok and by_name["dtype"].ok and by_name["tied head"].ok, by_name


def test_doctor_passes_the_right_recipe_and_fails_a_wrong_one(vllm_servers, tmp_path):
    if installed_version("trl") is None:
        pytest.skip("trl is not installed")
    server = vllm_servers.get("tiny", "bfloat16")
    runner = CliRunner()
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(_trl(server)))
    res = runner.invoke(app, ["doctor", "--server", server.url, "--trl-config", str(good)], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**_trl(server), "top_p": 0.9, "model_init_kwargs": {"dtype": "float32"}}))
    res = runner.invoke(app, ["doctor", "--server", server.url, "--trl-config", str(bad)], env={"COLUMNS": "200"})
    assert res.exit_code == 1, res.output
    failed = [line.split(":")[0] for line in res.output.splitlines() if line.startswith("FAIL")]
    assert failed == ["FAIL sampling parameters", "FAIL dtype"], res.output
