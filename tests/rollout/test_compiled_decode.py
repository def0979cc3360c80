"""The engine's decoding steps through ``torch.compile`` (``HFRolloutEngine(compile=True)``, ``rollout.compile``).

Compiled kernels round differently from eager ones, so μ is the compiled engine's own: these tests check it
against the eager re-score of the same tokens within bf16 rounding, that it is reproducible, that it follows
:meth:`~offpolicy.rollout.hf.HFRolloutEngine.sync_weights` (weights are graph inputs, not constants) and that other
batch sizes and lengths reuse the one dynamic-shape compilation. One compilation costs ~20-30 s on two CPU cores.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch

from offpolicy.rollout.hf import HFRolloutEngine
from offpolicy.rollout.sampling import SamplingConfig

CFG = SamplingConfig(max_new_tokens=8, logprobs_topk=3)
# bf16 keeps 8 bits of mantissa: logits of magnitude ≤ 8 round by ≤ 8 · 2⁻⁸ ≈ 0.03 per operation order; measured on
# the tiny model 0.004 (its weights) and 0.012 (weights × 1.5) between compiled μ and the eager re-score
BF16_TOL = 0.05

needs_compiler = pytest.mark.skipif(not any(shutil.which(c) for c in ("c++", "g++", "clang++")),
                                    reason="torch.compile on CPU needs a C++ compiler")


def _rescore_gap(engine, out) -> float:
    direct, mask = engine.score(out.prompt_ids, out.completion_ids, CFG)
    assert torch.equal(mask, out.mask)
    return (direct - out.logp).abs()[mask].max().item()


@needs_compiler
def test_compiled_engine_is_its_own_mu_reproducible_and_follows_weight_sync(tiny, prompts):
    model, tok = tiny
    engine = HFRolloutEngine(model, tokenizer=tok, sampler="inverse_cdf", compile=True)
    out = engine.generate(prompts, CFG, seed=0)
    assert _rescore_gap(engine, out) <= BF16_TOL
    again = engine.generate(prompts, CFG, seed=0)
    assert again.completion_ids == out.completion_ids and torch.equal(again.logp, out.logp)
    assert torch.equal(again.topk_ids, out.topk_ids)

    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.mul_(1.5)
    engine.sync_weights(moved)
    after = engine.generate(prompts, CFG, seed=0)
    assert _rescore_gap(engine, after) <= BF16_TOL  # the eager re-score runs on the new weights: so did the graph
    assert _rescore_gap(engine, out) > 10 * BF16_TOL  # ... and the old tokens' μ no longer matches them (1.15)

    # another batch size and length: the same dynamic-shape graph, μ still the engine's own
    longer = engine.generate(prompts[:3] * 3, SamplingConfig(max_new_tokens=12, logprobs_topk=3), seed=1)
    assert _rescore_gap(engine, longer) <= BF16_TOL


def test_compile_refusals_name_the_reason(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="fast decoding path"):
        HFRolloutEngine(model, tokenizer=tok, compile=True, fast_decode=False)
    with pytest.raises(ValueError, match="fast decoding path"):
        HFRolloutEngine(model, tokenizer=tok, compile=True, attn_implementation="sdpa")


def test_compile_is_a_transformers_engine_option_in_the_config():
    from offpolicy.train.config import load_config

    assert load_config(None, ["rollout.compile=true"]).rollout.compile is True
    with pytest.raises(ValueError, match="rollout.compile"):
        load_config(None, ["rollout.engine=llamacpp", "rollout.compile=true"])
