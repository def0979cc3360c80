"""llama.cpp's own server as a rollout engine (``pip install 'offpolicy[llamacpp]'``): real inference kernels on CPU.

:class:`LlamaCppRolloutEngine` writes the trainer's model as GGUF (:func:`offpolicy.models.gguf.export_gguf`: F32,
F16, BF16, Q8_0 or Q4_0 weights) and starts ``llama-server`` inside this process (the ``xllamacpp`` wheel, a
background thread) on 127.0.0.1, a free port, one slot (sequential requests: reproducible), ``cache_prompt`` off
(a reused prompt cache changes the logits' last bits). The KV cache type is a server option (``f32``, ``f16`` —
llama.cpp's default —, ``bf16``, ``q8_0``, ``q4_0``: a real quantised KV cache). Weights cannot be pushed into a
running llama-server: :meth:`LlamaCppRolloutEngine.sync_weights` writes a new GGUF and restarts the server on it,
timing both (``sync_log``). :func:`connect_llamacpp` speaks to a server that is already running (``server=URL``).

The protocol (:class:`LlamaCppProtocol`): ``/completion`` with the prompt as token ids, ``n_predict``, ``seed`` and
every sampler parameter set, plus an explicit sampler chain in the trainer's replay order
(:func:`offpolicy.rollout.sampling.process_logits`): ``temperature`` → ``top_k`` → ``top_p`` → ``min_p`` (llama.cpp's
default chain applies temperature *last*, with top-k 40, top-p 0.95 and min-p 0.05 on). ``logit_bias`` is applied
before the chain, as in the replay. Penalties and bad words are refused: llama.cpp counts penalties over a window of
the prompt *and* the completion, the replay's frequency / presence penalties over the completion only.

What comes back: ``n_probs: K`` gives each sampled position the K most likely tokens, uncapped, so K = V returns the
full distribution (≈ 2.6 kB of JSON per token and position: inspect wants it, training wants K of 1–20). By default
those are the raw softmax of the logits; with a processor on (temperature ≠ 1, truncation, bias) the client asks for
``post_sampling_probs`` — the distribution the sampler drew from, which μ must be — as probabilities. llama.cpp's
probabilities are not exactly normalised (they sum to 1 ± ~1e-4 over the vocabulary), so when an answer holds the
whole support (fewer entries than asked for, or K ≥ V) the parser renormalises μ; with K below the support the
values are passed through as the server wrote them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from offpolicy.rollout.factory import register_engine
from offpolicy.rollout.http import ServerError, check_token, get_field, post_json, wait_until_healthy
from offpolicy.rollout.processes import free_port
from offpolicy.rollout.protocols import ServerCompletion
from offpolicy.rollout.sampling import SamplingConfig, process_logits
from offpolicy.rollout.server_engine import ServerRolloutEngine
from offpolicy.rollout.spec import LLAMACPP_KV, EngineSpec

LLAMACPP_MISSING = "the llama.cpp engine needs xllamacpp and gguf: pip install 'offpolicy[llamacpp]'"
KV_CACHE_TYPES: tuple[str, ...] = ("f32", "f16", "bf16", "q8_0", "q4_0")
# process_logits's order after the bias: the chain sent to llama.cpp (only the active ones after temperature)
_TRUNCATIONS = ("top_k", "top_p", "min_p")


def llamacpp_sampling(cfg: SamplingConfig) -> dict[str, Any]:
    """The sampler fields of a ``/completion`` request for ``cfg``: the chain in the replay's order and every
    parameter llama.cpp would otherwise default (top-k 40, top-p 0.95, min-p 0.05, penalties, DRY, XTC, …) set to
    off. Penalties and bad words are refused (module docstring).

    >>> s = llamacpp_sampling(SamplingConfig(temperature=0.7, top_p=0.9))
    >>> s["samplers"], s["top_k"], s["top_p"], s["min_p"]
    (['temperature', 'top_p'], 0, 0.9, 0.0)
    """
    if cfg.reads_history or cfg.bad_words_ids:
        name = (cfg.reads_history or ("bad_words",))[0]
        raise ValueError(f"{name}: llama.cpp applies penalties over a window of prompt and completion tokens and has "
                         "no token-id bad words, so the trainer could not replay them; sample without, or use the "
                         "transformers engine")
    return {
        "samplers": ["temperature"] + [name for name in _TRUNCATIONS if name in cfg.processors],
        "temperature": float(cfg.temperature),
        "top_k": int(cfg.top_k or 0),
        "top_p": float(cfg.top_p if cfg.top_p is not None else 1.0),
        "min_p": float(cfg.min_p or 0.0),
        "min_keep": 0, "typical_p": 1.0, "top_n_sigma": -1.0, "dynatemp_range": 0.0, "xtc_probability": 0.0,
        "mirostat": 0, "dry_multiplier": 0.0, "repeat_penalty": 1.0, "presence_penalty": 0.0,
        "frequency_penalty": 0.0, "ignore_eos": False,
        "logit_bias": [[int(i), float(b)] for i, b in cfg.logit_bias],
    }


class LlamaCppProtocol:
    """llama-server's native ``/completion`` (token ids in, sampled ids + log-probs out). ``vocab_size`` is what
    K = V means (the full distribution) and what the answer must cover for μ to be renormalised."""

    name = "llama.cpp"
    path = "/completion"

    def __init__(self, vocab_size: int | None = None, *, ignore_eos: bool = False) -> None:
        self.vocab_size = vocab_size
        # llama-server's ignore_eos: end-of-generation tokens get a −inf bias when sampling, so every answer runs to
        # n_predict; the log-probs it reports stay the raw distribution's (EOS mass included), as the trainer scores
        self.ignore_eos = bool(ignore_eos)

    def applied(self, cfg: SamplingConfig) -> SamplingConfig:
        llamacpp_sampling(cfg)
        return cfg

    def request(self, prompt: list[int], cfg: SamplingConfig, seed: int) -> dict:
        # llama.cpp seeds are uint32 and 0xFFFFFFFF means "random": wrap below it
        return {"prompt": list(prompt), "n_predict": cfg.max_new_tokens, "seed": int(seed) % 0xFFFFFFFF,
                "n_probs": max(cfg.logprobs_topk, 1), "post_sampling_probs": bool(cfg.processors),
                "cache_prompt": False, "return_tokens": True, "stream": False, **llamacpp_sampling(cfg),
                "ignore_eos": self.ignore_eos}

    def parse(self, answer: Any, cfg: SamplingConfig, *, where: str, vocab_size: int | None) -> ServerCompletion:
        return parse_llamacpp_completion(answer, cfg, where=where, vocab_size=vocab_size or self.vocab_size)

    def fill_missing(self, url: str, prompt: list[int], c: ServerCompletion, cfg: SamplingConfig, *,
                     timeout: float, where: str) -> ServerCompletion:
        """μ at the positions llama-server sent no log-prob for (a token ending inside a UTF-8 character): one
        more request per position, greedy for one token from the same context, returns the raw full distribution
        (``n_probs`` = V; raw log-probs ignore the bias that bans a next token that would again be incomplete); the
        recipe is then applied by :func:`~offpolicy.rollout.sampling.process_logits`, as the trainer replays it."""
        if self.vocab_size is None:
            raise ServerError(f"{where}: positions {c.missing} have no log-prob and vocab_size is unknown")
        vocab = self.vocab_size
        logp, top_ids, top_logp = list(c.logp), c.top_ids, c.top_logp
        for j in c.missing:
            raw = self._raw_distribution(url, list(prompt) + c.ids[:j], vocab, timeout=timeout,
                                         where=f"{where} position {j}")
            processed = process_logits(raw, cfg)
            logp[j] = float(processed[c.ids[j]])
            if not logp[j] > -math.inf:
                raise ServerError(f"{where} position {j}: the sampled token {c.ids[j]} has probability 0")
            if top_ids is not None and top_logp is not None:
                values, ids = processed.topk(min(cfg.logprobs_topk, vocab))
                top_ids[j], top_logp[j] = ids.tolist(), values.tolist()
        return ServerCompletion(c.ids, logp, top_ids, top_logp, c.text)

    def _raw_distribution(self, url: str, context: list[int], vocab: int, *, timeout: float,
                          where: str) -> torch.Tensor:
        banned: list[list] = []
        for _ in range(16):
            body = {"prompt": context, "n_predict": 1, "n_probs": vocab, "post_sampling_probs": False,
                    "cache_prompt": False, "return_tokens": True, "samplers": ["top_k"], "top_k": 1,
                    "logit_bias": banned, "seed": 0}
            answer = post_json(url + self.path, body, timeout=timeout, what=f"{where} (refill)")
            steps = get_field(answer, "completion_probabilities", f"{where} (refill): answer", list)
            if steps:
                out = torch.full((vocab,), -math.inf, dtype=torch.float64)
                for i, e in enumerate(get_field(steps[0], "top_logprobs", f"{where} (refill)", list)):
                    we = f"{where} (refill): top_logprobs[{i}]"
                    out[check_token(get_field(e, "id", we), f"{we}.id", vocab)] = _logp(
                        get_field(e, "logprob", we), f"{we}.logprob")
                return (out - torch.logsumexp(out, 0)).float()
            tokens = get_field(answer, "tokens", f"{where} (refill): answer", list)
            if not tokens:
                break
            banned.append([tokens[0], False])
        raise ServerError(f"{where}: llama-server sent no probabilities for this position (every greedy token ended "
                          "inside a UTF-8 character)")

    can_reload = False  # llama-server loads its GGUF at start-up only

    def reload_weights(self, url: str, path: str, *, timeout: float) -> None:
        raise ValueError("reload_weights: a running llama-server cannot load new weights; restart it on the new GGUF "
                         "(LlamaCppRolloutEngine owns its server and does so in sync_weights)")


def _prob_to_logp(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0 + 1e-3:
        raise ServerError(f"{where} must be a probability in [0, 1], got {str(value)[:80]}")
    return math.log(value) if value > 0 else -math.inf


def _logp(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value > 1e-3:
        raise ServerError(f"{where} must be a log-prob ≤ 0, got {str(value)[:80]}")
    return min(float(value), 0.0)


def _align(tokens: list[int], entry_ids: list[int], where: str) -> list[int | None]:
    """For each token, the index of its probability entry, or None where llama-server wrote none: it drops the
    entry of a token whose text ends inside a UTF-8 character and keeps the one of the token that completes it, so
    the entries are a subsequence of the tokens, matched right to left (the later of equal ids owns the entry)."""
    out: list[int | None] = [None] * len(tokens)
    e = len(entry_ids) - 1
    for j in range(len(tokens) - 1, -1, -1):
        if e >= 0 and entry_ids[e] == tokens[j]:
            out[j] = e
            e -= 1
    if e >= 0:
        raise ServerError(f"{where}.completion_probabilities[{e}].id = {entry_ids[e]} matches no sampled token in "
                          "answer.tokens (other token ids than sampled)")
    return out


def parse_llamacpp_completion(answer: Any, cfg: SamplingConfig, *, where: str = "request",
                              vocab_size: int | None = None) -> ServerCompletion:
    """Parse a llama-server ``/completion`` answer (``return_tokens``; ``n_probs`` = max(K, 1)).

    ``completion_probabilities`` holds ``{id, logprob, top_logprobs: [{id, logprob}, …]}`` (raw softmax) or, with
    ``post_sampling_probs``, ``{id, prob, top_probs: [{id, prob}, …]}`` per sampled token — except tokens whose text
    ends inside a UTF-8 character, which llama-server skips: their positions come back in
    ``ServerCompletion.missing`` (log-prob NaN until :meth:`LlamaCppProtocol.fill_missing` computes them). When
    an entry holds the whole support (fewer entries than ``n_probs``, or ``n_probs`` ≥ ``vocab_size``), μ is
    renormalised over it (module docstring).

    >>> a = {"content": "", "tokens": [7], "completion_probabilities": [{"id": 7, "prob": 0.6,
    ...      "top_probs": [{"id": 7, "prob": 0.6}, {"id": 3, "prob": 0.4}]}]}
    >>> c = parse_llamacpp_completion(a, SamplingConfig(temperature=0.5, top_k=2, logprobs_topk=4))
    >>> c.ids, [round(v, 4) for v in c.logp], c.top_ids   # 2 < 4 entries: the whole support, sums to 1
    ([7], [-0.5108], [[7, 3]])
    """
    w = f"{where}: answer"
    tokens = [check_token(t, f"{w}.tokens[{j}]", vocab_size) for j, t in enumerate(get_field(answer, "tokens", w, list))]
    steps = get_field(answer, "completion_probabilities", w, list)
    entry_ids = [check_token(get_field(s, "id", f"{w}.completion_probabilities[{m}]"),
                             f"{w}.completion_probabilities[{m}].id", vocab_size) for m, s in enumerate(steps)]
    owner = _align(tokens, entry_ids, w)
    n_probs = max(cfg.logprobs_topk, 1)
    logp: list[float] = []
    top_ids: list[list[int]] = []
    top_logp: list[list[float]] = []
    missing: list[int] = []
    for j, (tok, m) in enumerate(zip(tokens, owner)):
        if m is None:
            missing.append(j)
            logp.append(math.nan)
            top_ids.append([])
            top_logp.append([])
            continue
        wj, step = f"{w}.completion_probabilities[{m}]", steps[m]
        post = "prob" in step
        value = _prob_to_logp(get_field(step, "prob", wj), f"{wj}.prob") if post else _logp(get_field(step, "logprob", wj),
                                                                                       f"{wj}.logprob")
        key, vkey = ("top_probs", "prob") if post else ("top_logprobs", "logprob")
        pairs = []
        for i, e in enumerate(get_field(step, key, wj, list)):
            we = f"{wj}.{key}[{i}]"
            eid = check_token(get_field(e, "id", we), f"{we}.id", vocab_size)
            ev = get_field(e, vkey, we)
            pairs.append((eid, _prob_to_logp(ev, f"{we}.{vkey}") if post else _logp(ev, f"{we}.{vkey}")))
        value, pairs = _normalise(value, pairs, n_probs, vocab_size)
        if not value > -math.inf:
            raise ServerError(f"{wj}: the sampled token {tok} has probability 0 under the reported distribution")
        logp.append(value)
        top_ids.append([i for i, _ in pairs[: cfg.logprobs_topk]])
        top_logp.append([v for _, v in pairs[: cfg.logprobs_topk]])
    text = answer.get("content") if isinstance(answer.get("content"), str) else ""
    k = cfg.logprobs_topk > 0
    return ServerCompletion(tokens, logp, top_ids if k else None, top_logp if k else None, text, missing=missing)


def _normalise(value: float, pairs: list[tuple[int, float]], n_probs: int,
               vocab_size: int | None) -> tuple[float, list[tuple[int, float]]]:
    """Sort the entries (most likely first) and, when they are the whole support, renormalise them and ``value``."""
    pairs = sorted(pairs, key=lambda p: -p[1])
    if pairs and (len(pairs) < n_probs or (vocab_size is not None and len(pairs) >= vocab_size)):
        norm = torch.logsumexp(torch.tensor([v for _, v in pairs], dtype=torch.float64), 0).item()
        return value - norm, [(i, v - norm) for i, v in pairs]
    return value, pairs


def _import_xllamacpp():
    try:
        import xllamacpp
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(LLAMACPP_MISSING) from err
    return xllamacpp


class LlamaCppServer:
    """``llama-server`` on a GGUF file, in this process (xllamacpp), bound to 127.0.0.1 on a free port.

    Args:
        gguf_path: the model file.
        threads: CPU threads for decoding and prompt processing (default: torch's intra-op thread count).
        kv_cache_type: one of :data:`KV_CACHE_TYPES` for keys and values (flash attention is on for the quantised
            types, which need it, and off otherwise).
        n_ctx: context size (0: the model's training context).
        startup_timeout: seconds to wait for ``/health``.
    """

    def __init__(self, gguf_path: str | os.PathLike, *, threads: int | None = None, kv_cache_type: str = "f16",
                 n_ctx: int = 0, startup_timeout: float = 60.0) -> None:
        if kv_cache_type not in KV_CACHE_TYPES:
            raise ValueError(f"kv_cache_type must be one of {', '.join(KV_CACHE_TYPES)}, got {kv_cache_type!r}")
        threads = torch.get_num_threads() if threads is None else threads
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int ≥ 1, got {threads!r}")
        self.threads, self.kv_cache_type, self.n_ctx = threads, kv_cache_type, int(n_ctx)
        self.startup_timeout = float(startup_timeout)
        self._server = None
        self.url = ""
        self.start(gguf_path)

    def start(self, gguf_path: str | os.PathLike) -> None:
        xl = _import_xllamacpp()
        path = Path(gguf_path)
        if not path.is_file():
            raise ValueError(f"gguf_path {str(path)!r} is not a file")
        params = xl.CommonParams()
        params.model.path = str(path)
        params.n_parallel = 1  # one slot: requests run one after another, reproducibly
        params.n_ctx = self.n_ctx
        params.cpuparams.n_threads = self.threads
        params.cpuparams_batch.n_threads = self.threads
        params.cache_prompt = False
        params.warmup = False
        params.verbosity = -1
        kv = getattr(xl.ggml_type, f"GGML_TYPE_{self.kv_cache_type.upper()}")
        params.cache_type_k = kv
        params.cache_type_v = kv
        # Flash attention is required for a quantised V cache; otherwise it stays off: on CPU it rounds K/V through
        # F16 even with an F32 cache (measured: 1.6e-4 vs 1e-6 nats max |Δ log μ| against transformers fp32).
        fa = "ENABLED" if self.kv_cache_type in ("q8_0", "q4_0") else "DISABLED"
        params.flash_attn_type = getattr(xl.llama_flash_attn_type, f"LLAMA_FLASH_ATTN_TYPE_{fa}")
        params.hostnames = ["127.0.0.1"]
        port = free_port()
        params.port = port
        self._server = xl.Server(params)
        self.url = f"http://127.0.0.1:{port}"
        self.path = path
        try:
            wait_until_healthy(self.url + "/health", timeout=self.startup_timeout,
                               what=f"llama.cpp /health of the server on {path.name}",
                               healthy=lambda raw: json.loads(raw).get("status") == "ok")
        except ServerError:
            self.close()
            raise

    def restart(self, gguf_path: str | os.PathLike) -> None:
        """Stop the server and start it again on ``gguf_path`` (new port)."""
        self.close()
        self.start(gguf_path)

    def close(self) -> None:
        """Stop the server (xllamacpp has no stop(): dropping the object joins its threads)."""
        self._server = None


class LlamaCppRolloutEngine(ServerRolloutEngine):
    """The engine interface on llama.cpp: the trainer's model as GGUF in an in-process ``llama-server``.

    Args:
        model: a transformers Qwen2 / Llama causal LM (see :func:`~offpolicy.models.gguf.export_gguf`); copied to
            GGUF now and on every ``sync_weights``.
        tokenizer: its byte-level BPE tokenizer (written into the GGUF; decodes ``texts``).
        weights: GGUF weight type, one of ``f32``, ``f16``, ``bf16``, ``q8_0``, ``q4_0``.
        kv_cache_type: one of :data:`KV_CACHE_TYPES`; default ``f32`` for F32 weights (the numerics floor),
            else llama.cpp's default ``f16``.
        threads: CPU threads (default torch's); ``n_ctx``: context (0: the model's); ``timeout``: seconds per
            request; ``workdir``: where GGUF files go (default a temporary directory, removed by :meth:`close`).

    ``sync_log`` holds ``{"export_s", "restart_s"}`` of every weight sync. ``reports_full_distribution``: with
    ``logprobs_topk`` = V the top-k is μ over the whole vocabulary (inspect's exact view).

    >>> from offpolicy.models.tiny import build_tiny_model
    >>> model, tok = build_tiny_model()
    >>> engine = LlamaCppRolloutEngine(model, tok, threads=1)
    >>> out = engine.generate([tok("1+2=")["input_ids"]], SamplingConfig(max_new_tokens=3), seed=0)
    >>> out.logp.shape, bool((out.logp[out.mask] <= 0).all())
    (torch.Size([1, 3]), True)
    >>> engine.close()
    """

    reports_full_distribution = True

    def __init__(self, model: torch.nn.Module, tokenizer, *, weights: str = "f32", kv_cache_type: str | None = None,
                 threads: int | None = None, n_ctx: int = 0, timeout: float = 120.0,
                 workdir: str | os.PathLike | None = None) -> None:
        from offpolicy.models.gguf import _check_weights

        self.weights = _check_weights("weights", weights)
        kv = kv_cache_type or ("f32" if self.weights == "f32" else "f16")
        if kv not in KV_CACHE_TYPES:
            raise ValueError(f"kv_cache_type must be one of {', '.join(KV_CACHE_TYPES)}, got {kv_cache_type!r}")
        self.kv_cache_type = kv
        self.tokenizer_for_export = tokenizer
        self._own_workdir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="offpolicy-gguf-")) if workdir is None else Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.sync_log: list[dict[str, float]] = []
        self._version = 0
        self.server: LlamaCppServer | None = None
        config: Any = model.config  # a transformers PretrainedConfig (untyped attributes)
        vocab = int(config.vocab_size)
        path = self._export(model)
        self.server = LlamaCppServer(path, threads=threads, kv_cache_type=kv, n_ctx=n_ctx)
        super().__init__(self.server.url, LlamaCppProtocol(vocab), vocab_size=vocab, timeout=timeout,
                         tokenizer=tokenizer)

    @property
    def description(self) -> str:
        return f"llama.cpp {self.weights.upper()} weights, {self.kv_cache_type} KV cache"

    def _export(self, model: torch.nn.Module) -> Path:
        from offpolicy.models.gguf import export_gguf

        self._version += 1
        return export_gguf(model, self.tokenizer_for_export, self.workdir / f"weights-{self._version}.gguf",
                           weights=self.weights)

    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Write ``model`` as GGUF and restart the server on it; the two costs go to ``sync_log``."""
        if self.server is None:
            raise ValueError("sync_weights: the engine is closed")
        old = self.server.path
        t0 = time.perf_counter()
        path = self._export(model)
        t1 = time.perf_counter()
        self.server.restart(path)
        self.url = self.server.url
        self.sync_log.append({"export_s": t1 - t0, "restart_s": time.perf_counter() - t1})
        if old != path:
            old.unlink(missing_ok=True)

    def close(self) -> None:
        """Stop the server and remove the GGUF files this engine wrote."""
        if self.server is not None:
            self.server.close()
            self.server = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __del__(self) -> None:  # pragma: no cover - interpreter-dependent timing
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - a finaliser must not raise
            pass


def connect_llamacpp(url: str, *, vocab_size: int | None = None, timeout: float = 120.0,
                     tokenizer=None) -> ServerRolloutEngine:
    """The engine interface on a llama-server that is already running at ``url`` (started with one slot and
    ``--no-cache-prompt`` for reproducible answers). ``vocab_size``: the trainer's; ids outside are refused."""
    return ServerRolloutEngine(url, LlamaCppProtocol(vocab_size), vocab_size=vocab_size, timeout=timeout,
                               tokenizer=tokenizer)


@register_engine("llamacpp", fields=("weights", "kv_cache_bits", "kv_cache_type", "threads"))
def build_llamacpp_engine(spec: EngineSpec, *, model: Any = None, tokenizer: Any = None,
                      model_path: str | None = None) -> LlamaCppRolloutEngine:
    """The factory's builder for ``backend="llamacpp"``: llama.cpp's server in this process on a GGUF export of
    ``model`` (``spec.weights``, default f32) with the KV cache type ``spec.kv_cache_type`` or the one
    ``spec.kv_cache_bits`` names (32 f32, 16 f16, 8 q8_0, 4 q4_0). ``ImportError`` without xllamacpp / gguf."""
    if model is None:
        raise ValueError("backend=llamacpp exports a transformers model to GGUF: pass model=")
    if tokenizer is None:
        raise ValueError("backend=llamacpp needs the model's tokenizer (it is written into the GGUF)")
    kv = spec.kv_cache_type or (LLAMACPP_KV.get(spec.kv_cache_bits) if spec.kv_cache_bits is not None else None)
    return LlamaCppRolloutEngine(model, tokenizer, weights=spec.weights or "f32", kv_cache_type=kv,
                                 threads=spec.threads)
