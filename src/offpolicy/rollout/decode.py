"""One KV-cached decoding step straight through a transformers causal LM's own modules.

A decoding step of :class:`~offpolicy.rollout.hf.HFRolloutEngine` feeds one token per row. Through
``model(...)`` each step also rebuilds the 4-D attention mask from the 2-D one, runs the model-level wrappers
(config defaults, output capturing, deprecated-keyword checks) and builds output objects — on the tiny lab models
that is a tenth of the step. :class:`DecodeStep` calls the same modules the model's forward calls, in the same
order and with the same arguments (embedding → rotary cos/sin → every decoder layer → final norm → lm_head), and
builds the mask itself as transformers' eager attention does: 0 where a key is attended, the dtype's minimum where
it is not. So the logits are *bitwise* those of ``model(...)`` (pinned by ``tests/rollout/test_fast_decode.py``
against the full forward, with KV-cache and weight quantisation and every sampling processor).

Only where that is known to hold: transformers 5 (decoder layers return the hidden states), the Llama / Qwen2 /
Qwen3 families (their forward is exactly that sequence), eager attention, full attention in every layer;
:meth:`DecodeStep.build` returns None otherwise and the engine keeps ``model(...)``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor

# model types whose base-model forward is embed → rotary_emb(h, position_ids) → layers(h, mask, position
# embeddings, cache) → norm, with nothing in between (no embedding scale, no per-layer extras)
_PLAIN_DECODERS = frozenset({"llama", "qwen2", "qwen3"})


def cache_keyword(forward: Any) -> str:
    """The keyword a transformers forward takes its KV cache by: ``cache`` (transformers ≥ 5.2x), else the older
    ``past_key_values`` (read once from the signature, so that no step passes the deprecated name).

    >>> cache_keyword(lambda input_ids, cache=None: None), cache_keyword(lambda input_ids, past_key_values=None: None)
    ('cache', 'past_key_values')
    """
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


class DecodeStep:
    """``step(ids [B, 1], attn [B, L] bool, pos [B, 1], cache)`` → float32 logits ``[B, V]`` of the next token, where
    ``attn`` covers the cached positions and this one and ``cache`` holds the first L − 1 positions (it is extended).

    >>> from offpolicy.models.tiny import build_tiny_model
    >>> model, _ = build_tiny_model()
    >>> DecodeStep.build(model) is None  # transformers' default attention here is sdpa: not rebuilt
    True
    >>> model.set_attn_implementation("eager")
    >>> type(DecodeStep.build(model)).__name__
    'DecodeStep'
    """

    def __init__(self, model: torch.nn.Module) -> None:
        lm: Any = model  # a transformers causal LM (torch types module attributes as Tensor | Module)
        self.base = lm.model
        self.layers = list(self.base.layers)[: lm.config.num_hidden_layers]
        self.lm_head = lm.lm_head
        self.cache_kw = cache_keyword(type(self.layers[0]).forward)

    @staticmethod
    def build(model: torch.nn.Module) -> DecodeStep | None:
        """A :class:`DecodeStep` for ``model``, or None where the plain forward must be kept (see the module doc)."""
        import transformers

        if int(transformers.__version__.split(".")[0]) < 5:
            return None
        cfg: Any = getattr(model, "config", None)
        if cfg is None or getattr(cfg, "model_type", None) not in _PLAIN_DECODERS:
            return None
        if getattr(cfg, "_attn_implementation", None) != "eager":
            return None
        if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ["full_attention"]):
            return None
        base = getattr(model, "model", None)
        if not all(hasattr(base, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
            return None
        return DecodeStep(model)

    def __call__(self, ids: Tensor, attn: Tensor, pos: Tensor, cache: Any) -> Tensor:
        hidden = self.base.embed_tokens(ids)
        # transformers' eager mask for one query: 0 where the key is attended, the dtype's minimum elsewhere
        mask = torch.where(attn[:, None, None, :], torch.zeros((), dtype=hidden.dtype, device=hidden.device),
                           torch.finfo(hidden.dtype).min)
        position_embeddings = self.base.rotary_emb(hidden, pos)
        kwargs = {self.cache_kw: cache}
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings, position_ids=pos,
                           use_cache=True, **kwargs)
        hidden = self.base.norm(hidden)
        return self.lm_head(hidden)[:, -1].float()  # the engine-dtype lm_head matmul happened; only now float32
