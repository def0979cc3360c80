"""GGUF export: the file llama.cpp loads computes what transformers computes (F32), tokenises as the tokenizer does,
and its quantised tensors are what Q8_0 / Q4_0 define."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("xllamacpp")

from offpolicy_testkit.gguf_read import read_gguf_tensor

from offpolicy.models.gguf import export_gguf, tokenizer_metadata
from offpolicy.rollout.http import post_json
from offpolicy.rollout.llamacpp import LlamaCppRolloutEngine, LlamaCppServer
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.scoring import score_tokens


def _full_kl(model, prompts, out):
    """Exact KL(π_HF ‖ μ_llama.cpp) per sampled position over the whole vocabulary, in float64."""
    with torch.no_grad():
        _, _, logits = score_tokens(model, prompts, out.completion_ids, None, return_logits=True)
    log_p = torch.log_softmax(logits.double(), -1)
    log_mu = torch.full_like(log_p, float("-inf")).scatter(-1, out.topk_ids, out.topk_logp.double())
    log_mu = log_mu - torch.logsumexp(log_mu, -1, keepdim=True)
    return (log_p.exp() * (log_p - log_mu)).sum(-1)[out.mask]


def test_f32_file_matches_transformers_fp32_over_the_full_vocabulary(sharp, tmp_path):
    # The floor of the comparison: two implementations (llama.cpp's CPU kernels vs torch), same fp32 weights, F32
    # KV cache. Measured on this model: mean KL ≈ 1e-10, max |Δ log μ| ≈ 1e-5 nats — bounds with margin below.
    model, tok = sharp
    prompts = [tok(t)["input_ids"] for t in ("12+34=", "Use 3 5 7 to make 22:")]
    engine = LlamaCppRolloutEngine(model, tok, weights="f32", threads=1, workdir=tmp_path)
    try:
        assert engine.kv_cache_type == "f32"
        out = engine.generate(prompts, SamplingConfig(max_new_tokens=6, logprobs_topk=model.config.vocab_size),
                              seed=1)
    finally:
        engine.close()
    assert out.topk_ids.shape[-1] == model.config.vocab_size == 4099
    # every id exactly once at every position: the full distribution came back
    assert bool((out.topk_ids[out.mask].sort(-1).values == torch.arange(4099)).all())
    kl = _full_kl(model, prompts, out)
    assert kl.numel() == int(out.mask.sum()) > 0
    assert float(kl.mean()) < 1e-7 and float(kl.max()) < 1e-6
    with torch.no_grad():
        logp = score_tokens(model, prompts, out.completion_ids, SamplingConfig())[0]
    assert float((logp - out.logp)[out.mask].abs().max()) < 1e-4


def test_quantised_files_move_away_from_the_floor_in_order(sharp, tmp_path):
    # F16 < Q8_0 < Q4_0 in full-vocabulary KL against the fp32 model, on the same prompts and seed.
    model, tok = sharp
    prompts = [tok("12+34=")["input_ids"]]
    kls = {}
    for weights in ("f16", "q8_0", "q4_0"):
        engine = LlamaCppRolloutEngine(model, tok, weights=weights, kv_cache_type="f32", threads=1,
                                       workdir=tmp_path / weights)
        try:
            out = engine.generate(prompts, SamplingConfig(max_new_tokens=4, logprobs_topk=4099), seed=0)
        finally:
            engine.close()
        kls[weights] = float(_full_kl(model, prompts, out).mean())
    assert 0 < kls["f16"] < kls["q8_0"] < kls["q4_0"]


def test_tokenizer_round_trip_through_the_server(tiny, tmp_path):
    model, tok = tiny
    path = export_gguf(model, tok, tmp_path / "tiny.gguf")
    server = LlamaCppServer(path, threads=1)
    texts = ["12+34= (the answer) 7", "Use 3 5 7 to make 22:", "  bazu Bazu, kone\nx(1)", "99999 + 0.5 éà ✓",
             "answer: -12*(3/4)"]
    try:
        for text in texts:
            got = post_json(server.url + "/tokenize", {"content": text, "add_special": True}, timeout=30,
                            what="tokenize")["tokens"]
            assert got == tok(text)["input_ids"], text
            back = post_json(server.url + "/detokenize", {"tokens": got[1:]}, timeout=30, what="detokenize")
            assert back["content"] == text
    finally:
        server.close()


def test_q8_0_and_q4_0_tensors_are_blockwise_round_to_nearest(tiny, tmp_path):
    model, tok = tiny
    w = model.model.layers[0].mlp.down_proj.weight.detach()  # [128, 384]: rows of 12 blocks of 32
    for kind, qmax, tol in (("q8_0", 127, 0.5), ("q4_0", 8, 1.0)):
        path = export_gguf(model, tok, tmp_path / f"{kind}.gguf", weights=kind)
        deq = read_gguf_tensor(path, "blk.0.ffn_down.weight")
        assert deq.shape == w.shape
        # one scale d = amax / qmax per block of 32, stored as F16 (relative rounding ≤ 2^-11): |w − q·d̂| ≤
        # tol · d (rounding to the grid) + |q| · |d − d̂| ≤ amax · (tol / qmax + 2^-11)
        amax = w.abs().reshape(w.shape[0], -1, 32).amax(-1, keepdim=True)
        err = (w - deq).abs().reshape(w.shape[0], -1, 32)
        assert bool((err <= amax * (tol / qmax + 2**-11) + 1e-7).all()), kind
        assert float(err.max()) > 0
    # the embedding (= tied output projection) stays F16 under Q8_0 / Q4_0; 1-D tensors stay F32
    emb = read_gguf_tensor(tmp_path / "q4_0.gguf", "token_embd.weight")
    assert torch.equal(emb, model.model.embed_tokens.weight.detach().half().float())
    norm = read_gguf_tensor(tmp_path / "q4_0.gguf", "blk.0.attn_norm.weight")
    assert torch.equal(norm, model.model.layers[0].input_layernorm.weight.detach())


def test_q4_0_hand_computed_block(tiny, tmp_path):
    # One block of 32: x = [-8, -7, …, 23] / 23 · 0.5. Q4_0: d = max-magnitude value / −8 = 0.5 / −8 = −0.0625,
    # q = round(x / d + 8) clipped to [0, 15], x̂ = (q − 8) · d. The largest value 0.5 maps to q = 0 → 0.5 exactly.
    import gguf.quants as gq
    import numpy as np

    x = (np.arange(-8, 24, dtype=np.float32) / 23 * 0.5)[None, :]
    deq = gq.dequantize(gq.quantize(x, gq.GGMLQuantizationType.Q4_0), gq.GGMLQuantizationType.Q4_0)
    assert deq[0, -1] == pytest.approx(0.5)
    assert np.abs(deq - x).max() <= 0.0625 / 2 + 1e-6


def test_llama_architecture_export_permutes_q_and_k(tmp_path):
    # A tiny Llama (rotate-half rope in transformers, interleaved in llama.cpp): without the q/k permutation the
    # KL would be large; with it the file matches the fp32 model.
    from transformers import LlamaConfig, LlamaForCausalLM

    from offpolicy.models.tokenizer import build_tokenizer

    tok = build_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(20.0)
    prompts = [tok("Use 3 5 7 to make 22:")["input_ids"]]
    engine = LlamaCppRolloutEngine(model, tok, threads=1, workdir=tmp_path)
    try:
        out = engine.generate(prompts, SamplingConfig(max_new_tokens=5, logprobs_topk=4099), seed=0)
    finally:
        engine.close()
    assert float(_full_kl(model, prompts, out).max()) < 1e-6


def test_export_refuses_what_it_cannot_write(tiny, tmp_path):
    model, tok = tiny
    with pytest.raises(ValueError, match="weights must be one of"):
        export_gguf(model, tok, tmp_path / "x.gguf", weights="q5_k")
    from offpolicy.models.tiny import build_tiny_model

    odd, _ = build_tiny_model(hidden_size=72, intermediate_size=144, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="multiple of 32"):
        export_gguf(odd, tok, tmp_path / "odd.gguf", weights="q8_0")
    assert not list(tmp_path.glob(".odd.gguf-*"))  # no half-written file left behind
    with pytest.raises(ValueError, match="vocabulary of 10"):
        tokenizer_metadata(tok, 10)
