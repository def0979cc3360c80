"""Engine specs: how the rollout side samples and how the trainer side scores, as data.

An :class:`EngineSpec` says which numerics one side uses; :func:`build_engine` turns it into an
:class:`~offpolicy.rollout.hf.HFRolloutEngine` on a private copy of the model. The rollout side samples with it
(generation path: KV cache or not, its own dtype and quantisation); the trainer side scores the sampled tokens with one
full forward, as every trainer does, optionally under autocast over the float32 weights (mixed precision).

A spec is written on the command line as a built-in name, ``key=value`` pairs, or both, comma-separated
(:func:`parse_spec`)::

    bf16                                   bf16 weights and activations, KV cache
    bf16,weight_bits=4,quantize_layers=2   the same, int4 weights in decoder layer 2 only
    dtype=fp32,kv_cache_bits=8             fp32 engine with an int8 KV cache
    backend=hf,quant=w4a4                  bf16 engine, NVFP4 weights and activations in every decoder Linear
    fp32,autocast=bf16                     (trainer) fp32 weights, bf16 autocast

``quantize_layers`` takes indices joined by ``+`` (``2+3``). Built-ins: :data:`ROLLOUT_SPECS`, :data:`TRAINER_SPECS`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch

DTYPE_ALIASES = {
    "fp32": "float32", "float32": "float32", "f32": "float32",
    "bf16": "bfloat16", "bfloat16": "bfloat16",
    "fp16": "float16", "float16": "float16", "half": "float16", "f16": "float16",
}  # fmt: skip
BACKENDS = ("hf", "vllm", "llamacpp", "server")
SERVER_PROTOCOLS = ("vllm", "sglang", "llamacpp")  # offpolicy.rollout.servers.SERVER_PROTOCOLS
GGUF_WEIGHTS = ("f32", "f16", "bf16", "q8_0", "q4_0")  # offpolicy.models.gguf.GGUF_WEIGHTS (no gguf import here)
LLAMACPP_KV = {32: "f32", 16: "f16", 8: "q8_0", 4: "q4_0"}  # kv_cache_bits → llama.cpp's KV cache type


@dataclass(frozen=True)
class EngineSpec:
    """The numerics of one side of the comparison (validated on construction; ``ValueError`` names the field).

    * ``dtype``: parameter dtype of the engine's copy ("float32", "bfloat16", "float16").
    * ``autocast``: trainer only — compute dtype of an autocast forward over ``dtype`` weights (mixed precision).
    * ``kv_cache``: rollout only — generate with a KV cache (True) or a full forward per step.
    * ``kv_cache_bits`` / ``weight_bits``: simulated int-N KV cache / weights (rollout; weights also on the trainer side,
      for bisecting), restricted to the decoder layers in ``quantize_layers`` when given.
    * ``quant``: transformers engine only — a serving format of the decoder's Linear weights and inputs (``fp8``,
      ``fp8-dynamic``, ``fp8-block``, ``mxfp8``, ``nvfp4`` = ``w4a4``, ``nvfp4a16`` = ``w4a16``:
      :data:`~offpolicy.rollout.quant_formats.QUANT_FORMATS`), restricted to ``quantize_layers`` when given; aliases
      are stored by the format's name.
    * ``lm_head_fp32``: float32 output projection (TRL ``cast_lm_head_to_fp32``, SGLang/prime-rl ``enable_fp32_lm_head``).
    * ``logit_noise``: rollout only — additive Gaussian noise on the logits (σ).
    * ``attn_implementation``: attention kernel ("eager" reproduces generation in a full forward; "sdpa" does not).
    * ``backend``: "hf" (any transformers causal LM, full logits), "vllm" (vLLM in this process, GPU or its CPU
      build: the full distribution with ``max_logprobs=-1``, top-k log-probs otherwise), "llamacpp" (llama.cpp's
      server on a GGUF export of the model: real kernels, the full distribution since K = V) or "server" (a vLLM,
      SGLang or llama.cpp server already running at ``server``: the full distribution where it returns K = V).
    * ``weights``: llamacpp only — the GGUF weight type (f32, f16, bf16, q8_0, q4_0; default f32); its
      ``kv_cache_bits`` are llama.cpp's KV cache types (32 f32, 16 f16, 8 q8_0, 4 q4_0; default f32 for F32
      weights, else f16).
    * ``server``: the URL of a running server (sets ``backend="server"``); ``protocol``: "vllm", "sglang" or
      "llamacpp" (None: detected from the server's answers).
    * ``kv_cache_dtype``: vllm only — vLLM's ``kv_cache_dtype`` ("auto", "fp8", …).

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

    def __post_init__(self) -> None:
        if self.server is not None and self.backend == "hf":
            object.__setattr__(self, "backend", "server")
        object.__setattr__(self, "dtype", _dtype_name("dtype", self.dtype))
        if self.autocast is not None:
            object.__setattr__(self, "autocast", _dtype_name("autocast", self.autocast))
            if self.autocast == "float32" or self.dtype != "float32":
                raise ValueError(f"autocast={self.autocast!r} needs dtype=float32 weights and a 16-bit compute dtype")
        for name in ("kv_cache_bits", "weight_bits"):
            if name == "kv_cache_bits" and self.backend == "llamacpp":
                continue  # llama.cpp's KV cache types, checked in _check_llamacpp
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 2 <= v <= 16):
                raise ValueError(f"{name} must be None or an int in [2, 16], got {v!r}")
        if self.quant is not None:
            from offpolicy.rollout.quant_formats import quant_format

            object.__setattr__(self, "quant", quant_format(self.quant).name)
            if self.backend != "hf":
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
        if not (isinstance(self.logit_noise, (int, float)) and 0 <= self.logit_noise < float("inf")):
            raise ValueError(f"logit_noise must be a finite float ≥ 0, got {self.logit_noise!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend in ("llamacpp", "server"):
            _check_llamacpp(self)
        elif self.weights is not None or self.server is not None:
            raise ValueError("weights / server are llama.cpp settings: add backend=llamacpp (or give server=URL)")
        if self.protocol is not None and (self.backend != "server" or self.protocol not in SERVER_PROTOCOLS):
            raise ValueError(f"protocol must be one of {', '.join(SERVER_PROTOCOLS)} with server=URL, got "
                             f"{self.protocol!r}")
        if self.kv_cache_dtype is not None and self.backend != "vllm":
            raise ValueError("kv_cache_dtype is vLLM's setting: add backend=vllm (kv_cache_bits simulates one)")

    def describe(self) -> str:
        """A short human description, e.g. ``bfloat16 + KV cache + int8 weights``."""
        if self.backend == "llamacpp":
            kv = LLAMACPP_KV.get(self.kv_cache_bits or 0, "f32" if (self.weights or "f32") == "f32" else "f16")
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

# The rollout engines the README's mismatch table measures. Each is what a production setting does, on the HF engine.
ROLLOUT_SPECS: dict[str, EngineSpec] = {
    s.name: s
    for s in (
        EngineSpec("fp32", dtype="float32"),
        EngineSpec("bf16", dtype="bfloat16"),
        EngineSpec("fp16", dtype="float16"),
        EngineSpec("fp32-head", dtype="bfloat16", lm_head_fp32=True),
        EngineSpec("int8", dtype="bfloat16", weight_bits=8),
        EngineSpec("int4", dtype="bfloat16", weight_bits=4),
        EngineSpec("kv8", dtype="bfloat16", kv_cache_bits=8),
        EngineSpec("kv4", dtype="bfloat16", kv_cache_bits=4),
        EngineSpec("w8kv8", dtype="bfloat16", weight_bits=8, kv_cache_bits=8),
        EngineSpec("noise", dtype="bfloat16", logit_noise=0.1),
        EngineSpec("fp8", dtype="bfloat16", quant="fp8"),
        EngineSpec("fp8-dynamic", dtype="bfloat16", quant="fp8-dynamic"),
        EngineSpec("fp8-block", dtype="bfloat16", quant="fp8-block"),
        EngineSpec("mxfp8", dtype="bfloat16", quant="mxfp8"),
        EngineSpec("w4a4", dtype="bfloat16", quant="nvfp4"),
        EngineSpec("w4a16", dtype="bfloat16", quant="nvfp4a16"),
    )
}

# Trainer sides: a plain fp32 forward, or mixed precision (autocast over fp32 weights) as FSDP / Megatron train;
# the model's own attention kernel (attn_implementation=None), as the trainer would run it.
TRAINER_SPECS: dict[str, EngineSpec] = {
    s.name: s
    for s in (
        EngineSpec("fp32", dtype="float32", kv_cache=False, attn_implementation=None),
        EngineSpec("bf16-autocast", dtype="float32", autocast="bfloat16", kv_cache=False, attn_implementation=None),
        EngineSpec("fp16-autocast", dtype="float32", autocast="float16", kv_cache=False, attn_implementation=None),
        EngineSpec("bf16", dtype="bfloat16", kv_cache=False, attn_implementation=None),
        EngineSpec("fp16", dtype="float16", kv_cache=False, attn_implementation=None),
    )
}

_BOOL = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
_FIELDS = {f.name for f in fields(EngineSpec)} - {"name"}
# "noise" is what the trainer config calls it; the rest are spelled like the engine's arguments.
_KEY_ALIASES = {"noise": "logit_noise", "kv_bits": "kv_cache_bits", "layers": "quantize_layers",
                "fp32_lm_head": "lm_head_fp32", "cast_lm_head_to_fp32": "lm_head_fp32",
                "enable_fp32_lm_head": "lm_head_fp32", "attn": "attn_implementation", "quantization": "quant"}


def parse_spec(text: str, side: str) -> EngineSpec:
    """An :class:`EngineSpec` from ``"name"``, ``"key=value,..."`` or ``"name,key=value,..."`` (see module docstring).

    ``side`` is "rollout" or "trainer": which built-ins a name refers to, and which fields that side accepts
    (:func:`check_side`).

    >>> parse_spec("bf16,weight_bits=4,quantize_layers=2+3", "rollout").describe()
    'bfloat16 + KV cache + int4 weights (layers 2+3)'
    >>> parse_spec("fp32,autocast=bf16", "trainer").describe()
    'float32 weights, bfloat16 autocast'
    >>> parse_spec("bf16,colour=red", "rollout")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: --rollout: unknown key 'colour' in 'bf16,colour=red'; keys: attn_implementation, autocast, ...
    """
    if side not in ("rollout", "trainer"):
        raise ValueError(f"side must be 'rollout' or 'trainer', got {side!r}")
    builtins = ROLLOUT_SPECS if side == "rollout" else TRAINER_SPECS
    option = f"--{side}"
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise ValueError(f"{option}: empty engine spec; use one of {sorted(builtins)} or key=value pairs")
    base = builtins["bf16" if side == "rollout" else "fp32"]
    name = "custom"
    if "=" not in parts[0]:
        if parts[0] not in builtins:
            raise ValueError(f"{option}: unknown engine {parts[0]!r}; built-ins: {', '.join(sorted(builtins))}")
        base, name, parts = builtins[parts[0]], parts[0], parts[1:]
    changes: dict[str, Any] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        key = _KEY_ALIASES.get(key.strip(), key.strip())
        if not sep or key not in _FIELDS:
            raise ValueError(f"{option}: unknown key {key!r} in {text!r}; keys: {', '.join(sorted(_FIELDS))}")
        changes[key] = _parse_value(option, key, value.strip())
    try:  # a built-in keeps its name; anything changed is named by the spec as written
        spec = replace(base, name=name if not changes else ",".join(p.strip() for p in str(text).split(",")), **changes)
    except ValueError as err:
        raise ValueError(f"{option}: {err}") from None
    check_side(spec, side)
    return spec


def _parse_value(option: str, key: str, value: str) -> Any:
    try:
        if key in ("kv_cache", "lm_head_fp32"):
            if value.lower() not in _BOOL:
                raise ValueError
            return _BOOL[value.lower()]
        if key in ("kv_cache_bits", "weight_bits"):
            return None if value.lower() in ("none", "") else int(value)
        if key == "quantize_layers":
            return None if value.lower() in ("none", "all", "") else tuple(int(v) for v in value.split("+"))
        if key == "logit_noise":
            return float(value)
        if key in ("autocast", "attn_implementation", "quant"):
            return None if value.lower() in ("none", "") else value
        return value
    except ValueError:
        raise ValueError(f"{option}: {key}={value!r} is not a valid value") from None


def check_side(spec: EngineSpec, side: str) -> None:
    """Refuse settings that have no meaning on that side (a trainer has no KV cache and adds no noise; a rollout
    engine does not autocast; only the rollout side may be vLLM)."""
    option = f"--{side}"
    if side == "trainer":
        if spec.kv_cache_bits is not None:
            raise ValueError(f"{option}: kv_cache_bits — a trainer scores with one full forward and keeps no KV cache")
        if spec.logit_noise:
            raise ValueError(f"{option}: logit_noise — noise on the trainer side would make π itself random")
        if spec.backend != "hf":
            raise ValueError(f"{option}: backend={spec.backend!r} — the trainer side is a transformers forward")
        if spec.kv_cache:
            raise ValueError(f"{option}: kv_cache=true — a trainer scores with one full forward (kv_cache=false)")
    elif spec.autocast is not None:
        raise ValueError(f"{option}: autocast — a rollout engine runs in its parameter dtype; set dtype instead")


def build_engine(model: torch.nn.Module, spec: EngineSpec, tokenizer=None):  # -> HFRolloutEngine
    """An :class:`~offpolicy.rollout.hf.HFRolloutEngine` with ``spec``'s numerics on a private copy of ``model``.

    ``autocast`` is not the engine's business: the trainer side passes it to the scoring forward.
    """
    from offpolicy.rollout.hf import HFRolloutEngine

    if spec.backend != "hf":
        raise ValueError(f"build_engine builds the transformers engine; backend={spec.backend!r} is built by "
                         "offpolicy.inspect.compare")
    return HFRolloutEngine(
        model, dtype=spec.dtype, kv_cache=spec.kv_cache, kv_cache_bits=spec.kv_cache_bits,
        weight_bits=spec.weight_bits, logit_noise=spec.logit_noise,
        quantize_layers=list(spec.quantize_layers) if spec.quantize_layers is not None else None, quant=spec.quant,
        lm_head_fp32=spec.lm_head_fp32, attn_implementation=spec.attn_implementation, tokenizer=tokenizer,
    )
