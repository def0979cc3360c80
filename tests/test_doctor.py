"""``offpolicy doctor`` against a stub vLLM server on 127.0.0.1: one deliberately wrong setting per check fails that
check (and only it) with its fix; the right recipe passes with exit code 0.

The stub answers in vLLM 0.32's shapes, read from its source: ``/v1/models`` (``ModelCard``: ``id``, ``owned_by``,
``root`` = the model path, ``max_model_len``), ``/version`` (``{"version": …}``) and ``/server_info?config_format=json``
(``{"vllm_config": …}``: ``VllmConfig`` dumped by pydantic with ``fallback=str``, so ``dtype`` is ``"torch.bfloat16"``
and ``hf_config``, an ``init=False`` field, is left out). tests/vllm/test_doctor_live.py checks them against a live
server.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from offpolicy_testkit.stub_server import stub_servers
from typer.testing import CliRunner

from offpolicy.cli import app
from offpolicy.diagnose.doctor import (
    CHECKS,
    ServerFacts,
    check_versions,
    flatten,
    load_config,
    parse_vllm_args,
    read_server,
    run_checks,
)
from offpolicy.integrations.versions import installed_version

runner = CliRunner()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2", "tie_word_embeddings": False,
                                                    "torch_dtype": "bfloat16"}))
    return folder


def _answers(model_dir: Path) -> dict[str, object]:
    return {
        "/v1/models": {"object": "list", "data": [{"id": str(model_dir), "object": "model", "created": 0,
                                                    "owned_by": "vllm", "root": str(model_dir), "parent": None,
                                                    "max_model_len": 512, "permission": []}]},
        "/version": {"version": "0.32.0"},
        "/server_info": {"vllm_config": {
            "model_config": {"model": str(model_dir), "dtype": "torch.bfloat16", "logprobs_mode": "processed_logprobs",
                             "generation_config": "auto", "override_generation_config": {}, "hf_overrides": {}},
            "cache_config": {"enable_prefix_caching": True},
            "scheduler_config": {"async_scheduling": True},
        }, "vllm_env": {}, "system_env": {}},
    }


@pytest.fixture
def serve():
    """Start a stub answering GET ``answers[path]`` (query string ignored; a missing path is a 404)."""
    with stub_servers() as start:
        yield lambda answers: start(answers)[0]


def _trl(model_dir: Path) -> dict:
    return {"model_name_or_path": str(model_dir), "bf16": True, "temperature": 0.9, "top_k": 0, "top_p": 1.0,
            "min_p": None, "repetition_penalty": 1.0, "use_vllm": True, "vllm_mode": "server",
            "offpolicy": {"sync_check": "error"}}


def _verl(model_dir: Path) -> dict:
    return {"actor_rollout_ref": {
        "model": {"path": str(model_dir)},
        "actor": {"fsdp_config": {"dtype": "bfloat16", "model_dtype": "fp32"}},
        "rollout": {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "dtype": "bfloat16",
                    "enable_prefix_caching": True},
    }, "ray_kwargs.ray_init.runtime_env.env_vars.OFFPOLICY_VERL": "{sampling: {top_k: 50}, sync_check: error}"}


def _doctor(tmp_path: Path, url: str, framework: str, cfg: dict, *extra: str):
    path = tmp_path / f"{framework}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return runner.invoke(app, ["doctor", "--server", url, f"--{framework}-config", str(path), *extra],
                         env={"COLUMNS": "200"})


def _failed(output: str) -> list[str]:
    return [line.split(":")[0].removeprefix("FAIL ").strip() for line in output.splitlines() if line.startswith("FAIL")]


@pytest.mark.parametrize("framework", ["trl", "verl"])
def test_the_right_recipe_passes_every_check(tmp_path, model_dir, serve, framework):
    if installed_version(framework) is None:
        pytest.skip(f"{framework} is not installed (the versions check would fail)")
    cfg = _trl(model_dir) if framework == "trl" else _verl(model_dir)
    res = _doctor(tmp_path, serve(_answers(model_dir)), framework, cfg)
    assert res.exit_code == 0, res.output
    assert res.output.count("pass ") == len(CHECKS) and "FAIL" not in res.output
    assert f"all {len(CHECKS)} checks passed" in res.output


def _set(tree: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[last] = value


# (what is wrong, check that fails, a phrase of its fix): server-side edits go to /server_info's vllm_config or
# /version, config edits to the TRL config
TRL_CASES = [
    ("server", "model_config.logprobs_mode", "raw_logprobs", "log-probs mode", "--logprobs-mode processed_logprobs"),
    ("config", "top_p", 0.9, "sampling parameters", "sampling_replay: true"),
    ("config", "generation_kwargs", {"temperature": 0.9, "logit_bias": {"5": 1.0}}, "sampling parameters",
     "remove generation_kwargs.logit_bias"),
    ("config", "generation_kwargs", {"temperature": 0.7}, "sampling parameters",
     "set temperature in the GRPOConfig field only"),
    ("server", "model_config.override_generation_config", {"presence_penalty": 0.5}, "sampling parameters",
     "drop presence_penalty from --override-generation-config"),
    ("server", "model_config.dtype", "torch.float16", "dtype", "--dtype bfloat16"),
    ("config", "model_init_kwargs", {"dtype": "float32"}, "dtype", "--dtype float32"),
    ("config", "cast_lm_head_to_fp32", True, "head dtype", "cast_lm_head_to_fp32: false"),
    ("server", "model_config.hf_overrides", {"tie_word_embeddings": True}, "tied head", "tie_word_embeddings"),
    ("config", "offpolicy.sync_check", None, "sync check", "sync_check: error"),
    ("version", "version", "0.40.0", "versions", "vllm>=0.22,<0.33"),
]


@pytest.mark.parametrize(("where", "key", "value", "check", "fix"), TRL_CASES,
                         ids=[f"{c[1]}-{i}" for i, c in enumerate(TRL_CASES)])
def test_one_wrong_setting_fails_its_check_with_the_fix(tmp_path, model_dir, serve, where, key, value, check, fix):
    if installed_version("trl") is None:
        pytest.skip("trl is not installed")
    answers, cfg = _answers(model_dir), _trl(model_dir)
    if where == "server":
        _set(answers["/server_info"]["vllm_config"], key, value)  # type: ignore[index]
    elif where == "version":
        answers["/version"] = {"version": value}
    else:
        _set(cfg, key, value)
    res = _doctor(tmp_path, serve(answers), "trl", cfg)
    assert res.exit_code == 1, res.output
    assert _failed(res.output) == [check], res.output
    assert fix in res.output, res.output
    assert "1 of" in res.output


VERL_CASES = [
    ("actor_rollout_ref.rollout.top_k", 20, "sampling parameters", "set sampling: {top_k: 20} in OFFPOLICY_VERL"),
    ("actor_rollout_ref.rollout.dtype", "float16", "dtype", "serve with --dtype float16"),
    ("actor_rollout_ref.rollout.enable_prefix_caching", False, "prefix caching", "--no-enable-prefix-caching"),
    ("ray_kwargs.ray_init.runtime_env.env_vars.OFFPOLICY_VERL", "{sampling: {top_k: 50}, sync_check: 'off'}",
     "sync check", "sync_check: error"),
]


@pytest.mark.parametrize(("key", "value", "check", "fix"), VERL_CASES, ids=[c[0].split(".")[-1] for c in VERL_CASES])
def test_verl_wrong_settings(tmp_path, model_dir, serve, key, value, check, fix):
    if installed_version("verl") is None:
        pytest.skip("verl is not installed")
    cfg = copy.deepcopy(_verl(model_dir))
    if key.startswith("ray_kwargs"):
        cfg[key] = value
    else:
        _set(cfg, key, value)
    res = _doctor(tmp_path, serve(_answers(model_dir)), "verl", cfg)
    assert res.exit_code == 1, res.output
    assert _failed(res.output) == [check], res.output
    assert fix in res.output, res.output


def test_untied_trainer_against_a_tied_served_model(tmp_path, model_dir, serve):
    served = tmp_path / "served"
    served.mkdir()
    (served / "config.json").write_text(json.dumps({"tie_word_embeddings": True, "torch_dtype": "bfloat16"}))
    answers = _answers(served)
    facts = read_server(serve(answers))
    by_name = {c.name: c for c in run_checks(facts, flatten(_trl(model_dir)), "trl")}
    tied = by_name["tied head"]
    assert not tied.ok and "served tie_word_embeddings=True" in tied.detail and "trainer's False" in tied.detail
    assert f"{served}/config.json" in tied.detail  # read from /v1/models' root: /server_info has no hf_config


def test_outside_dev_mode_the_command_line_is_read(tmp_path, model_dir, serve):
    answers = _answers(model_dir)
    del answers["/server_info"]  # no VLLM_SERVER_DEV_MODE: 404
    url = serve(answers)
    res = _doctor(tmp_path, url, "trl", _trl(model_dir))
    assert res.exit_code == 1
    assert set(_failed(res.output)) == {"log-probs mode", "dtype", "head dtype", "prefix caching", "async scheduling"}
    assert "cannot tell the log-probs mode from the server" in res.output and "pass --vllm-args" in res.output
    # the same server with its command line: vLLM's default log-probs mode (raw) fails, the rest passes
    res = _doctor(tmp_path, url, "trl", _trl(model_dir), "--vllm-args", "vllm serve m --dtype bfloat16")
    assert _failed(res.output) == ["log-probs mode"] and "raw_logprobs (--vllm-args)" in res.output
    res = _doctor(tmp_path, url, "trl", _trl(model_dir), "--vllm-args",
                  "--dtype bfloat16 --logprobs-mode processed_logprobs --no-enable-prefix-caching")
    assert res.exit_code == 0, res.output
    assert "prefix caching: off (--vllm-args)" in res.output


def test_versions_check_reads_the_installed_framework():
    facts = ServerFacts("http://x", version="0.32.0")
    assert check_versions(facts, {}, "trl", installed={"trl": "1.16.0"}).ok
    bad = check_versions(facts, {}, "trl", installed={"trl": "1.17.0"})
    assert not bad.ok and "trl 1.17.0 is outside the tested range >=1.16,<1.17" in bad.detail
    missing = check_versions(facts, {}, "verl", installed={"verl": None})
    assert not missing.ok and "offpolicy[verl]" in missing.fix


def test_bad_input_is_one_line(tmp_path, model_dir, serve):
    url = serve(_answers(model_dir))
    res = runner.invoke(app, ["doctor", "--server", url])
    assert res.exit_code == 2 and "give one of --trl-config or --verl-config" in res.output
    (tmp_path / "bad.yaml").write_text("- a list\n")
    res = runner.invoke(app, ["doctor", "--server", url, "--trl-config", str(tmp_path / "bad.yaml")])
    assert res.exit_code == 2 and "must hold a mapping" in res.output
    res = _doctor(tmp_path, "127.0.0.1:1", "trl", _trl(model_dir))
    assert res.exit_code == 2 and "give the base URL" in res.output
    res = _doctor(tmp_path, url.rsplit(":", 1)[0] + ":1", "trl", _trl(model_dir))
    assert res.exit_code == 2 and "GET /v1/models: cannot reach" in res.output
    with pytest.raises(ValueError, match="framework must be one of"):
        run_checks(ServerFacts("http://x"), {}, "openrlhf")
    with pytest.raises(ValueError, match="config: cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_command_line_parsing():
    args = parse_vllm_args("python -m vllm.entrypoints.openai.api_server --model /m --enforce-eager "
                           "--override-generation-config '{\"top_k\": 5}' --async_scheduling")
    assert args == {"model": "/m", "enforce-eager": True, "override-generation-config": '{"top_k": 5}',
                    "async-scheduling": True}
    with pytest.raises(ValueError, match="vllm_args: cannot split"):
        parse_vllm_args("--dtype 'bf16")


def test_truncation_passes_where_the_trainer_replays_it(model_dir, serve):
    answers = _answers(model_dir)
    # a server default TRL overrides in every request (temperature) does not reach μ
    answers["/server_info"]["vllm_config"]["model_config"]["override_generation_config"] = {"temperature": 0.6}  # type: ignore[index]
    facts = read_server(serve(answers))
    cfg = {**_trl(model_dir), "top_p": 0.9, "generation_kwargs": {"temperature": 0.7}}
    sampling = {c.name: c for c in run_checks(facts, flatten(cfg), "trl")}["sampling parameters"]
    assert not sampling.ok
    cfg["offpolicy"] = {"sampling_replay": True}  # replay scores with the engine's recipe, temperature included
    sampling = {c.name: c for c in run_checks(facts, flatten(cfg), "trl")}["sampling parameters"]
    assert sampling.ok and "top_p=0.9" in sampling.detail and "temperature=0.7" in sampling.detail, sampling
