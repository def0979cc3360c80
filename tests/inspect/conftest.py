"""Fixtures for the inspect tests: tiny random Qwen2 / Llama models built locally from their Config classes."""

from __future__ import annotations

import pytest
import torch


def _random_model(kind: str, *, vocab: int = 96, layers: int = 4, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[kind]
    config = config_cls(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
        # Sharper logits than the default init (std 0.02 gives a near-uniform next-token distribution): scale the
        # final norm so that distributions have a head and a tail, as a trained model's do.
        with torch.no_grad():
            model.model.norm.weight.mul_(20.0)
    return model.float().eval()


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def random_lm(request):
    """(kind, model): a tiny random Qwen2 or Llama (untied lm_head), fp32, eval."""
    return request.param, _random_model(request.param)


@pytest.fixture(scope="module")
def random_prompts():
    g = torch.Generator().manual_seed(0)
    return [[1] + torch.randint(3, 96, (n,), generator=g).tolist() for n in (3, 5, 2, 6)]


@pytest.fixture(scope="module")
def prompts(tiny):
    tok = tiny[1]
    return [tok(t)["input_ids"] for t in ("12+34=", "5-7=", "Use 3 5 7 to make 22:", "99+1=", "1=", "7*8=")]
