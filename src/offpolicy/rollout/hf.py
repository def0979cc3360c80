"""CPU-friendly rollout engine on plain transformers with a *real* training–inference mismatch.

The engine keeps its own copy of the policy in a lower precision (bf16 by default) and generates with its own
left-padded, KV-cached sampling loop. The log-prob it reports for each sampled token is computed from *its* logits
(bf16 matmuls, cast to float32 afterwards) — exactly how vLLM/SGLang report μ — while the trainer scores the same
tokens with an fp32 full forward. Optional knobs add the other mismatch sources seen in production:

* ``kv_cache_bits``: keys/values are fake-quantised (symmetric, per token and head, over head_dim) as they are
  written to the cache — a :class:`~transformers.DynamicCache` subclass, so attention reads the quantised values,
  as with vLLM's int8/fp8 KV cache.
* ``weight_bits``: int-N per-output-channel symmetric fake-quantisation of the decoder's Linear weights (lm_head
  and embeddings stay in ``dtype``, as in W8A16 serving), re-applied on every ``sync_weights``.
* ``quant``: a serving engine's low-precision Linear layers (:data:`~offpolicy.rollout.quant_formats.QUANT_FORMATS`:
  ``fp8``, ``fp8-dynamic``, ``fp8-block``, ``mxfp8``, ``nvfp4`` (W4A4), ``nvfp4a16`` (W4A16)): each decoder Linear's
  weight is quantised into the format and back on every ``sync_weights`` and its input on every forward (a forward
  pre-hook), round to nearest even, then the matmul runs in ``dtype`` on the dequantised values — what an fp8 / FP4
  kernel computes up to its accumulation order and the one rounding of scale × value to ``dtype``. lm_head and the
  embeddings stay in ``dtype`` (as vLLM serves these checkpoints); attention's own products are not quantised.
  ``fp8`` (per-tensor) takes one activation scale per forward over the tensor the layer sees, so μ depends on the
  batch and on prefill vs decoding (as vLLM's dynamic per-tensor fp8 does) and :meth:`HFRolloutEngine.score` does
  not reproduce it; the other formats scale per token or per block of a token.
* ``quantize_layers``: restrict ``weight_bits``, ``quant`` and ``kv_cache_bits`` to these decoder layers (indices into
  the decoder stack, e.g. ``[3]``), so a mismatch can be bisected layer by layer.
* ``lm_head_fp32``: the output projection runs in float32 on float32 weights, with the final hidden state cast up
  first — TRL's ``cast_lm_head_to_fp32`` (GRPOConfig), SGLang's ``enable_fp32_lm_head`` as prime-rl's inference
  config sets it. A tied embedding keeps its engine-dtype copy for the input side.
* ``logit_noise``: additive seeded Gaussian noise on the logits (a stand-in for non-deterministic kernels). μ then
  includes the noise, so :meth:`HFRolloutEngine.score` cannot reproduce it.
* ``attn_implementation``: the engine's attention kernel, "eager" by default. With "sdpa" in bf16 on CPU, KV-cache
  decoding (query length 1) and a full forward take different kernels: measured up to ~0.1 nats between a token's
  log-prob while generating and the same token re-scored in one forward by the same bf16 model (0 with "eager";
  ~1e-6 in fp32 either way). That is a real KV-cache mismatch source, opt-in so that by default
  :meth:`HFRolloutEngine.score` reproduces μ exactly.
* ``record_routes`` (mixture-of-experts models): the experts each router picked for every prompt and completion
  position are returned in ``RolloutOutput.routed_experts``, for the trainer to replay (R3, see
  :mod:`offpolicy.rollout.routing`).
"""

from __future__ import annotations

import contextlib
import copy
import shutil
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from offpolicy.rollout.base import RolloutOutput, check_prompt_ids, pad_ids
from offpolicy.rollout.decode import DecodeStep, cache_keyword
from offpolicy.rollout.factory import register_engine
from offpolicy.rollout.quant_formats import QuantFormat, quant_format
from offpolicy.rollout.routing import RouteRecorder, find_routers, split_routes
from offpolicy.rollout.sampling import (
    SAMPLERS,
    SamplingConfig,
    TokenHistory,
    process_logits,
    sample_tokens,
    topk_logprobs,
)
from offpolicy.rollout.scoring import score_tokens
from offpolicy.rollout.spec import EngineSpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")


def _check_bits(name: str, bits: int | None) -> None:
    if bits is not None and (isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 16):
        raise ValueError(f"{name} must be None or an int in [2, 16], got {bits!r}")


def fake_quantize(x: Tensor, bits: int, dim: int = -1) -> Tensor:
    """Symmetric round-to-nearest int-``bits`` quantise → dequantise, one scale per slice along ``dim``.

    scale = max|x| / (2^(bits−1) − 1) over ``dim``; computed in float32, returned in ``x.dtype``.

    >>> fake_quantize(torch.tensor([[1.0, 0.26, -0.5]]), bits=3)  # scale 1/3: 0.26 → 1/3, -0.5 → -2/3 (half away)
    tensor([[ 1.0000,  0.3333, -0.6667]])
    """
    qmax = 2 ** (bits - 1) - 1
    xf = x.float()
    scale = xf.abs().amax(dim=dim, keepdim=True).clamp(min=1e-12) / qmax
    # torch.round is half-to-even; quantisers round half away from zero.
    q = torch.sign(xf) * torch.floor(xf.abs() / scale + 0.5)
    return (q.clamp(-qmax, qmax) * scale).to(x.dtype)


class FakeQuantKV:
    """In front of transformers' ``DynamicCache`` (:func:`_quantized_cache_class`): a cache that stores
    fake-quantised keys/values (per token & head, over head_dim). Plain, so this module imports no transformers."""

    def __init__(self, *args, bits: int = 8, quantized_layers: frozenset[int] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.bits = bits
        self.quantized_layers = quantized_layers  # None: every layer

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.quantized_layers is None or layer_idx in self.quantized_layers:
            key_states = fake_quantize(key_states, self.bits)
            value_states = fake_quantize(value_states, self.bits)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def _quantized_cache_class():
    from transformers import DynamicCache

    return type("FakeQuantKVCache", (FakeQuantKV, DynamicCache), {"__module__": __name__})


def _compiled(step: DecodeStep | None):
    """``torch.compile`` of the decoding step (weights are graph inputs: :meth:`HFRolloutEngine.sync_weights`'s
    in-place copies reach it)."""
    if step is None:
        raise ValueError("compile=True needs the fast decoding path (fast_decode=True, eager attention, a Llama / "
                         "Qwen2 / Qwen3 model under transformers >= 5: offpolicy.rollout.decode)")
    device = step.lm_head.weight.device
    if device.type == "cpu" and not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        raise ValueError("compile=True on CPU needs a C++ compiler on PATH (torch.compile's CPU backend builds C++)")
    return torch.compile(step.__call__, dynamic=True)


class HFRolloutEngine:
    """Sampling engine on a private low-precision copy of a transformers causal LM.

    Args:
        model: the trainer's model (any HF causal LM); copied, never modified.
        dtype: engine precision, "bfloat16" (default), "float16" or "float32". Parameters are cast; buffers
            (rotary inv_freq) stay float32 as when a real checkpoint is loaded in bf16.
        kv_cache: generate incrementally with a KV cache (True) or with a full forward per step (False).
        kv_cache_bits / weight_bits / logit_noise: extra mismatch sources, see the module docstring.
        quant: a serving format of the decoder's Linear layers (weights and inputs; see the module docstring), by
            name or alias (``w4a4`` = ``nvfp4``, ``w4a16`` = ``nvfp4a16``); None: none. Not with ``weight_bits``.
        quantize_layers: decoder-layer indices that ``weight_bits`` / ``quant`` / ``kv_cache_bits`` apply to (None:
            all).
        lm_head_fp32: float32 output projection (TRL's ``cast_lm_head_to_fp32``), see the module docstring.
        attn_implementation: attention kernel of the engine's copy ("eager", "sdpa"; None keeps the model's).
        record_routes: return each token's routed experts (MoE models only; ``ValueError`` otherwise).
        fast_decode: run the KV-cached decoding steps through :class:`~offpolicy.rollout.decode.DecodeStep` where
            the model allows it (bitwise the same logits, less per-step overhead); False calls ``model(...)`` every
            step — the reference the fast path is tested against.
        sampler: how a token is drawn from the processed distribution, ``multinomial`` (``torch.multinomial``, one
            exponential draw per vocabulary entry; the default here, so that seeded results recorded with this
            class — the lab model's warm start, ``inspect`` — stay as they were) or ``inverse_cdf`` (one uniform per
            row against the float64 running sum; ~18× cheaper on CPU, the trainer's ``rollout.sampler`` default):
            see :func:`~offpolicy.rollout.sampling.sample_tokens`. Both are exact; a seed draws other tokens under
            each.
        compile: run the decoding steps through ``torch.compile`` (dynamic shapes: one compilation for every batch
            size and cache length; ~20 s once per engine on two CPU cores, a C++ compiler needed on CPU). Fused
            kernels round differently from eager ones, so μ is the compiled engine's own — as a serving engine's
            compiled graph is — and :meth:`score` (eager) re-scores it to within the dtype's rounding, not bitwise.
        tokenizer: optional, only used to decode ``texts``. ``eos_token_id`` / ``pad_token_id`` default to the
            tokenizer's, then the model config's.

    >>> from offpolicy.models.tiny import build_tiny_model
    >>> model, tok = build_tiny_model()
    >>> engine = HFRolloutEngine(model, tokenizer=tok)
    >>> out = engine.generate([tok("1+2=")["input_ids"]], SamplingConfig(max_new_tokens=3), seed=0)
    >>> out.logp.shape, out.logp.dtype, bool((out.logp[out.mask] <= 0).all())
    (torch.Size([1, 3]), torch.float32, True)
    """

    def __init__(self, model: torch.nn.Module, *, dtype: str | torch.dtype = "bfloat16", kv_cache: bool = True,
                 kv_cache_bits: int | None = None, weight_bits: int | None = None, logit_noise: float = 0.0,
                 quantize_layers: Sequence[int] | None = None, quant: str | None = None, lm_head_fp32: bool = False,
                 attn_implementation: str | None = "eager", tokenizer=None, eos_token_id: int | None = None,
                 pad_token_id: int | None = None, record_routes: bool = False, fast_decode: bool = True,
                 sampler: str = "multinomial", compile: bool = False) -> None:
        self.dtype = _as_dtype(dtype)
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
        self.sampler = sampler
        _check_bits("kv_cache_bits", kv_cache_bits)
        _check_bits("weight_bits", weight_bits)
        if not (isinstance(logit_noise, (int, float)) and logit_noise >= 0 and logit_noise == logit_noise):
            raise ValueError(f"logit_noise must be a float >= 0, got {logit_noise!r}")
        self.kv_cache = bool(kv_cache)
        self.kv_cache_bits = kv_cache_bits
        self.weight_bits = weight_bits
        self.logit_noise = float(logit_noise)
        if quant is not None and weight_bits is not None:
            raise ValueError(f"quant={quant!r} with weight_bits={weight_bits!r}: both quantise the weights; choose one")
        self.quant_format: QuantFormat | None = None if quant is None else quant_format(quant)
        self.quant = None if self.quant_format is None else self.quant_format.name
        self.quantize_layers = _check_layers(quantize_layers, model, kv_cache_bits, weight_bits, self.quant)
        self.lm_head_fp32 = bool(lm_head_fp32)
        self.tokenizer = tokenizer
        cfg: Any = model.config  # a transformers config (torch types module attributes as Tensor | Module)
        self.eos_token_id = _first_not_none(eos_token_id, getattr(tokenizer, "eos_token_id", None), cfg.eos_token_id)
        if isinstance(self.eos_token_id, (list, tuple)):
            self.eos_token_id = self.eos_token_id[0]
        self.pad_token_id = _first_not_none(
            pad_token_id, getattr(tokenizer, "pad_token_id", None), cfg.pad_token_id, self.eos_token_id, 0
        )
        lm: Any = copy.deepcopy(model).eval().requires_grad_(False)  # a transformers causal LM
        self.model = lm
        if attn_implementation is not None:
            lm.set_attn_implementation(attn_implementation)
        for p in self.model.parameters():
            p.data = p.data.to(self.dtype)
        if self.lm_head_fp32:
            _fp32_output_projection(self.model)
        if self.quant_format is not None and self.quant_format.activation is not None:
            act = self.quant_format.activation
            for module in self._quantized_linears():  # inputs quantised on every forward, generation and score alike
                module.register_forward_pre_hook(lambda module, args, act=act: (act(args[0]), *args[1:]))
        self.record_routes = bool(record_routes)
        if self.record_routes:
            find_routers(self.model)  # a dense model has nothing to record: say so now, not after generating
        self.sync_weights(model)
        self._cache_kw = cache_keyword(type(self.model).forward)  # once: `past_key_values` is deprecated in 5.2x
        self._decode_step = DecodeStep.build(self.model) if fast_decode else None
        if compile:
            if self.record_routes:
                raise ValueError("compile=True with record_routes=True: the route recorder's hooks need eager steps")
            self._decode_step = _compiled(self._decode_step)

    # -- weights ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Copy ``model``'s parameters in (cast to the engine dtype), then re-apply weight quantisation."""
        # remove_duplicate=False: a tied lm_head the engine untied (lm_head_fp32) finds its source under its own name
        src = dict(model.named_parameters(remove_duplicate=False))
        for name, p in self.model.named_parameters():
            if name not in src:
                raise ValueError(f"model has no parameter {name!r}: sync_weights needs the same architecture")
            p.copy_(src[name].detach())
        if self.weight_bits is not None:
            for module in self._quantized_linears():
                module.weight.copy_(fake_quantize(module.weight, self.weight_bits, dim=1))
        if self.quant_format is not None:
            for module in self._quantized_linears():
                module.weight.copy_(self.quant_format.weight(module.weight))

    def _quantized_linears(self) -> list[torch.nn.Linear]:
        """The Linear layers ``weight_bits`` / ``quant`` apply to: the decoder's (in ``quantize_layers`` when given);
        lm_head / embeddings stay in dtype, as weight-quantised serving keeps them."""
        if self.quantize_layers is None:
            scope: torch.nn.Module = self.model
        else:
            from offpolicy.perturbation import find_decoder_layers

            stack = find_decoder_layers(self.model)
            scope = torch.nn.ModuleList([stack[i] for i in sorted(self.quantize_layers)])
        return [module for name, module in scope.named_modules()
                if isinstance(module, torch.nn.Linear) and "lm_head" not in name]

    def _new_cache(self):
        from transformers import DynamicCache

        if self.kv_cache_bits is None:
            return DynamicCache(config=self.model.config)
        return _quantized_cache_class()(config=self.model.config, bits=self.kv_cache_bits,
                                         quantized_layers=self.quantize_layers)

    def _logits(self, ids: Tensor, attn: Tensor, pos: Tensor, cache) -> Tensor:
        out = self.model(
            input_ids=ids,
            attention_mask=attn.long(),
            position_ids=pos,
            use_cache=cache is not None,
            # the last position by index, not logits_to_keep=1: that slice of a multi-token (prefill) forward is
            # non-contiguous, and a matmul on it copies the lm_head weight once per row (measured 60-70 ms vs
            # 10-15 ms for the tiny model's 32-row prefill; the same logits up to the matmul's rounding)
            logits_to_keep=torch.tensor([ids.shape[1] - 1], device=ids.device),
            **{self._cache_kw: cache},
        )
        return out.logits[:, -1].float()  # the engine-dtype lm_head matmul happened; only now float32

    # -- generation ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], cfg: SamplingConfig, *, seed: int) -> RolloutOutput:
        """Sample up to ``cfg.max_new_tokens`` tokens per prompt; deterministic given ``seed``.

        Left-padded batch with positions cumsum(mask) − 1, so each row sees the same positions as alone.
        Rows stop at eos (eos included in ``completion_ids`` and ``mask``). Returned ``logp`` is the processed
        log-prob of each sampled token from the engine's own logits: every processor of ``cfg`` (bad words, logit
        bias, repetition / frequency / presence penalties over the prompt and the tokens sampled so far,
        temperature, top-k/top-p/min-p), reported back as ``RolloutOutput.sampling``.
        """
        if not isinstance(cfg, SamplingConfig):
            raise ValueError(f"cfg must be a SamplingConfig, got {type(cfg).__name__}")
        check_prompt_ids(prompt_ids, self.model.config.vocab_size)
        device = next(self.model.parameters()).device
        gen = torch.Generator(device=device).manual_seed(int(seed))
        noise_gen = torch.Generator(device=device).manual_seed(int(seed) + 7919)  # noise never shifts sampling
        ids, attn = pad_ids([list(p) for p in prompt_ids], self.pad_token_id, side="left")
        ids, attn = ids.to(device), attn.to(device)
        pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
        b = ids.shape[0]
        cache = self._new_cache() if self.kv_cache else None
        step_ids, step_pos = ids, pos
        finished = torch.zeros(b, dtype=torch.bool, device=device)
        toks, logps, valids, tk_v, tk_i = [], [], [], [], []
        history = None  # what the penalties and multi-token bad words see: the prompt, then each sampled token
        recorder = RouteRecorder(self.model, batch_size=b) if self.record_routes else None
        route_blocks: list[Tensor] = []  # [B, new columns, L, k] per step: the routes of the positions forwarded for the first time
        for step in range(cfg.max_new_tokens):
            with recorder if recorder is not None else contextlib.nullcontext():
                if self.kv_cache and self._decode_step is not None and step > 0:  # one new token per row
                    logits = self._decode_step(step_ids, attn, step_pos, cache)
                elif self.kv_cache:
                    logits = self._logits(step_ids, attn, step_pos, cache)
                else:
                    # Full forward every step; a fresh (possibly quantised) cache only replays KV quantisation.
                    fresh = self._new_cache() if self.kv_cache_bits is not None else None
                    logits = self._logits(ids, attn, pos, fresh)
            if recorder is not None:
                forwarded = sum(block.shape[1] for block in route_blocks)
                route_blocks.append(recorder.pop()[:, forwarded - ids.shape[1]:])
            if self.logit_noise > 0:
                logits = logits + self.logit_noise * torch.randn(logits.shape, generator=noise_gen, device=device)
            if cfg.reads_history and history is None:
                history = TokenHistory.start(prompt_ids, logits.shape[-1], cfg, device)
            lp = process_logits(logits, cfg, history)
            nxt = sample_tokens(lp, gen, self.sampler)
            valid = ~finished
            nxt = torch.where(valid, nxt, torch.full_like(nxt, self.pad_token_id))
            if history is not None:
                history.advance(nxt, valid)
            toks.append(nxt)
            logps.append(torch.where(valid, lp.gather(-1, nxt[:, None]).squeeze(-1), torch.zeros(b, device=device)))
            valids.append(valid)
            if cfg.logprobs_topk > 0:
                v, i = topk_logprobs(lp, min(cfg.logprobs_topk, lp.shape[-1]))
                tk_v.append(torch.where(valid[:, None], v, torch.zeros_like(v)))
                tk_i.append(torch.where(valid[:, None], i, torch.zeros_like(i)))
            if self.eos_token_id is not None:  # a model without eos always runs to max_new_tokens
                finished = finished | (nxt == self.eos_token_id)
            last_pos = pos[:, -1:] + 1
            step_ids, step_pos = nxt[:, None], last_pos
            ids = torch.cat([ids, step_ids], dim=1)
            attn = torch.cat([attn, valid[:, None]], dim=1)
            pos = torch.cat([pos, last_pos], dim=1)
            if bool(finished.all()):  # host sync once per step: fine in a generation loop
                break
        tok_t = torch.stack(toks, 1)
        mask = torch.stack(valids, 1)
        lengths = mask.sum(1).tolist()
        completion_ids = [tok_t[i, : lengths[i]].tolist() for i in range(b)]
        texts = None
        if self.tokenizer is not None:
            texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        routed_experts = None
        if self.record_routes:  # every position but the last sampled token (never fed back): P + C − 1 per row
            routes = torch.cat(route_blocks, dim=1)
            forwarded_attn = attn[:, : routes.shape[1]]
            routed_experts = split_routes(routes, forwarded_attn,
                                          [len(p) + n - 1 for p, n in zip(prompt_ids, lengths)])
        return RolloutOutput(
            prompt_ids=[list(p) for p in prompt_ids],
            completion_ids=completion_ids,
            logp=torch.stack(logps, 1).float(),
            mask=mask,
            topk_logp=torch.stack(tk_v, 1).float() if tk_v else None,
            topk_ids=torch.stack(tk_i, 1) if tk_i else None,
            texts=texts,
            routed_experts=routed_experts,
            sampling=cfg,
        )

    # -- re-scoring ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def score(self, prompt_ids: list[list[int]], completion_ids: list[list[int]], cfg: SamplingConfig | None = None, *,
              return_logits: bool = False) -> tuple[Tensor, ...]:
        """Processed log-probs of given completions under the *engine's* numerics, one full forward (no cache).

        Same dtype, weight quantisation and KV quantisation as :meth:`generate`, without ``logit_noise``; this is
        the "direct computation" a generated ``logp`` can be checked against. Same returns as
        :func:`offpolicy.rollout.scoring.sequence_logprobs`.
        """
        factory = self._new_cache if self.kv_cache_bits is not None else None
        return score_tokens(
            self.model, prompt_ids, completion_ids, cfg, return_logits=return_logits, past_key_values_factory=factory
        )


def _check_layers(layers, model: torch.nn.Module, kv_cache_bits: int | None,
                  weight_bits: int | None, quant: str | None = None) -> frozenset[int] | None:
    """``quantize_layers`` as a frozenset of valid decoder-layer indices (None: all layers)."""
    if layers is None:
        return None
    if kv_cache_bits is None and weight_bits is None and quant is None:
        raise ValueError("quantize_layers needs weight_bits or kv_cache_bits (or quant): there is nothing to restrict")
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise ValueError(f"quantize_layers must be a list of decoder-layer indices, got {layers!r}")
    from offpolicy.perturbation import find_decoder_layers

    n = len(find_decoder_layers(model))
    out = list(layers)
    if not out or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in out):
        raise ValueError(f"quantize_layers must be a non-empty list of indices in [0, {n}), got {layers!r}")
    return frozenset(out)


def _fp32_output_projection(model: torch.nn.Module) -> None:
    """Give the output projection its own float32 weight and cast its input up (TRL's ``cast_lm_head_to_fp32``).

    A tied embedding keeps the engine-dtype copy: the embedding lookup rounds as before, only the logits change.
    """
    lm: Any = model  # a transformers causal LM (torch types module attributes as Tensor | Module)
    head = lm.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"lm_head_fp32 needs a Linear output projection, got {type(head).__name__}")
    head.weight = torch.nn.Parameter(head.weight.detach().float(), requires_grad=False)  # unties a tied embedding
    if head.bias is not None:
        head.bias = torch.nn.Parameter(head.bias.detach().float(), requires_grad=False)
    head.register_forward_pre_hook(lambda module, args: (args[0].float(), *args[1:]))


def _first_not_none(*values):
    for v in values:
        if v is not None:
            return v
    return None


@register_engine("hf", fields=("autocast", "kv_cache", "kv_cache_bits", "weight_bits", "quantize_layers", "quant",
                               "lm_head_fp32", "logit_noise", "attn_implementation", "sampler", "compile",
                               "record_routes"))
def build_hf_engine(spec: EngineSpec, *, model: Any = None, tokenizer: Any = None,
                      model_path: str | None = None) -> HFRolloutEngine:
    """The factory's builder for ``backend="hf"``: an :class:`HFRolloutEngine` with ``spec``'s numerics on a private
    copy of ``model``. ``spec.autocast`` is not the engine's: the trainer side of ``offpolicy inspect`` applies it to
    its scoring forward."""
    if model is None:
        raise ValueError("backend=hf builds on a transformers model: pass model=")
    return HFRolloutEngine(
        model, dtype=spec.dtype, kv_cache=spec.kv_cache, kv_cache_bits=spec.kv_cache_bits,
        weight_bits=spec.weight_bits, logit_noise=spec.logit_noise,
        quantize_layers=list(spec.quantize_layers) if spec.quantize_layers is not None else None, quant=spec.quant,
        lm_head_fp32=spec.lm_head_fp32, attn_implementation=spec.attn_implementation, tokenizer=tokenizer,
        record_routes=spec.record_routes, sampler=spec.sampler, compile=spec.compile,
    )
