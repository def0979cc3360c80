"""Connecting to a running server: :func:`connect_server` (vLLM, SGLang or llama.cpp, the protocol detected by
:func:`detect_protocol` when not given).

The clients themselves live beside it: HTTP and the answer checks in :mod:`offpolicy.rollout.http`, the vLLM and
SGLang request and answer shapes in :mod:`offpolicy.rollout.protocols`, llama.cpp's in
:mod:`offpolicy.rollout.llamacpp`, the engine in :mod:`offpolicy.rollout.server_engine`, reload folders in
:mod:`offpolicy.rollout.weight_sync`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from offpolicy.rollout.factory import register_engine
from offpolicy.rollout.http import ServerError, post_json
from offpolicy.rollout.llamacpp import connect_llamacpp
from offpolicy.rollout.protocols import ServerProtocol, SGLangProtocol, VLLMProtocol, vllm_logprobs_mode_verdict
from offpolicy.rollout.server_engine import ServerRolloutEngine
from offpolicy.rollout.spec import SERVER_PROTOCOLS, EngineSpec


def detect_protocol(url: str, *, timeout: float = 10.0) -> str:
    """Which server answers at ``url``: ``"llamacpp"`` (``GET /props``), ``"sglang"`` (``GET /get_model_info``) or
    ``"vllm"`` (``GET /v1/models`` with ``owned_by: "vllm"``); :class:`ServerError` naming the URL otherwise."""
    url = url.rstrip("/")
    for protocol, path in (("llamacpp", "/props"), ("sglang", "/get_model_info")):
        try:
            post_json(url + path, None, timeout=timeout, what=f"protocol detection GET {path}")
            return protocol
        except ServerError:
            pass
    try:
        models = post_json(url + "/v1/models", None, timeout=timeout, what="protocol detection GET /v1/models")
    except ServerError as err:
        raise ServerError(f"{url}: no llama.cpp (/props), SGLang (/get_model_info) or vLLM (/v1/models) server "
                          f"answers ({err})") from None
    data = models.get("data") if isinstance(models, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict) and data[0].get("owned_by") == "vllm":
        return "vllm"
    raise ServerError(f"{url}: /v1/models answered, but not as vLLM (owned_by is not 'vllm'); give the protocol")


def served_model(url: str, *, timeout: float = 10.0) -> str:
    """The first model id a vLLM (OpenAI) server lists at ``/v1/models``."""
    models = post_json(url.rstrip("/") + "/v1/models", None, timeout=timeout, what="GET /v1/models")
    try:
        return str(models["data"][0]["id"])
    except (KeyError, IndexError, TypeError):
        raise ServerError(f"{url}/v1/models: answer.data[0].id is missing: {str(models)[:200]}") from None


def check_vllm_logprobs_mode(url: str, *, timeout: float = 10.0) -> None:
    """Refuse, at start, a vLLM server whose log-probs are not the sampling distribution: its resolved config
    (``GET /server_info?config_format=json``, a dev-mode endpoint) judged by
    :func:`~offpolicy.rollout.protocols.vllm_logprobs_mode_verdict`, the check TRL's server mode runs too. A server
    outside dev mode (``/server_info`` answers 404) cannot say, and could not reload weights either: refused, saying
    how to start it."""
    url = url.rstrip("/")
    try:
        answer = post_json(url + "/server_info?config_format=json", None, timeout=timeout, what="GET /server_info")
    except ServerError as err:
        if "answered HTTP 404" not in str(err):
            raise
        raise ServerError(f"logprobs_mode: the vLLM server at {url} has no /server_info (not in dev mode), so its "
                          "--logprobs-mode cannot be checked; start it with VLLM_SERVER_DEV_MODE=1 (its weight "
                          "reload needs it too) and --logprobs-mode processed_logprobs") from None
    verdict = vllm_logprobs_mode_verdict(answer.get("vllm_config") if isinstance(answer, dict) else None,
                                         server=f"the vLLM server at {url}")
    if verdict is not None:
        raise ValueError(verdict)


def connect_server(url: str, *, protocol: str | None = None, vocab_size: int | None = None, timeout: float = 120.0,
                   tokenizer=None, weights_dir: str | os.PathLike | None = None) -> ServerRolloutEngine:
    """The engine interface on a running vLLM, SGLang or llama.cpp server at ``url`` (``protocol`` None: detected
    by :func:`detect_protocol`; a vLLM server's log-prob mode checked first, :func:`check_vllm_logprobs_mode`);
    ``weights_dir``: where :meth:`ServerRolloutEngine.sync_weights` writes the model
    for the server to reload."""
    protocol = protocol or detect_protocol(url)
    if protocol not in SERVER_PROTOCOLS:
        raise ValueError(f"protocol must be one of {SERVER_PROTOCOLS}, got {protocol!r}")
    if protocol == "llamacpp":
        engine = connect_llamacpp(url, vocab_size=vocab_size, timeout=timeout, tokenizer=tokenizer)
        engine.weights_dir = Path(weights_dir) if weights_dir is not None else None
        return engine
    if protocol == "vllm":  # μ must be the distribution sampled from: refused at start, not after training on it
        check_vllm_logprobs_mode(url, timeout=timeout)
    proto: ServerProtocol = VLLMProtocol(served_model(url)) if protocol == "vllm" else SGLangProtocol()
    return ServerRolloutEngine(url, proto, vocab_size=vocab_size, timeout=timeout, tokenizer=tokenizer,
                               weights_dir=weights_dir)


@register_engine("server", fields=("server", "protocol", "timeout", "weights_dir"))
def build_server_engine(spec: EngineSpec, *, model: Any = None, tokenizer: Any = None,
                      model_path: str | None = None) -> ServerRolloutEngine:
    """The factory's builder for ``backend="server"``: a client of the server at ``spec.server`` (``spec.protocol``,
    or detected), ids checked against ``model``'s vocabulary; weight syncs go through ``spec.weights_dir``."""
    assert spec.server is not None  # EngineSpec(backend="server") requires an http(s) URL
    config = getattr(model, "config", None)
    engine = connect_server(spec.server, protocol=spec.protocol, vocab_size=getattr(config, "vocab_size", None),
                            timeout=spec.timeout, tokenizer=tokenizer, weights_dir=spec.weights_dir)
    # the setting a timed-out request names: the trainer's config key, or the spec's own field
    engine.timeout_setting = "rollout.server.timeout" if spec.name == "rollout.engine=server" else "timeout"
    return engine
