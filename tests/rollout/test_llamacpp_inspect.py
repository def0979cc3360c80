"""offpolicy inspect on a real engine: backend=llamacpp (exact full-vocabulary KL, K = V) and server=URL (top-k
bounds)."""

from __future__ import annotations

import pytest

pytest.importorskip("xllamacpp")
pytest.importorskip("gguf")

from offpolicy.inspect.run import inspect_engines
from offpolicy.inspect.specs import parse_spec
from offpolicy.rollout.llamacpp import LlamaCppRolloutEngine
from offpolicy.rollout.sampling import SamplingConfig


def test_specs_parse_and_refuse():
    spec = parse_spec("backend=llamacpp,weights=q4_0,kv_cache_bits=8", "rollout")
    assert spec.describe() == "llama.cpp Q4_0 weights + q8_0 KV cache"
    assert parse_spec("backend=llamacpp", "rollout").describe() == "llama.cpp F32 weights + f32 KV cache"
    assert parse_spec("backend=llamacpp,weights=q8_0", "rollout").describe() == "llama.cpp Q8_0 weights + f16 KV cache"
    assert parse_spec("backend=llamacpp,weights=f16,kv_cache_bits=32", "rollout").describe().endswith("+ f32 KV cache")
    served = parse_spec("server=http://127.0.0.1:8080", "rollout")
    assert served.backend == "server" and served.describe() == "a server at http://127.0.0.1:8080"
    vllm = parse_spec("server=http://127.0.0.1:8000,protocol=vllm", "rollout")
    assert vllm.describe() == "vllm server at http://127.0.0.1:8000"
    assert parse_spec("backend=vllm,kv_cache_dtype=fp8", "rollout").describe() == "vLLM bfloat16 + fp8 KV cache"
    for text, message in (("backend=llamacpp,weights=q5_k", "weights must be one of"),
                          ("backend=llamacpp,kv_cache_bits=6", "kv_cache_bits with backend=llamacpp"),
                          ("backend=llamacpp,weight_bits=4", "weight_bits is a simulated knob"),
                          ("bf16,weights=q8_0", "add backend=llamacpp"),
                          ("server=localhost:80", "http:// URL"),
                          ("server=http://h:1,protocol=tgi", "protocol must be one of"),
                          ("bf16,kv_cache_dtype=fp8", "add backend=vllm")):
        with pytest.raises(ValueError, match=message):
            parse_spec(text, "rollout")
    with pytest.raises(ValueError, match="add backend=llamacpp"):
        parse_spec("fp32,weights=f16", "trainer")


def test_inspect_llamacpp_exact_kl_floor_and_quantised_rows(sharp):
    model, tok = sharp
    prompts = [tok(t)["input_ids"] for t in ("12+34=", "Use 3 5 7 to make 22:")]
    trainer = parse_spec("fp32", "trainer")
    kl = {}
    for spec in ("backend=llamacpp,weights=f32", "backend=llamacpp,weights=q4_0,kv_cache_bits=4"):
        m = inspect_engines(model, prompts, parse_spec(spec, "rollout"), trainer, SamplingConfig(max_new_tokens=4),
                            tokenizer=tok, layers=False, dvp_rhos=None)
        assert m.meta["rollout_view"] == "full" and m.tokens.kl_kind == "exact" and m.layers is None
        assert m.meta["capture_error_over_tolerance"] < 1.0  # μ replayed within float32 rounding
        kl[spec] = float(m.tokens.kl[m.tokens.mask].mean())
    # F32: the engines agree to float32 resolution (the float64 floor is ~1e-12); Q4_0 + q4_0 KV: a real mismatch
    assert abs(kl["backend=llamacpp,weights=f32"]) < 1e-6
    assert kl["backend=llamacpp,weights=q4_0,kv_cache_bits=4"] > 1e-4


@pytest.mark.parametrize("threads", [1, 2])
def test_inspect_llamacpp_capture_check_holds_at_one_and_two_threads(sharp, threads):
    # llama-server decodes with torch's thread count: another summation order in its matmuls and softmax; the
    # replay of μ from its full distribution stays within the float32 log-softmax tolerance (measured on the sharp tiny model: 5e-7 nats, 0.3 % of it, at both)
    import torch

    model, tok = sharp
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        m = inspect_engines(model, [tok(t)["input_ids"] for t in ("12+34=", "Use 3 5 7 to make 22:")],
                            parse_spec("backend=llamacpp,weights=f32", "rollout"), parse_spec("fp32", "trainer"),
                            SamplingConfig(max_new_tokens=8), tokenizer=tok, layers=False, dvp_rhos=None)
    finally:
        torch.set_num_threads(before)
    assert 0 < m.meta["capture_max_abs_error"] and m.meta["capture_error_over_tolerance"] < 0.5


def test_inspect_a_running_server_gives_top_k_bounds(sharp, tmp_path):
    model, tok = sharp
    engine = LlamaCppRolloutEngine(model, tok, weights="q8_0", threads=1, workdir=tmp_path)
    try:
        m = inspect_engines(model, [tok("12+34=")["input_ids"]], parse_spec(f"server={engine.url}", "rollout"),
                            parse_spec("fp32", "trainer"), SamplingConfig(max_new_tokens=4), tokenizer=tok,
                            topk=5, layers=False, dvp_rhos=None)
    finally:
        engine.close()
    t = m.tokens
    assert m.meta["rollout_view"] == "topk" and t.kl_kind == "topk"
    lower, upper = t.kl[t.mask], t.kl_upper[t.mask]
    assert bool((lower >= -1e-6).all()) and bool((upper >= lower - 1e-6).all())  # bounds, up to rounding
    with pytest.raises(ValueError, match="untruncated sampling"):
        inspect_engines(model, [tok("1=")["input_ids"]], parse_spec("backend=llamacpp", "rollout"),
                        parse_spec("fp32", "trainer"), SamplingConfig(max_new_tokens=2, top_k=5), tokenizer=tok,
                        layers=False, dvp_rhos=None)


def test_inspect_llamacpp_ignore_eos_samples_max_new_tokens_and_keeps_the_raw_mu(sharp):
    # ignore_eos (long answers for the depth profile): llama-server bans end-of-generation tokens when sampling; the
    # log-probs it reports stay the raw distribution's, so F32 weights still agree with the trainer to float32 resolution
    from offpolicy.rollout.llamacpp import LlamaCppProtocol

    body = LlamaCppProtocol(10, ignore_eos=True).request([1, 2], SamplingConfig(max_new_tokens=3), seed=0)
    assert body["ignore_eos"] is True and LlamaCppProtocol(10).request([1], SamplingConfig(), seed=0)["ignore_eos"] is False
    model, tok = sharp
    prompts = [tok(t)["input_ids"] for t in ("12+34=", "Use 3 5 7 to make 22:")]
    m = inspect_engines(model, prompts, parse_spec("backend=llamacpp,weights=f32", "rollout"), parse_spec("fp32", "trainer"),
                        SamplingConfig(max_new_tokens=24), tokenizer=tok, layers=False, dvp_rhos=None, ignore_eos=True)
    assert m.tokens.lengths.tolist() == [24, 24] and m.meta["sampling"]["ignore_eos"] is True
    assert abs(float(m.tokens.kl[m.tokens.mask].mean())) < 1e-6
