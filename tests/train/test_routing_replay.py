"""The trainer's rollout.routing_replay option on a tiny mixture-of-experts model."""

import math

import pytest
import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

from offpolicy.train.config import load_config
from offpolicy.train.loop import train


def _tiny_moe(tok):
    torch.manual_seed(0)
    config = Qwen2MoeConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, num_experts=8, num_experts_per_tok=2,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return Qwen2MoeForCausalLM(config).eval()


@pytest.mark.parametrize("mode", ["none", "r2", "r3"])
def test_routing_replay_modes_train_and_report_the_flip_rate(mode, tmp_path, tiny_pair, make_overrides, varying_task):
    _, tok = tiny_pair
    model = _tiny_moe(tok)
    cfg = load_config(None, make_overrides(tmp_path, "naive", steps=1, rollout__routing_replay=mode,
                                           optim__minibatches=2))
    res = train(cfg, model=model, tokenizer=tok, task=varying_task())
    row = res.history[0]
    assert math.isfinite(row["loss/loss"]) and row["loss/grad_norm"] > 0
    # without replay too: the engine records its routes on an MoE model, and the trainer counts the flips
    assert 0.0 <= row["routing/flip_rate"] <= 1.0


def test_r3_with_an_fp32_engine_leaves_no_mismatch(tmp_path, tiny_pair, make_overrides, varying_task):
    _, tok = tiny_pair
    cfg = load_config(None, make_overrides(tmp_path, "naive", steps=1, rollout__routing_replay="r3",
                                           rollout__dtype="float32", rollout__kv_cache="false"))
    res = train(cfg, model=_tiny_moe(tok), tokenizer=tok, task=varying_task())
    assert res.history[0]["routing/flip_rate"] == 0.0
    assert res.history[0]["rollout_correction/k3_kl"] < 1e-9


def test_routing_replay_needs_an_moe_model(tmp_path, fresh, make_overrides, varying_task):
    model, tok = fresh
    cfg = load_config(None, make_overrides(tmp_path, "naive", steps=1, rollout__routing_replay="r2"))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        train(cfg, model=model, tokenizer=tok, task=varying_task())
    with pytest.raises(ValueError, match="routing_replay"):
        load_config(None, make_overrides(tmp_path, "naive", rollout__routing_replay="r4"))
