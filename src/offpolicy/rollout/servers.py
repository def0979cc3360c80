"""Rollout engines behind an HTTP server, one small client per protocol: llama.cpp's native ``/completion``
(:mod:`offpolicy.rollout.llamacpp`), vLLM's OpenAI ``/v1/completions`` and SGLang's native ``/generate``.

A protocol turns a prompt (token ids) and a :class:`~offpolicy.rollout.sampling.SamplingConfig` into a request body,
and the server's answer into a :class:`ServerCompletion` — the sampled ids, their log-probs (μ) and the top-k. The
parsers are plain functions of the JSON, tested on recorded answers; they refuse an answer that does not say what the
trainer needs (missing field, NaN, ids outside the vocabulary, a sampled id that disagrees with its log-prob entry)
with a :class:`ServerError` naming the request and the field, never a silent NaN.
:class:`ServerRolloutEngine` sends one request per prompt (seed ``seed + i``) and pads the answers into a
:class:`~offpolicy.rollout.base.RolloutOutput`.

What each server reports, and what the client therefore refuses:

* vLLM: processed log-probs only with ``--logprobs-mode processed_logprobs`` (raw otherwise: the softmax before
  temperature and truncation), which a client cannot see in the answer — :class:`VLLMProtocol` takes
  ``logprobs_mode`` and refuses anything else; with truncation on it also refuses an answer with more finite
  top-k entries than the truncation keeps. ``logprobs: K`` is capped by the server's ``--max-logprobs`` (20 by
  default) and returns the top K *plus* the sampled token; −inf comes back as −9999. Token ids come back as
  ``"token_id:<id>"`` strings with ``return_tokens_as_token_ids``. Same sampler notes as
  :mod:`offpolicy.rollout.vllm` (min-p with top-p refused).
* SGLang: ``meta_info.output_token_logprobs`` = ``[logprob, id, text]`` after temperature but before top-k/top-p/
  min-p, so :class:`SGLangProtocol` refuses truncation (μ would not be the distribution sampled from).
* vLLM's client runs against a live vLLM 0.32 server (PyPI's CPU build) in tests/vllm/, and every recorded vLLM
  answer in the tests is checked once against the live answer to the same request. SGLang's is written from its
  documented format and source and checked against recorded answers only: **not run against a live SGLang server**
  (SGLang's kernels need CUDA; it does not run on this project's CPU machines).

Weight reload: vLLM (dev mode, ``VLLM_SERVER_DEV_MODE=1``) ``/pause`` → ``/collective_rpc`` ``reload_weights`` →
``/reset_prefix_cache`` → ``/resume``; SGLang ``/update_weights_from_disk``. Both read the weights from a model
directory on the server's disk (:meth:`ServerRolloutEngine.reload_weights`).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from offpolicy.rollout.base import RolloutOutput, check_prompt_ids
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.weight_sync import ReloadFolder, check_reload_folder


class ServerError(ValueError):
    """A server is down, timed out, or answered something the trainer cannot use; the message names the request
    and the field."""


def post_json(url: str, body: dict | None, *, timeout: float, what: str, as_bytes: bool = False) -> Any:
    """POST ``body`` as JSON (GET when ``body`` is None) and return the decoded answer (its bytes if ``as_bytes``);
    :class:`ServerError` naming ``what`` (the request) on a refused connection, a timeout, an HTTP error status or
    malformed JSON."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as err:
        detail = err.read()[:300].decode("utf-8", "replace")
        raise ServerError(f"{what}: {url} answered HTTP {err.code}: {detail}") from None
    except TimeoutError:
        raise ServerError(f"{what}: {url} did not answer within {timeout:g} s") from None
    except http.client.HTTPException as err:  # the server died while answering (incomplete read, bad status line)
        raise ServerError(f"{what}: {url} broke off its answer ({type(err).__name__}: {err})") from None
    except (urllib.error.URLError, ConnectionError, OSError) as err:
        reason = getattr(err, "reason", err)
        if isinstance(reason, (TimeoutError, socket.timeout)):
            raise ServerError(f"{what}: {url} did not answer within {timeout:g} s") from None
        raise ServerError(f"{what}: cannot reach {url} ({reason})") from None
    if as_bytes:
        return raw
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ServerError(f"{what}: {url} answered malformed JSON ({err.msg if hasattr(err, 'msg') else err}): "
                          f"{raw[:120]!r}") from None


def wait_until_healthy(url: str, *, timeout: float, what: str, healthy: Callable[[bytes], bool] = lambda raw: True,
                       exited: Callable[[], str | None] = lambda: None, poll: float = 0.05) -> None:
    """Poll ``GET url`` until it answers and ``healthy(answer bytes)``; :class:`ServerError` naming ``what`` after
    ``timeout`` seconds, or at once with ``exited()``'s message when that returns one (the server process died)."""
    deadline = time.monotonic() + timeout
    while True:
        died = exited()
        if died is not None:
            raise ServerError(f"{what}: {died}")
        try:
            if healthy(post_json(url, None, timeout=5.0, what=what, as_bytes=True)):
                return
        except ServerError:
            pass
        if time.monotonic() > deadline:
            raise ServerError(f"{what}: not ready within {timeout:g} s")
        time.sleep(poll)


@dataclass
class ServerCompletion:
    """One parsed answer: ``ids`` sampled token ids, ``logp`` their processed log-probs (μ), and when asked for,
    ``top_ids`` / ``top_logp`` per position (most likely first, at most K each), ``text`` when the server sent it."""

    ids: list[int]
    logp: list[float]
    top_ids: list[list[int]] | None = None
    top_logp: list[list[float]] | None = None
    text: str = ""
    missing: list[int] = field(default_factory=list)  # positions the server sent no log-prob for (see llamacpp)


def get_field(obj: Any, key: str | int, where: str, kind: type | tuple[type, ...] | None = None) -> Any:
    """``obj[key]``, or a :class:`ServerError` that names ``where`` and the key (and the expected type).

    >>> get_field({"a": 1}, "b", "request 0: answer")
    Traceback (most recent call last):
    ...
    offpolicy.rollout.servers.ServerError: request 0: answer has no field 'b'
    """
    try:
        value = obj[key]
    except (KeyError, IndexError, TypeError):
        raise ServerError(f"{where} has no field {key!r}") from None
    if kind is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ServerError(f"{where}.{key} must be {names}, got {type(value).__name__}: {str(value)[:80]}")
    return value


def check_logprob(value: Any, where: str) -> float:
    """A finite log-prob ≤ 0 (up to 1e-4 of rounding), or −inf; anything else (NaN, a string, > 0) is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ServerError(f"{where} must be a number, got {type(value).__name__}: {str(value)[:80]}")
    v = float(value)
    if math.isnan(v) or v > 1e-4 or v == math.inf:
        raise ServerError(f"{where} must be a log-prob ≤ 0, got {v}")
    return min(v, 0.0)


def check_token(value: Any, where: str, vocab_size: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ServerError(f"{where} must be a token id ≥ 0, got {str(value)[:80]}")
    if vocab_size is not None and value >= vocab_size:
        raise ServerError(f"{where} = {value} is outside the trainer's vocabulary of {vocab_size}")
    return value


class ServerProtocol(Protocol):
    """What a server client provides (see :class:`VLLMProtocol`, :class:`SGLangProtocol`,
    :class:`offpolicy.rollout.llamacpp.LlamaCppProtocol`)."""

    name: str
    path: str

    def applied(self, cfg: SamplingConfig) -> SamplingConfig: ...

    def request(self, prompt: list[int], cfg: SamplingConfig, seed: int) -> dict: ...

    def parse(self, answer: Any, cfg: SamplingConfig, *, where: str, vocab_size: int | None) -> ServerCompletion: ...


# -- vLLM: OpenAI /v1/completions ---------------------------------------------------------------------------------
VLLM_NEG_INF = -9999.0  # vLLM's OpenAI layer writes −inf log-probs as this


def _vllm_token_id(key: Any, where: str, vocab_size: int | None) -> int:
    if not isinstance(key, str) or not key.startswith("token_id:"):
        raise ServerError(f"{where} = {str(key)[:40]!r} is not 'token_id:<id>': request with "
                          "return_tokens_as_token_ids (the client does) on a vLLM that supports it")
    try:
        return check_token(int(key.removeprefix("token_id:")), where, vocab_size)
    except ValueError as err:
        if isinstance(err, ServerError):
            raise
        raise ServerError(f"{where} = {key!r} has no integer id") from None


def _vllm_logprob(value: Any, where: str) -> float:
    v = check_logprob(value, where)
    return -math.inf if v <= VLLM_NEG_INF else v


class VLLMProtocol:
    """vLLM's OpenAI completions endpoint (``python -m vllm.entrypoints.openai.api_server … --logprobs-mode
    processed_logprobs``), checked against a live vLLM 0.32 server (CPU build) in tests/vllm/."""

    name = "vllm"
    path = "/v1/completions"

    def __init__(self, model: str, *, logprobs_mode: str = "processed_logprobs", ignore_eos: bool = False) -> None:
        if logprobs_mode != "processed_logprobs":
            raise ValueError(f"logprobs_mode={logprobs_mode!r}: vLLM reports the raw softmax unless started with "
                             "--logprobs-mode processed_logprobs, and μ must be the distribution sampled from; start "
                             "the server so and pass logprobs_mode='processed_logprobs'")
        if not isinstance(model, str) or not model:
            raise ValueError("model must be the served model's name (vLLM's --served-model-name or path)")
        self.model = model
        self.ignore_eos = bool(ignore_eos)  # vLLM's extra parameter: sample past eos up to max_tokens

    def applied(self, cfg: SamplingConfig) -> SamplingConfig:
        from offpolicy.rollout.vllm import vllm_sampling

        return vllm_sampling(cfg)[1]

    def request(self, prompt: list[int], cfg: SamplingConfig, seed: int) -> dict:
        from offpolicy.rollout.vllm import vllm_sampling

        kwargs, _ = vllm_sampling(cfg)
        body: dict[str, Any] = {"model": self.model, "prompt": list(prompt), "max_tokens": cfg.max_new_tokens, "seed": int(seed),
                "logprobs": max(cfg.logprobs_topk, 0), "return_tokens_as_token_ids": True,
                "skip_special_tokens": True, "n": 1, "stream": False}
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update({k: v for k, v in kwargs.items() if v is not None})
        if body.get("logit_bias"):
            body["logit_bias"] = {str(k): v for k, v in body["logit_bias"].items()}
        return body

    def parse(self, answer: Any, cfg: SamplingConfig, *, where: str, vocab_size: int | None) -> ServerCompletion:
        return parse_vllm_completion(answer, cfg, where=where, vocab_size=vocab_size)

    def reload_weights(self, url: str, path: str, *, timeout: float) -> None:
        vllm_reload_weights(url, path, timeout=timeout, weights_path=path)

    def score_request(self, prompt: list[int], completion: list[int]) -> dict:
        """One token of generation after ``prompt + completion`` with the prompt's log-probs: vLLM's teacher-forced
        distribution at every position (raw log-softmax, temperature 1)."""
        return {"model": self.model, "prompt": list(prompt) + list(completion), "max_tokens": 1, "temperature": 1.0,
                "prompt_logprobs": 0, "seed": 0, "n": 1, "stream": False}

    def parse_score(self, answer: Any, prompt: list[int], completion: list[int], *, where: str) -> list[float]:
        return parse_vllm_prompt_logprobs(answer, list(prompt) + list(completion), len(prompt), where=where)


def parse_vllm_prompt_logprobs(answer: Any, ids: list[int], start: int, *, where: str = "request") -> list[float]:
    """The log-probs of ``ids[start:]`` from a vLLM answer's ``choices[0].prompt_logprobs`` (entry j: the
    distribution that predicted token j, ``None`` at j = 0; keys are token ids as strings).

    >>> a = {"choices": [{"prompt_logprobs": [None, {"7": {"logprob": -0.5, "rank": 1}},
    ...      {"9": {"logprob": -2.0, "rank": 3}, "4": {"logprob": -0.1, "rank": 1}}]}]}
    >>> parse_vllm_prompt_logprobs(a, [1, 7, 9], 1)
    [-0.5, -2.0]
    """
    choice = get_field(get_field(answer, "choices", f"{where}: answer", list), 0, f"{where}: answer.choices", dict)
    w = f"{where}: answer.choices[0].prompt_logprobs"
    entries = get_field(choice, "prompt_logprobs", f"{where}: answer.choices[0]", list)
    if len(entries) != len(ids):
        raise ServerError(f"{w}: {len(entries)} entries for a prompt of {len(ids)} tokens")
    out = []
    for j in range(max(start, 1), len(ids)):
        entry = get_field(entries, j, w, dict)
        value = get_field(get_field(entry, str(ids[j]), f"{w}[{j}]", dict), "logprob", f"{w}[{j}][{ids[j]!r}]")
        out.append(_vllm_logprob(value, f"{w}[{j}][{ids[j]!r}].logprob"))
    return out


def _truncation_width(cfg: SamplingConfig) -> int | None:
    """The most tokens a top-k truncation can keep (None: no top-k)."""
    return cfg.top_k


def parse_vllm_completion(answer: Any, cfg: SamplingConfig, *, where: str = "request",
                          vocab_size: int | None = None) -> ServerCompletion:
    """Parse a vLLM ``/v1/completions`` answer (``choices[0].logprobs``: ``tokens`` as ``"token_id:<id>"``,
    ``token_logprobs``, ``top_logprobs`` dicts of the top K plus the sampled token).

    >>> a = {"choices": [{"text": "ab", "logprobs": {"tokens": ["token_id:5", "token_id:2"],
    ...      "token_logprobs": [-0.5, -1.0], "top_logprobs": [{"token_id:5": -0.5, "token_id:7": -1.2},
    ...      {"token_id:2": -1.0, "token_id:3": -0.6}]}}]}
    >>> c = parse_vllm_completion(a, SamplingConfig(logprobs_topk=1))
    >>> c.ids, c.logp, c.top_ids, c.top_logp
    ([5, 2], [-0.5, -1.0], [[5], [3]], [[-0.5], [-0.6]])
    """
    choice = get_field(get_field(answer, "choices", f"{where}: answer", list), 0, f"{where}: answer.choices", dict)
    w = f"{where}: answer.choices[0]"
    lp = get_field(choice, "logprobs", w, dict)
    tokens = get_field(lp, "tokens", f"{w}.logprobs", list)
    values = get_field(lp, "token_logprobs", f"{w}.logprobs", list)
    if len(values) != len(tokens):
        raise ServerError(f"{w}.logprobs: {len(tokens)} tokens but {len(values)} token_logprobs")
    ids = [_vllm_token_id(t, f"{w}.logprobs.tokens[{j}]", vocab_size) for j, t in enumerate(tokens)]
    logp = [_vllm_logprob(v, f"{w}.logprobs.token_logprobs[{j}]") for j, v in enumerate(values)]
    for j, v in enumerate(logp):
        if v == -math.inf:
            raise ServerError(f"{w}.logprobs.token_logprobs[{j}]: the sampled token {ids[j]} has probability 0 "
                              "under the reported distribution (raw log-probs, or another recipe)")
    k = cfg.logprobs_topk
    top_ids = top_logp = None
    if k > 0:
        rows = get_field(lp, "top_logprobs", f"{w}.logprobs", list)
        if len(rows) != len(ids):
            raise ServerError(f"{w}.logprobs: {len(ids)} tokens but {len(rows)} top_logprobs entries")
        top_ids, top_logp = [], []
        width = _truncation_width(cfg)
        for j, row in enumerate(rows):
            wj = f"{w}.logprobs.top_logprobs[{j}]"
            if not isinstance(row, dict):
                raise ServerError(f"{wj} must be an object of 'token_id:<id>': logprob, got {type(row).__name__}")
            pairs = sorted(((_vllm_token_id(key, f"{wj} key", vocab_size), _vllm_logprob(v, f"{wj}[{key!r}]"))
                            for key, v in row.items()), key=lambda p: -p[1])
            finite = sum(math.isfinite(v) for _, v in pairs)
            if width is not None and finite > width + 1:
                raise ServerError(f"{wj}: {finite} tokens have finite log-probs under top_k={width}: these are raw "
                                  "log-probs; start vLLM with --logprobs-mode processed_logprobs")
            top_ids.append([i for i, _ in pairs[:k]])
            top_logp.append([v for _, v in pairs[:k]])
    text = choice.get("text") if isinstance(choice.get("text"), str) else ""
    return ServerCompletion(ids, logp, top_ids, top_logp, text)


# -- SGLang: native /generate -------------------------------------------------------------------------------------
class SGLangProtocol:
    """SGLang's native generate endpoint. Unverified against a live server (module docstring)."""

    name = "sglang"
    path = "/generate"

    def applied(self, cfg: SamplingConfig) -> SamplingConfig:
        check_sglang_sampling(cfg)
        return cfg

    def request(self, prompt: list[int], cfg: SamplingConfig, seed: int) -> dict:
        check_sglang_sampling(cfg)
        params: dict[str, Any] = {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
                                  "sampling_seed": int(seed), "skip_special_tokens": True}
        if cfg.logit_bias:
            params["logit_bias"] = {str(k): v for k, v in cfg.logit_bias}
        return {"input_ids": list(prompt), "sampling_params": params, "return_logprob": True,
                "top_logprobs_num": max(cfg.logprobs_topk, 0), "return_text_in_logprobs": False}

    def parse(self, answer: Any, cfg: SamplingConfig, *, where: str, vocab_size: int | None) -> ServerCompletion:
        return parse_sglang_generate(answer, cfg, where=where, vocab_size=vocab_size)

    def reload_weights(self, url: str, path: str, *, timeout: float) -> None:
        sglang_reload_weights(url, path, timeout=timeout)


def check_sglang_sampling(cfg: SamplingConfig) -> None:
    """Refuse what SGLang's reported log-probs do not include: truncation (they are taken before top-k/top-p/min-p)
    and the history-reading penalties (not replayed here).

    >>> check_sglang_sampling(SamplingConfig(top_p=0.9))
    Traceback (most recent call last):
    ...
    ValueError: top_p: SGLang reports log-probs before top-k / top-p / min-p truncation, so μ would not be the distribution sampled from; sample untruncated
    """
    for name in ("top_k", "top_p", "min_p"):
        if name in cfg.processors:
            raise ValueError(f"{name}: SGLang reports log-probs before top-k / top-p / min-p truncation, so μ would "
                             "not be the distribution sampled from; sample untruncated")
    if cfg.reads_history or cfg.bad_words_ids:
        raise ValueError(f"{(cfg.reads_history or ('bad_words',))[0]}: not sent to SGLang by this client; sample "
                         "without penalties and bad words")


def parse_sglang_generate(answer: Any, cfg: SamplingConfig, *, where: str = "request",
                          vocab_size: int | None = None) -> ServerCompletion:
    """Parse an SGLang ``/generate`` answer: ``meta_info.output_token_logprobs`` = ``[[logprob, id, text], …]`` and,
    with ``top_logprobs_num``, ``meta_info.output_top_logprobs`` = one such list per position.

    >>> a = {"text": "x", "output_ids": [4], "meta_info": {"output_token_logprobs": [[-0.25, 4, None]],
    ...      "output_top_logprobs": [[[-0.25, 4, None], [-1.5, 9, None]]]}}
    >>> c = parse_sglang_generate(a, SamplingConfig(logprobs_topk=2))
    >>> c.ids, c.logp, c.top_ids, c.top_logp
    ([4], [-0.25], [[4, 9]], [[-0.25, -1.5]])
    """
    if isinstance(answer, list) and len(answer) == 1:
        answer = answer[0]
    meta = get_field(answer, "meta_info", f"{where}: answer", dict)
    w = f"{where}: answer.meta_info"
    entries = get_field(meta, "output_token_logprobs", w, list)
    ids, logp = [], []
    for j, e in enumerate(entries):
        we = f"{w}.output_token_logprobs[{j}]"
        if not isinstance(e, list) or len(e) < 2:
            raise ServerError(f"{we} must be [logprob, id, text], got {str(e)[:80]}")
        logp.append(check_logprob(e[0], f"{we}[0]"))
        ids.append(check_token(e[1], f"{we}[1]", vocab_size))
    out_ids = answer.get("output_ids") if isinstance(answer, dict) else None
    if out_ids is not None and list(out_ids) != ids:
        raise ServerError(f"{where}: answer.output_ids {list(out_ids)[:8]}… differ from the ids in "
                          f"meta_info.output_token_logprobs {ids[:8]}…")
    top_ids = top_logp = None
    k = cfg.logprobs_topk
    if k > 0:
        rows = get_field(meta, "output_top_logprobs", w, list)
        if len(rows) != len(ids):
            raise ServerError(f"{w}: {len(ids)} tokens but {len(rows)} output_top_logprobs entries")
        top_ids, top_logp = [], []
        for j, row in enumerate(rows):
            wj = f"{w}.output_top_logprobs[{j}]"
            if not isinstance(row, list):
                raise ServerError(f"{wj} must be a list of [logprob, id, text], got {type(row).__name__}")
            pairs = []
            for m, e in enumerate(row):
                if not isinstance(e, list) or len(e) < 2:
                    raise ServerError(f"{wj}[{m}] must be [logprob, id, text], got {str(e)[:80]}")
                pairs.append((check_token(e[1], f"{wj}[{m}][1]", vocab_size), check_logprob(e[0], f"{wj}[{m}][0]")))
            pairs.sort(key=lambda p: -p[1])
            top_ids.append([i for i, _ in pairs[:k]])
            top_logp.append([v for _, v in pairs[:k]])
    text = answer.get("text") if isinstance(answer.get("text"), str) else ""
    return ServerCompletion(ids, logp, top_ids, top_logp, text)


# -- the engine ---------------------------------------------------------------------------------------------------
def completions_to_output(prompt_ids: list[list[int]], parsed: list[ServerCompletion], k: int,
                          sampling: SamplingConfig | None) -> RolloutOutput:
    """Pad parsed answers into a :class:`RolloutOutput` (top-k ``[B, T, K]``: −inf / id 0 where fewer than K came
    back, e.g. after truncation)."""
    b, t = len(parsed), max((len(c.ids) for c in parsed), default=0)
    logp = torch.zeros(b, t)
    mask = torch.zeros(b, t, dtype=torch.bool)
    topk_logp = torch.zeros(b, t, k) if k > 0 else None
    topk_ids = torch.zeros(b, t, k, dtype=torch.long) if k > 0 else None
    for i, c in enumerate(parsed):
        n = len(c.ids)
        if n:
            logp[i, :n] = torch.tensor(c.logp, dtype=torch.float64).float()
            mask[i, :n] = True
        if k > 0 and n:
            assert topk_logp is not None and topk_ids is not None  # allocated above when k > 0
            assert c.top_ids is not None and c.top_logp is not None, "parsed with k > 0: top-k lists are set"
            topk_logp[i, :n] = -math.inf
            for j in range(n):
                m = min(k, len(c.top_ids[j]))
                topk_ids[i, j, :m] = torch.tensor(c.top_ids[j][:m], dtype=torch.long)
                topk_logp[i, j, :m] = torch.tensor(c.top_logp[j][:m], dtype=torch.float64).float()
    return RolloutOutput(prompt_ids=[list(p) for p in prompt_ids], completion_ids=[list(c.ids) for c in parsed],
                         logp=logp, mask=mask, topk_logp=topk_logp, topk_ids=topk_ids,
                         texts=[c.text for c in parsed], sampling=sampling)


class ServerRolloutEngine:
    """The engine interface (:class:`~offpolicy.rollout.base.RolloutEngine`) over a running server.

    Args:
        url: the server's base address, e.g. ``http://127.0.0.1:8000``.
        protocol: a :class:`ServerProtocol` (:class:`VLLMProtocol`, :class:`SGLangProtocol`,
            :class:`~offpolicy.rollout.llamacpp.LlamaCppProtocol`).
        vocab_size: the trainer's vocabulary: ids outside it are refused (None: not checked).
        timeout: seconds per request.
        tokenizer: optional, decodes ``texts`` when the server sends none.

    ``sync_weights`` cannot push tensors into a remote server: it writes the model into ``weights_dir`` — a
    :class:`~offpolicy.rollout.weight_sync.ReloadFolder` of the project's own on a disk both can read (a temporary
    folder on this machine when not given; never the model directory the server was started on) — then has the
    server reload from it (``weights_path``). The llama.cpp engine that owns its server exports and restarts instead.
    """

    def __init__(self, url: str, protocol: ServerProtocol, *, vocab_size: int | None = None, timeout: float = 120.0,
                 tokenizer=None, weights_dir: str | os.PathLike | None = None) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        if not (isinstance(timeout, (int, float)) and 0 < timeout < math.inf):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.url = url.rstrip("/")
        self.protocol = protocol
        self.vocab_size = vocab_size
        self.timeout = float(timeout)
        self.tokenizer = tokenizer
        self.weights_dir = Path(weights_dir) if weights_dir is not None else None
        self._reload_folder: ReloadFolder | None = None

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Write ``model`` into the reload folder (``weights_dir``, or a temporary folder on this machine) and have
        the server reload from there."""
        if self._reload_folder is None:
            if self.weights_dir is None:
                self.weights_dir = Path(tempfile.mkdtemp(prefix="offpolicy-reload-"))
            self._reload_folder = ReloadFolder(self.weights_dir)
        self._reload_folder.write_model(model)
        self.reload_weights(str(self.weights_dir))

    full_logits = False  # score() gives the sampled tokens' log-probs, not [B, T, V] logits

    @property
    def scores_tokens(self) -> bool:
        """Whether :meth:`score` works with this protocol (vLLM's prompt log-probs)."""
        return hasattr(self.protocol, "score_request")

    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]],
              cfg: SamplingConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs ``[B, T]`` (0 at padding) and mask of given completions under the server's numerics, teacher-
        forced (vLLM: prompt log-probs, the raw distribution at temperature 1; ``cfg`` must be None). What
        :mod:`offpolicy.rollout.sync_check` compares with the trainer after a reload."""
        request = getattr(self.protocol, "score_request", None)
        if request is None:
            raise ValueError(f"score: the {self.protocol.name} protocol cannot score given tokens")
        if cfg is not None:
            raise ValueError("cfg: a server's prompt log-probs are the raw distribution; score with cfg=None")
        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"prompt_ids has {len(prompt_ids)} rows but completion_ids has {len(completion_ids)}")
        t = max((len(c) for c in completion_ids), default=0)
        logp, mask = torch.zeros(len(prompt_ids), t), torch.zeros(len(prompt_ids), t, dtype=torch.bool)
        for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
            what = f"{self.protocol.name} scoring request {i} ({self.protocol.path})"
            answer = post_json(self.url + self.protocol.path, request(list(p), list(c)), timeout=self.timeout,
                               what=what)
            values = self.protocol.parse_score(answer, list(p), list(c), where=what)  # type: ignore[attr-defined]
            logp[i, : len(values)] = torch.tensor(values)
            mask[i, : len(values)] = True
        return logp, mask

    def reload_weights(self, path: str) -> None:
        """Make the server load new weights from the folder ``path`` (on the server's disk). A folder the server
        cannot take as a whole model is refused first (:func:`~offpolicy.rollout.weight_sync.check_reload_folder`:
        e.g. ``save_pretrained``'s tied head stored once); whether the server then serves the new weights is what
        :class:`~offpolicy.rollout.sync_check.SyncCheck` verifies."""
        reload = getattr(self.protocol, "reload_weights", None)
        if reload is None:
            raise ValueError(f"reload_weights: the {self.protocol.name} protocol has no reload call")
        if Path(path).is_dir():  # a folder on this machine: checked here; a remote path is the server's to read
            check_reload_folder(path)
        reload(self.url, str(path), timeout=self.timeout)

    def generate(self, prompt_ids: list[list[int]], cfg: SamplingConfig, *, seed: int) -> RolloutOutput:
        """One request per prompt, row i with seed ``seed + i`` (sequential: reproducible on one server slot)."""
        if not isinstance(cfg, SamplingConfig):
            raise ValueError(f"cfg must be a SamplingConfig, got {type(cfg).__name__}")  # noqa: TRY004 - convention
        check_prompt_ids(prompt_ids, self.vocab_size)
        applied = self.protocol.applied(cfg)
        parsed = []
        for i, prompt in enumerate(prompt_ids):
            what = f"{self.protocol.name} request {i} ({self.protocol.path})"
            answer = post_json(self.url + self.protocol.path, self.protocol.request(list(prompt), cfg, int(seed) + i),
                               timeout=self.timeout, what=what)
            c = self.protocol.parse(answer, cfg, where=what, vocab_size=self.vocab_size)
            if c.missing:
                fill = getattr(self.protocol, "fill_missing", None)
                if fill is None:
                    raise ServerError(f"{what}: no log-prob for positions {c.missing}")
                c = fill(self.url, list(prompt), c, cfg, timeout=self.timeout, where=what)
            if any(math.isnan(v) for v in c.logp):
                raise ServerError(f"{what}: a sampled token has no log-prob (NaN)")
            if len(c.ids) > cfg.max_new_tokens:
                raise ServerError(f"{what}: {len(c.ids)} tokens came back for max_new_tokens={cfg.max_new_tokens}")
            if not c.text and self.tokenizer is not None:
                c = replace(c, text=self.tokenizer.decode(c.ids, skip_special_tokens=True))
            parsed.append(c)
        return completions_to_output(prompt_ids, parsed, cfg.logprobs_topk, applied)


def vllm_reload_weights(url: str, path: str, *, timeout: float, weights_path: str | None = None) -> None:
    """vLLM dev-mode reload (``VLLM_SERVER_DEV_MODE=1``): pause, ``reload_weights`` in every worker from the folder
    ``weights_path`` (without it: from the folder the server last loaded, which vLLM reads again as it is), reset
    the prefix cache so no KV computed with the old weights is reused, resume.

    Every call answers 200 — also when the reload left part of the model behind: with tied embeddings a checkpoint
    stores the head once, and vLLM's CPU backend (which keeps a repacked copy of the head) then keeps the old head
    (measured on the tiny model: 0.24 nats per token from the new model); beside a sharded checkpoint's index a new
    ``model.safetensors`` is not read at all. Write the weights with
    :class:`~offpolicy.rollout.weight_sync.ReloadFolder` (its own folder, the head under its own name) and check the
    reload with :class:`~offpolicy.rollout.sync_check.SyncCheck` (``offpolicy inspect --check-sync``)."""
    reload: dict[str, Any] = {"method": "reload_weights"}
    if weights_path is not None:
        reload["kwargs"] = {"weights_path": weights_path}
    for step, body in (("/pause", {}), ("/collective_rpc", reload), ("/reset_prefix_cache", {}), ("/resume", {})):
        post_json(url + step, body, timeout=timeout, what=f"vllm weight reload {step}")


def sglang_reload_weights(url: str, path: str, *, timeout: float) -> None:
    """SGLang ``/update_weights_from_disk`` with ``model_path``; its answer must say ``success``. Unverified
    against a live server."""
    answer = post_json(url + "/update_weights_from_disk", {"model_path": path}, timeout=timeout,
                       what="sglang /update_weights_from_disk")
    if not (isinstance(answer, dict) and answer.get("success") is True):
        raise ServerError(f"sglang /update_weights_from_disk: answer.success is not true: {str(answer)[:200]}")



def write_reload_checkpoint(model: torch.nn.Module, folder: str | Path) -> Path:
    """``ReloadFolder(folder).write_model(model)``: every tensor of the state dict under its own name, in a folder of
    the project's own (a model directory is refused). Kept for one release; use
    :class:`~offpolicy.rollout.weight_sync.ReloadFolder`."""
    return ReloadFolder(folder).write_model(model)


def write_reload_tensors(named: Iterable[tuple[str, torch.Tensor]], folder: str | Path) -> Path:
    """``ReloadFolder(folder).write(named)``. Kept for one release; use
    :class:`~offpolicy.rollout.weight_sync.ReloadFolder`."""
    return ReloadFolder(folder).write(named)


SERVER_PROTOCOLS = ("vllm", "sglang", "llamacpp")


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


def connect_server(url: str, *, protocol: str | None = None, vocab_size: int | None = None, timeout: float = 120.0,
                   tokenizer=None, weights_dir: str | os.PathLike | None = None) -> ServerRolloutEngine:
    """The engine interface on a running vLLM, SGLang or llama.cpp server at ``url`` (``protocol`` None: detected
    by :func:`detect_protocol`); ``weights_dir``: where :meth:`ServerRolloutEngine.sync_weights` writes the model
    for the server to reload."""
    protocol = protocol or detect_protocol(url)
    if protocol not in SERVER_PROTOCOLS:
        raise ValueError(f"protocol must be one of {SERVER_PROTOCOLS}, got {protocol!r}")
    if protocol == "llamacpp":
        from offpolicy.rollout.llamacpp import connect_llamacpp

        engine = connect_llamacpp(url, vocab_size=vocab_size, timeout=timeout, tokenizer=tokenizer)
        engine.weights_dir = Path(weights_dir) if weights_dir is not None else None
        return engine
    proto: ServerProtocol = VLLMProtocol(served_model(url)) if protocol == "vllm" else SGLangProtocol()
    return ServerRolloutEngine(url, proto, vocab_size=vocab_size, timeout=timeout, tokenizer=tokenizer,
                               weights_dir=weights_dir)
