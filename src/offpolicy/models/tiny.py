"""The embedded tiny causal LM: a Qwen2-architecture transformers model built from a config (no download).

≈1.3 M parameters (hidden 128, 4 layers, 4 heads, 2 KV heads, tied embeddings over the 4 099-entry tokenizer of
:mod:`offpolicy.models.tokenizer`), so a warm start and a short RL run fit on two CPU cores. It is an ordinary
``Qwen2ForCausalLM``: everything that works on a real model (``save_pretrained``/``from_pretrained``, KV cache,
bf16 casting) works on it — including transformers' default attention kernel (sdpa), the same one
``from_pretrained`` picks when the cached copy is loaded — which is the point — the demo's training–inference mismatch comes from the same
numerics as a real one.
"""

from __future__ import annotations

import torch

# Bump when anything that changes the built weights changes (config, tokenizer corpus, warm-start recipe):
# the cache directory name is derived from it.
TINY_MODEL_VERSION = "2"

TINY_CONFIG: dict = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
}


# The architectures an embedded recipe can name: transformers config and causal-LM classes. ``qwen3_moe`` is the
# mixture-of-experts one (softmax → top-k router, no shared expert), whose ``Qwen3MoeTopKRouter`` routing replay
# supports (offpolicy.rollout.routing).
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def _classes(architecture: str) -> tuple[type, type]:
    import transformers

    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {sorted(ARCHITECTURES)}, got {architecture!r}")
    config_name, model_name = ARCHITECTURES[architecture]
    return getattr(transformers, config_name), getattr(transformers, model_name)


def tiny_config(tokenizer, architecture: str = "qwen2", **overrides):  # -> Qwen2Config | Qwen3MoeConfig
    """Config of the tiny model for ``tokenizer`` (vocab size and special ids taken from it): :data:`TINY_CONFIG`
    with ``overrides``, for one of :data:`ARCHITECTURES` (default ``qwen2``).

    >>> from offpolicy.models.tokenizer import build_tokenizer
    >>> tiny_config(build_tokenizer()).num_hidden_layers
    4
    >>> type(tiny_config(build_tokenizer(), "qwen3_moe", num_experts=8)).__name__
    'Qwen3MoeConfig'
    """
    config_class, _ = _classes(architecture)
    cfg = {**TINY_CONFIG, **overrides}
    return config_class(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **cfg,
    )


def build_tiny_model(seed: int = 0, *, architecture: str = "qwen2",
                     **config_overrides):  # -> (PreTrainedModel, PreTrainedTokenizerFast)
    """Randomly initialised tiny model + tokenizer, fp32, eval mode; deterministic given ``seed``.

    >>> model, tok = build_tiny_model(seed=0)
    >>> sum(p.numel() for p in model.parameters()) > 1_000_000, model.dtype
    (True, torch.float32)
    """
    from offpolicy.models.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    config = tiny_config(tokenizer, architecture, **config_overrides)
    _, model_class = _classes(architecture)
    # Seed a private generator for init: fork_rng keeps the caller's global RNG untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.float().eval(), tokenizer
