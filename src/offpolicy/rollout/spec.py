"""An engine as data: :class:`EngineSpec`, the one description every rollout engine is built from
(:func:`offpolicy.rollout.build_engine`), and its text form (:meth:`EngineSpec.parse`).

The trainer turns its ``rollout.*`` config into a spec (:func:`offpolicy.train.build.engine_spec`);
``offpolicy inspect`` parses ``--rollout`` / ``--trainer`` into one (:func:`offpolicy.inspect.specs.parse_spec`, which adds its built-in names
and side rules). The text form is ``key=value`` pairs, comma-separated, optionally after a built-in name::

    backend=hf,dtype=bfloat16,quant=w4a4      bf16 engine, NVFP4 weights and activations in every decoder Linear
    dtype=fp32,kv_cache_bits=8                fp32 engine with an int8 KV cache
    bf16,weight_bits=4,quantize_layers=2+3    a built-in (inspect's) with int4 weights in decoder layers 2 and 3
    backend=llamacpp,weights=q8_0             llama.cpp's server on a Q8_0 GGUF export of the model
    server=http://127.0.0.1:8000,protocol=vllm   a running vLLM server

``quantize_layers`` takes indices joined by ``+`` (``2+3``). A spec checks its own fields when it is made (a
``ValueError`` naming the field); which fields a backend reads is the backend's registration
(:func:`offpolicy.rollout.register_engine`), checked when the engine is built.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch

from offpolicy.rollout.factory import ENGINE_BUILDERS
from offpolicy.rollout.sampling import SAMPLERS

DTYPE_ALIASES = {
    "fp32": "float32", "float32": "float32", "f32": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16", "f16": "float16",
}  # fmt: skip
BACKENDS = ("hf", "vllm", "llamacpp", "server")  # the built-in backends; more are registered with register_engine
SERVER_PROTOCOLS = ("vllm", "sglang", "llamacpp")  # what offpolicy.rollout.servers.connect_server speaks
GGUF_WEIGHTS = ("f32", "f16", "bf16", "q8_0", "q4_0")  # offpolicy.models.gguf.GGUF_WEIGHTS (no gguf import here)
LLAMACPP_KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")  # offpolicy.rollout.llamacpp.KV_CACHE_TYPES (a test checks)
LLAMACPP_KV = {32: "f32", 16: "f16", 8: "q8_0", 4: "q4_0"}  # kv_cache_bits → llama.cpp's KV cache type


@dataclass(frozen=True)
class EngineSpec:
    """The numerics of one engine (validated on construction; ``ValueError`` names the field).

    * ``backend``: "hf" (any transformers causal LM in this process, full logits), "vllm" (vLLM in this process, GPU
      or its CPU build), "llamacpp" (llama.cpp's server on a GGUF export of the model: real kernels) or "server" (a
      vLLM, SGLang or llama.cpp server already running at ``server``) — or any backend registered with
      :func:`~offpolicy.rollout.register_engine`.
    * ``dtype``: parameter dtype of the engine's copy ("float32", "bfloat16", "float16"; vLLM's ``dtype``).
    * ``autocast``: (inspect's trainer side) compute dtype of an autocast forward over ``dtype`` weights.
    * ``kv_cache``: transformers engine — generate with a KV cache (True) or a full forward per step.
    * ``kv_cache_bits`` / ``weight_bits``: simulated int-N KV cache / weights (transformers engine), restricted to the
      decoder layers in ``quantize_layers`` when given. With backend=llamacpp, ``kv_cache_bits`` picks llama.cpp's KV
      cache type (32 f32, 16 f16, 8 q8_0, 4 q4_0; default f32 for F32 weights, else f16).
    * ``quant``: transformers engine only — a serving format of the decoder's Linear weights and inputs (``fp8``,
      ``fp8-dynamic``, ``fp8-block``, ``mxfp8``, ``nvfp4`` = ``w4a4``, ``nvfp4a16`` = ``w4a16``:
      :data:`~offpolicy.rollout.quant_formats.QUANT_FORMATS`), restricted to ``quantize_layers`` when given; aliases
      are stored by the format's name.
    * ``lm_head_fp32``: float32 output projection (TRL ``cast_lm_head_to_fp32``, SGLang/prime-rl
      ``enable_fp32_lm_head``).
    * ``logit_noise``: additive Gaussian noise on the logits (σ; transformers engine).
    * ``attn_implementation``: attention kernel ("eager" reproduces generation in a full forward; "sdpa" does not).
    * ``sampler``, ``compile``, ``record_routes``: the transformers engine's token draw (inverse_cdf / multinomial),
      ``torch.compile`` of its decoding step, and recording MoE routes for routing replay (also vLLM's).
    * ``weights``, ``kv_cache_type``, ``threads``: llamacpp — the GGUF weight type (f32, f16, bf16, q8_0, q4_0;
      default f32), llama.cpp's KV cache type by name (instead of ``kv_cache_bits``), the server's threads.
    * ``server``: the URL of a running server (sets ``backend="server"``); ``protocol``: "vllm", "sglang" or
      "llamacpp" (None: detected from the server's answers); ``timeout``: seconds per request; ``weights_dir``: the
      folder a weight sync writes for the server to reload (None: a temporary one).
    * ``kv_cache_dtype``, ``max_model_len``, ``max_logprobs``, ``seed``: vllm — vLLM's ``kv_cache_dtype`` ("auto",
      "fp8", …), context length (None: the model's), log-probs per position (−1: the whole vocabulary), seed.

    >>> EngineSpec(dtype="bf16", weight_bits=4, quantize_layers=(2,)).describe()
    'bfloat16 + KV cache + int4 weights (layers 2)'
    """

    name: str = "custom"
    dtype: str = "bfloat16"
    autocast: str | None = None
    kv_cache: bool = True
    kv_cache_bits: int | None = None
    weight_bits: int | None = None
    quantize_layers: tuple[int, ...] | None = None
    lm_head_fp32: bool = False
    logit_noise: float = 0.0
    attn_implementation: str | None = "eager"
    backend: str = "hf"
    weights: str | None = None
    server: str | None = None
    protocol: str | None = None
    kv_cache_dtype: str | None = None
    quant: str | None = None
    sampler: str = "multinomial"
    compile: bool = False
    record_routes: bool = False
    kv_cache_type: str | None = None
    threads: int | None = None
    timeout: float = 120.0
    weights_dir: str | None = None
    max_model_len: int | None = None
    max_logprobs: int = 20
    seed: int = 0

    def __post_init__(self) -> None:
        if self.server is not None and self.backend == "hf":
            object.__setattr__(self, "backend", "server")
        if self.backend not in ENGINE_BUILDERS:
            raise ValueError(f"backend must be one of {', '.join(ENGINE_BUILDERS.names())} (registered engines), got "
                             f"{self.backend!r}")
        object.__setattr__(self, "dtype", _dtype_name("dtype", self.dtype))
        if self.autocast is not None:
            object.__setattr__(self, "autocast", _dtype_name("autocast", self.autocast))
            if self.autocast == "float32" or self.dtype != "float32":
                raise ValueError(f"autocast={self.autocast!r} needs dtype=float32 weights and a 16-bit compute dtype")
        _check_numbers(self)
        if self.quant is not None:
            from offpolicy.rollout.quant_formats import quant_format

            object.__setattr__(self, "quant", quant_format(self.quant).name)
            if self.backend in BACKENDS and self.backend != "hf":
                raise ValueError(f"quant={self.quant!r} is a simulated knob of the transformers engine (backend=hf), "
                                 f"not of backend={self.backend}")
            if self.weight_bits is not None:
                raise ValueError(f"quant={self.quant!r} with weight_bits={self.weight_bits!r}: both quantise the "
                                 "weights; choose one")
        if self.quantize_layers is not None:
            layers = tuple(self.quantize_layers)
            if not layers or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers):
                raise ValueError(f"quantize_layers must be non-empty layer indices ≥ 0, got {self.quantize_layers!r}")
            if self.kv_cache_bits is None and self.weight_bits is None and self.quant is None:
                raise ValueError("quantize_layers needs weight_bits or kv_cache_bits (or quant): there is nothing to "
                                 "restrict")
            object.__setattr__(self, "quantize_layers", layers)
        if self.backend in ("llamacpp", "server"):
            _check_llamacpp(self)
        elif self.backend in BACKENDS and (self.weights is not None or self.server is not None):
            raise ValueError("weights / server are llama.cpp settings: add backend=llamacpp (or give server=URL)")
        if self.protocol is not None and (self.backend != "server" or self.protocol not in SERVER_PROTOCOLS):
            raise ValueError(f"protocol must be one of {', '.join(SERVER_PROTOCOLS)} with server=URL, got "
                             f"{self.protocol!r}")
        if self.kv_cache_dtype is not None and self.backend in BACKENDS and self.backend != "vllm":
            raise ValueError("kv_cache_dtype is vLLM's setting: add backend=vllm (kv_cache_bits simulates one)")
        if self.weights_dir is not None:
            object.__setattr__(self, "weights_dir", str(self.weights_dir))

    @classmethod
    def parse(cls, text: str, *, builtins: Mapping[str, EngineSpec] | None = None,
              base: EngineSpec | None = None) -> EngineSpec:
        """A spec from ``"key=value,..."``, or ``"name,key=value,..."`` where ``name`` is one of ``builtins``
        (see the module docstring); ``base``: what the keys change when no built-in is named (default: the defaults).

        >>> EngineSpec.parse("backend=hf,dtype=bf16,quant=w4a4").describe()
        'bfloat16 + KV cache + NVFP4 W4A4'
        >>> EngineSpec.parse("backend=llamacpp,weights=q8_0,threads=2").describe()
        'llama.cpp Q8_0 weights + f16 KV cache'
        >>> EngineSpec.parse("dtype=bf16,colour=red")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: unknown key 'colour' in 'dtype=bf16,colour=red'; keys: attn_implementation, autocast, ...
        """
        builtins = builtins or {}
        parts = [p.strip() for p in str(text).split(",") if p.strip()]
        if not parts:
            raise ValueError(f"empty engine spec; use one of {sorted(builtins)} or key=value pairs")
        spec, name = base if base is not None else cls(), "custom"
        if "=" not in parts[0]:
            if parts[0] not in builtins:
                raise ValueError(f"unknown engine {parts[0]!r}; built-ins: {', '.join(sorted(builtins)) or 'none'}")
            spec, name, parts = builtins[parts[0]], parts[0], parts[1:]
        changes: dict[str, Any] = {}
        keys = spec_field_names() - {"name"}
        for part in parts:
            key, sep, value = part.partition("=")
            key = KEY_ALIASES.get(key.strip(), key.strip())
            if not sep or key not in keys:
                raise ValueError(f"unknown key {key!r} in {text!r}; keys: {', '.join(sorted(keys))}")
            changes[key] = _parse_value(key, value.strip())
        # a built-in keeps its name; anything changed is named by the spec as written
        return replace(spec, name=name if not changes else ",".join(p.strip() for p in str(text).split(",")),
                       **changes)

    def describe(self) -> str:
        """A short human description, e.g. ``bfloat16 + KV cache + int8 weights``."""
        if self.backend == "llamacpp":
            kv = self.kv_cache_type or LLAMACPP_KV.get(self.kv_cache_bits or 0,
                                                       "f32" if (self.weights or "f32") == "f32" else "f16")
            return f"llama.cpp {(self.weights or 'f32').upper()} weights + {kv} KV cache"
        if self.backend == "server":
            return f"{self.protocol or 'a'} server at {self.server}"
        if self.backend == "vllm":
            kv = f" + {self.kv_cache_dtype} KV cache" if self.kv_cache_dtype not in (None, "auto") else ""
            return f"vLLM {self.dtype}{kv}"
        parts = [self.dtype if self.autocast is None else f"{self.dtype} weights, {self.autocast} autocast"]
        if self.backend != "hf":
            parts.append(self.backend)
        if self.kv_cache and self.autocast is None:
            parts.append("KV cache")
        where = "" if self.quantize_layers is None else f" (layers {'+'.join(map(str, self.quantize_layers))})"
        if self.weight_bits is not None:
            parts.append(f"int{self.weight_bits} weights{where}")
        if self.quant is not None:
            parts.append(f"{QUANT_LABELS[self.quant]}{where}")
        if self.kv_cache_bits is not None:
            parts.append(f"int{self.kv_cache_bits} KV cache{where}")
        if self.lm_head_fp32:
            parts.append("fp32 lm_head")
        if self.logit_noise:
            parts.append(f"logit noise σ={self.logit_noise:g}")
        return " + ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly fields (for report.json)."""
        d = asdict(self)
        d["quantize_layers"] = None if self.quantize_layers is None else list(self.quantize_layers)
        return d


def spec_field_names() -> frozenset[str]:
    """The names of :class:`EngineSpec`'s fields."""
    return frozenset(f.name for f in fields(EngineSpec))


def _check_numbers(spec: EngineSpec) -> None:
    """Bit widths, noise, and the runtime settings (threads, timeout, context, log-probs, seed, flags)."""
    for name in ("kv_cache_bits", "weight_bits"):
        if name == "kv_cache_bits" and spec.backend == "llamacpp":
            continue  # llama.cpp's KV cache types, checked in _check_llamacpp
        v = getattr(spec, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 2 <= v <= 16):
            raise ValueError(f"{name} must be None or an int in [2, 16], got {v!r}")
    if not (isinstance(spec.logit_noise, (int, float)) and 0 <= spec.logit_noise < math.inf):
        raise ValueError(f"logit_noise must be a finite float ≥ 0, got {spec.logit_noise!r}")
    if spec.sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {spec.sampler!r}")
    for name in ("kv_cache", "lm_head_fp32", "compile", "record_routes"):
        if not isinstance(getattr(spec, name), bool):
            raise ValueError(f"{name} must be true or false, got {getattr(spec, name)!r}")
    for name, low in (("threads", 1), ("max_model_len", 1), ("max_logprobs", -1), ("seed", 0)):
        v = getattr(spec, name)
        if (v is not None or name in ("max_logprobs", "seed")) and (
                isinstance(v, bool) or not isinstance(v, int) or v < low):
            raise ValueError(f"{name} must be an int ≥ {low}, got {v!r}")
    if not (isinstance(spec.timeout, (int, float)) and 0 < spec.timeout < math.inf):
        raise ValueError(f"timeout must be a number of seconds > 0, got {spec.timeout!r}")


def _check_llamacpp(spec: EngineSpec) -> None:
    """The fields a llama.cpp engine takes: GGUF weights and a KV cache type; the simulated knobs are refused."""
    name = spec.backend
    if name == "server" and not (isinstance(spec.server, str) and spec.server.startswith(("http://", "https://"))):
        raise ValueError(f"server must be an http:// URL of a running server, got {spec.server!r}")
    if name == "llamacpp" and spec.server is not None:
        raise ValueError("backend=llamacpp starts its own server; give server=URL alone to use a running one")
    if spec.weights is not None and (name == "server" or spec.weights not in GGUF_WEIGHTS):
        raise ValueError(f"weights must be one of {', '.join(GGUF_WEIGHTS)} with backend=llamacpp, got {spec.weights!r}")
    if spec.kv_cache_bits is not None and (name == "server" or spec.kv_cache_bits not in LLAMACPP_KV):
        raise ValueError(f"kv_cache_bits with backend=llamacpp must be one of {sorted(LLAMACPP_KV)} (llama.cpp's "
                         f"f32, f16, q8_0, q4_0 KV cache), got {spec.kv_cache_bits!r}")
    if spec.kv_cache_type is not None and (name == "server" or spec.kv_cache_type not in LLAMACPP_KV_TYPES
                                           or spec.kv_cache_bits is not None):
        raise ValueError(f"kv_cache_type must be one of {', '.join(LLAMACPP_KV_TYPES)} with backend=llamacpp (and "
                         f"without kv_cache_bits), got {spec.kv_cache_type!r}")
    simulated = [n for n in ("weight_bits", "quant", "quantize_layers", "logit_noise", "lm_head_fp32")
                 if getattr(spec, n)]
    if simulated or not spec.kv_cache:
        raise ValueError(f"backend={name}: {', '.join(simulated) or 'kv_cache=false'} is a simulated knob of the "
                         "transformers engine; llama.cpp takes weights= and kv_cache_bits=")


def _dtype_name(field_name: str, value: object) -> str:
    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    if not isinstance(value, str) or value.lower() not in DTYPE_ALIASES:
        raise ValueError(f"{field_name} must be one of fp32, bf16, fp16 (or float32, bfloat16, float16), got {value!r}")
    return DTYPE_ALIASES[value.lower()]


# describe()'s words for each format of offpolicy.rollout.quant_formats.QUANT_FORMATS (a test keeps the keys equal)
QUANT_LABELS = {
    "fp8": "fp8 W8A8 (per-tensor scales)",
    "fp8-dynamic": "fp8 W8A8 (per-channel weights, per-token activations)",
    "fp8-block": "fp8 W8A8 (128x128 weight blocks, 1x128 activation groups)",
    "mxfp8": "MXFP8 W8A8",
    "nvfp4": "NVFP4 W4A4",
    "nvfp4a16": "NVFP4 W4A16",
}

_BOOL = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
# "noise" is what the trainer config calls it; the rest are spelled like the engine's arguments.
KEY_ALIASES = {"noise": "logit_noise", "kv_bits": "kv_cache_bits", "layers": "quantize_layers",
               "fp32_lm_head": "lm_head_fp32", "cast_lm_head_to_fp32": "lm_head_fp32",
               "enable_fp32_lm_head": "lm_head_fp32", "attn": "attn_implementation", "quantization": "quant",
               "url": "server"}
_NONE = ("none", "")


def _parse_value(key: str, value: str) -> Any:
    """The text ``value`` of ``key`` as the field's type (``none`` → None where the field may be unset)."""
    try:
        if key in ("kv_cache", "lm_head_fp32", "compile", "record_routes"):
            if value.lower() not in _BOOL:
                raise ValueError
            return _BOOL[value.lower()]
        if key in ("kv_cache_bits", "weight_bits", "threads", "max_model_len"):
            return None if value.lower() in _NONE else int(value)
        if key in ("max_logprobs", "seed"):
            return int(value)
        if key == "quantize_layers":
            return None if value.lower() in ("none", "all", "") else tuple(int(v) for v in value.split("+"))
        if key in ("logit_noise", "timeout"):
            return float(value)
        if key in ("autocast", "attn_implementation", "quant", "kv_cache_type", "weights_dir"):
            return None if value.lower() in _NONE else value
        return value
    except ValueError:
        raise ValueError(f"{key}={value!r} is not a valid value") from None
