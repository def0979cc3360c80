"""The server protocols: vLLM's OpenAI ``/v1/completions`` and SGLang's native ``/generate`` (llama.cpp's native
``/completion`` is in :mod:`offpolicy.rollout.llamacpp`) — request bodies, answer parsers, reload calls — and
:func:`vllm_sampling`, the recipe as vLLM's ``SamplingParams`` (the in-process engine sends the same).

A protocol turns a prompt (token ids) and a :class:`~offpolicy.rollout.sampling.SamplingConfig` into a request body,
and the server's answer into a :class:`ServerCompletion` — the sampled ids, their log-probs (μ) and the top-k. The
parsers are plain functions of the JSON, tested on recorded answers; they refuse an answer that does not say what the
trainer needs (missing field, NaN, ids outside the vocabulary, a sampled id that disagrees with its log-prob entry)
with a :class:`ServerError` naming the request and the field, never a silent NaN.
:class:`~offpolicy.rollout.server_engine.ServerRolloutEngine` sends one request per prompt (seed ``seed + i``) and
pads the answers into a :class:`~offpolicy.rollout.base.RolloutOutput`.

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
``/collective_rpc`` of offpolicy's worker extension (a MoE model's experts repacked on vLLM's CPU backend) →
``/reset_prefix_cache`` → ``/resume``; SGLang ``/update_weights_from_disk``. Both read the weights from a model
directory on the server's disk (:meth:`~offpolicy.rollout.server_engine.ServerRolloutEngine.reload_weights`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from offpolicy.rollout.http import ServerError, check_logprob, check_token, get_field, post_json
from offpolicy.rollout.sampling import SamplingConfig


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

    def check_lengths(self, where: str) -> None:
        """A :class:`ServerError` naming ``where`` (the request) unless there is one log-prob — and, when asked for,
        one top-k row — per sampled token: a short answer is never padded (μ = 1 or a zero log-prob).

        >>> ServerCompletion([5, 6], [-0.5]).check_lengths("vllm request 3")
        Traceback (most recent call last):
        ...
        offpolicy.rollout.http.ServerError: vllm request 3: 2 tokens but 1 log-probs in the answer
        """
        if len(self.logp) != len(self.ids):
            raise ServerError(f"{where}: {len(self.ids)} tokens but {len(self.logp)} log-probs in the answer")
        for name in ("top_ids", "top_logp"):
            rows = getattr(self, name)
            if rows is not None and len(rows) != len(self.ids):
                raise ServerError(f"{where}: {len(self.ids)} tokens but {len(rows)} {name} rows in the answer")


class ServerProtocol(Protocol):
    """What a server client provides (see :class:`VLLMProtocol`, :class:`SGLangProtocol`,
    :class:`offpolicy.rollout.llamacpp.LlamaCppProtocol`)."""

    name: str
    path: str

    def applied(self, cfg: SamplingConfig) -> SamplingConfig: ...

    def request(self, prompt: list[int], cfg: SamplingConfig, seed: int) -> dict: ...

    def parse(self, answer: Any, cfg: SamplingConfig, *, where: str, vocab_size: int | None) -> ServerCompletion: ...


# -- vLLM's sampling parameters (the in-process engine and the server client send the same) -----------------------
def check_vllm_filter_order(cfg: SamplingConfig) -> None:
    """Refuse min-p together with top-p: vLLM applies min-p before top-p, the trainer's scoring
    (:func:`offpolicy.rollout.sampling.process_logits`, HF's order) after it, and the two kept sets then differ (on 68 %
    of rows in a check with DVP's ρ), so μ and π_old would be two different distributions. Top-k commutes with min-p.

    >>> check_vllm_filter_order(SamplingConfig(max_new_tokens=4, top_k=20, min_p=0.05))  # fine
    """
    if cfg.min_p and cfg.top_p is not None and cfg.top_p < 1.0:
        raise ValueError("min_p with top_p: vLLM applies min-p before top-p and the trainer's scoring after it, so "
                         "the sampled and the scored distributions differ; use one of the two")


VLLM_MIN_TEMPERATURE = 1e-2  # vLLM raises 0 < T < 0.01 to 0.01 (its sampling_params._MAX_TEMP)
VLLM_GREEDY_BELOW = 1e-5  # and samples greedily below 1e-5 (_SAMPLING_EPS): no distribution to replay
VLLM_LOGIT_BIAS_BOUND = 100.0  # vLLM clamps each logit_bias value to [−100, 100] (OpenAI's range)


def vllm_sampling(cfg: SamplingConfig) -> tuple[dict[str, Any], SamplingConfig]:
    """``SamplingParams`` keyword arguments for ``cfg``'s processors, and the recipe vLLM will apply — ``cfg`` with
    the temperature after vLLM's floor — which the engine reports. A processor vLLM would apply differently from
    the trainer's replay is refused, naming it.

    >>> kwargs, applied = vllm_sampling(SamplingConfig(temperature=0.005, repetition_penalty=1.1))
    >>> kwargs["temperature"], applied.temperature, kwargs["repetition_penalty"]
    (0.01, 0.01, 1.1)
    """
    check_vllm_filter_order(cfg)
    if cfg.bad_words_ids:
        raise ValueError("bad_words: vLLM takes bad words as strings and bans the tokenisations it makes of them "
                         "(with and without a leading space), not these token ids; ban single tokens with "
                         "logit_bias={id: -100.0} or sample with the HF engine")
    if any(abs(b) > VLLM_LOGIT_BIAS_BOUND for _, b in cfg.logit_bias):
        raise ValueError(f"logit_bias: vLLM clamps each bias to [-{VLLM_LOGIT_BIAS_BOUND:g}, "
                         f"{VLLM_LOGIT_BIAS_BOUND:g}], so a larger one would be scored with another value")
    if cfg.temperature < VLLM_GREEDY_BELOW:
        raise ValueError(f"temperature: below {VLLM_GREEDY_BELOW:g} vLLM samples greedily (argmax), a distribution "
                         "the trainer cannot score")
    applied = replace(cfg, temperature=max(cfg.temperature, VLLM_MIN_TEMPERATURE))
    kwargs = {
        "temperature": applied.temperature,
        "top_k": cfg.top_k if cfg.top_k is not None else -1,
        "top_p": cfg.top_p if cfg.top_p is not None else 1.0,
        "min_p": cfg.min_p if cfg.min_p is not None else 0.0,
        "repetition_penalty": cfg.repetition_penalty,
        "presence_penalty": cfg.presence_penalty,
        "frequency_penalty": cfg.frequency_penalty,
        "logit_bias": dict(cfg.logit_bias) or None,
    }
    return kwargs, applied


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


def _vllm_logprob(value: Any, where: str, vocab: int | None = None) -> float:
    v = check_logprob(value, where, vocab=vocab)
    return -math.inf if v <= VLLM_NEG_INF else v


def vllm_logprobs_mode_verdict(vllm_config: Any, *, server: str = "the vLLM server") -> str | None:
    """None when a vLLM server's resolved config — ``/server_info?config_format=json``'s ``vllm_config``, what TRL's
    ``VLLMClient.get_server_info`` returns — reports processed log-probs (μ after temperature and truncation: the
    distribution sampled from), else the one-line error to raise. Every host's start-up check is this one.

    >>> vllm_logprobs_mode_verdict({"model_config": {"logprobs_mode": "processed_logprobs"}}) is None
    True
    >>> vllm_logprobs_mode_verdict({"model_config": {"logprobs_mode": "raw_logprobs"}})[:60]
    'logprobs_mode: the vLLM server runs with --logprobs-mode raw'
    """
    try:
        mode = vllm_config["model_config"]["logprobs_mode"]
    except (KeyError, TypeError):
        mode = "unknown (its /server_info has no model_config.logprobs_mode)"
    if mode == "processed_logprobs":
        return None
    return (f"logprobs_mode: {server} runs with --logprobs-mode {mode}; μ must be the sampling distribution: "
            "restart it with --logprobs-mode processed_logprobs")


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
        return vllm_sampling(cfg)[1]

    def request(self, prompt: list[int], cfg: SamplingConfig, seed: int) -> dict:
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
    logp = [_vllm_logprob(v, f"{w}.logprobs.token_logprobs[{j}]", vocab_size) for j, v in enumerate(values)]
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
        width = cfg.top_k  # the most tokens a top-k truncation keeps (None: no top-k)
        for j, row in enumerate(rows):
            wj = f"{w}.logprobs.top_logprobs[{j}]"
            if not isinstance(row, dict):
                raise ServerError(f"{wj} must be an object of 'token_id:<id>': logprob, got {type(row).__name__}")
            pairs = sorted(((_vllm_token_id(key, f"{wj} key", vocab_size), _vllm_logprob(v, f"{wj}[{key!r}]", vocab_size))
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
        logp.append(check_logprob(e[0], f"{we}[0]", vocab=vocab_size))
        ids.append(check_token(e[1], f"{we}[1]", vocab_size))
    n_out = meta.get("completion_tokens")
    if isinstance(n_out, int) and not isinstance(n_out, bool) and n_out != len(entries):
        raise ServerError(f"{w}: completion_tokens = {n_out} but output_token_logprobs has {len(entries)} entries")
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
                pairs.append((check_token(e[1], f"{wj}[{m}][1]", vocab_size), check_logprob(e[0], f"{wj}[{m}][0]", vocab=vocab_size)))
            pairs.sort(key=lambda p: -p[1])
            top_ids.append([i for i, _ in pairs[:k]])
            top_logp.append([v for _, v in pairs[:k]])
    text = answer.get("text") if isinstance(answer.get("text"), str) else ""
    return ServerCompletion(ids, logp, top_ids, top_logp, text)


# -- reload calls -------------------------------------------------------------------------------------------------
def vllm_reload_weights(url: str, path: str, *, timeout: float, weights_path: str | None = None) -> None:
    """vLLM dev-mode reload (``VLLM_SERVER_DEV_MODE=1``): pause, ``reload_weights`` in every worker from the folder
    ``weights_path`` (without it: from the folder the server last loaded, which vLLM reads again as it is), a
    mixture-of-experts model's experts repacked (:func:`repack_experts_after_reload`), reset the prefix cache so no
    KV computed with the old weights is reused, resume.

    Every call answers 200 — also when the reload left part of the model behind: with tied embeddings a checkpoint
    stores the head once, and vLLM's CPU backend (which keeps a repacked copy of the head) then keeps the old head
    (measured on the tiny model: 0.24 nats per token from the new model); beside a sharded checkpoint's index a new
    ``model.safetensors`` is not read at all. Write the weights with
    :class:`~offpolicy.rollout.weight_sync.ReloadFolder` (its own folder, the head under its own name) and check the
    reload with :class:`~offpolicy.rollout.sync_check.SyncCheck` (``offpolicy inspect --check-sync``)."""
    reload: dict[str, Any] = {"method": "reload_weights"}
    if weights_path is not None:
        reload["kwargs"] = {"weights_path": weights_path}
    for step, body in (("/pause", {}), ("/collective_rpc", reload)):
        post_json(url + step, body, timeout=timeout, what=f"vllm weight reload {step}")
    repack_experts_after_reload(url, weights_path or path, timeout=timeout)
    for step, body in (("/reset_prefix_cache", {}), ("/resume", {})):
        post_json(url + step, body, timeout=timeout, what=f"vllm weight reload {step}")


def _is_moe_folder(folder: str) -> bool:
    """Whether the model directory ``folder`` (on this machine) holds a mixture-of-experts config."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return any(int(config.get(key) or 0) > 1 for key in ("num_experts", "num_local_experts", "n_routed_experts"))


def repack_experts_after_reload(url: str, folder: str, *, timeout: float) -> int | None:
    """After a vLLM server's ``reload_weights``: its workers' fused-MoE experts prepacked again by offpolicy's worker
    extension (:meth:`~offpolicy.rollout.vllm_worker.OffpolicyWorkerExtension.offpolicy_repack_cpu_experts`) — vLLM
    0.32's CPU reload leaves them unpacked: 2.7 nats per token from a fresh load of the same weights on lab-moe, 0
    once repacked. Returns the layers repacked (summed over workers), or None where the server was started without
    the extension (``--worker-extension-cls``; :class:`~offpolicy.rollout.vllm_server.VLLMServer` adds it): then a
    MoE model in ``folder`` is warned about once, the sync check measuring what that leaves."""
    from offpolicy.rollout.vllm_worker import REPACK_METHOD, WORKER_EXTENSION

    try:
        answer = post_json(url + "/collective_rpc", {"method": REPACK_METHOD}, timeout=timeout,
                           what=f"vllm weight reload /collective_rpc {REPACK_METHOD}")
    except ServerError as err:
        if f"has no attribute '{REPACK_METHOD}'" not in str(err):
            raise
        if _is_moe_folder(folder) and url not in _WARNED_NO_EXTENSION:
            import warnings

            _WARNED_NO_EXTENSION.add(url)
            warnings.warn(f"the vLLM server at {url} has no offpolicy worker extension, so a mixture-of-experts "
                          "model's experts are not repacked after its reload (vLLM's CPU backend leaves them "
                          f"unpacked): start it with --worker-extension-cls {WORKER_EXTENSION}", stacklevel=3)
        return None
    results = answer.get("results") if isinstance(answer, dict) else None
    return sum(int(r) for r in results) if isinstance(results, list) else 0


_WARNED_NO_EXTENSION: set[str] = set()


def sglang_reload_weights(url: str, path: str, *, timeout: float) -> None:
    """SGLang ``/update_weights_from_disk`` with ``model_path``; its answer must say ``success``. Unverified
    against a live server."""
    answer = post_json(url + "/update_weights_from_disk", {"model_path": path}, timeout=timeout,
                       what="sglang /update_weights_from_disk")
    if not (isinstance(answer, dict) and answer.get("success") is True):
        raise ServerError(f"sglang /update_weights_from_disk: answer.success is not true: {str(answer)[:200]}")
