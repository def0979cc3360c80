"""The engine's fast decoding step (offpolicy.rollout.decode) changes nothing: the same tokens, bitwise the same μ.

The reference is ``HFRolloutEngine(..., fast_decode=False)``, which calls transformers' full ``model(...)`` forward
at every step (the engine's code before the fast path existed). Both engines sample with the same seed; every
sampled id, every log-prob, mask and top-k entry must be *equal* (torch.equal, not close): the lab's published
numbers are reproducible runs, and a rounding change anywhere would move them.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from offpolicy.models import get_recipe
from offpolicy.models.cache import model_dir
from offpolicy.models.tiny import build_tiny_model
from offpolicy.rollout.decode import DecodeStep
from offpolicy.rollout.hf import HFRolloutEngine
from offpolicy.rollout.sampling import SamplingConfig

CONFIGS = {
    "plain": SamplingConfig(max_new_tokens=12),
    "truncated": SamplingConfig(max_new_tokens=12, temperature=0.7, top_k=40, top_p=0.9, min_p=0.02,
                                logprobs_topk=5),
    "penalties": SamplingConfig(max_new_tokens=12, repetition_penalty=1.3, frequency_penalty=0.4,
                                presence_penalty=0.2, logit_bias={5: 2.0, 9: -1.0}, bad_words_ids=[[7], [11, 12]]),
}
ENGINES = {
    "bf16": {},
    "kv4": {"kv_cache_bits": 4},
    "w4+kv8 on layer 1": {"weight_bits": 4, "kv_cache_bits": 8, "quantize_layers": [1]},
    "w8 + fp32 lm_head": {"weight_bits": 8, "lm_head_fp32": True},
    "fp16": {"dtype": "float16"},  # slow on CPU: tiny models only
    "fp32": {"dtype": "float32"},
}


def _sharpen(model):
    """Logits ×30 (final-norm weight): peaked next-token distributions, so rows hit eos at different steps."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.model.norm.weight.mul_(30.0)
    return model


@pytest.fixture(scope="module")
def batch(tiny):
    """Six prompts of different lengths (left padding), four samples each — a GRPO batch."""
    tok = tiny[1]
    texts = ["12+34=", "5-7=", "Use 3 5 7 to make 22:", "99+1=", "1=", "Use 10 2 4 to make 9:"]
    return [tok(t)["input_ids"] for t in texts for _ in range(4)]


@pytest.fixture(scope="module")
def models(tiny):
    """name → model: the tiny model and a random model of the lab's shapes (both plain and sharpened), plus the
    warm-started lab model where it is already cached (building it takes minutes: not in a unit test)."""
    lab_shaped, _ = build_tiny_model(seed=1, **get_recipe("lab").config)
    out = {"tiny": tiny[0], "tiny sharp": _sharpen(tiny[0]), "lab-shaped": lab_shaped,
           "lab-shaped sharp": _sharpen(lab_shaped)}
    if model_dir("lab").is_dir():
        from offpolicy.models import load_model

        out["lab"] = load_model("lab")[0]
    return out


def _engines(model, batch, tok, **kw):
    """The fast engine and the reference, with eos = a token this engine really samples (row 0's third token at
    seed 3), so that rows stop at different steps: finished rows go on being computed (and padded) beside the
    others."""
    eos = HFRolloutEngine(model, **kw).generate(batch, SamplingConfig(max_new_tokens=3), seed=3).completion_ids[0][2]
    return (HFRolloutEngine(model, tokenizer=tok, eos_token_id=eos, **kw),
            HFRolloutEngine(model, tokenizer=tok, eos_token_id=eos, fast_decode=False, **kw))


def _same(fast, ref):
    assert fast.completion_ids == ref.completion_ids
    assert torch.equal(fast.mask, ref.mask)
    assert torch.equal(fast.logp, ref.logp)
    assert (fast.topk_logp is None) == (ref.topk_logp is None)
    if fast.topk_logp is not None:
        assert torch.equal(fast.topk_logp, ref.topk_logp) and torch.equal(fast.topk_ids, ref.topk_ids)


@pytest.mark.parametrize("engine_kw", ENGINES.values(), ids=ENGINES.keys())
def test_every_engine_option_samples_the_same(models, batch, tiny, engine_kw):
    for name, model in models.items():
        if name == "lab-shaped" or (engine_kw.get("dtype") == "float16" and "tiny" not in name):
            continue  # the lab's shapes: sharpened and warm-started cover them
        fast, ref = _engines(model, batch, tiny[1], **engine_kw)
        assert fast._decode_step is not None and ref._decode_step is None
        out = fast.generate(batch, CONFIGS["plain"], seed=3)
        _same(out, ref.generate(batch, CONFIGS["plain"], seed=3))
        if "sharp" in name:  # the test means something only if rows finished early and others went on
            assert len(set(map(len, out.completion_ids))) > 1, name


@pytest.mark.parametrize("cfg", CONFIGS.values(), ids=CONFIGS.keys())
def test_every_sampling_processor_samples_the_same(models, batch, tiny, cfg):
    for name in ("tiny sharp", "lab-shaped", "lab") if "lab" in models else ("tiny sharp", "lab-shaped"):
        fast, ref = _engines(models[name], batch, tiny[1], kv_cache_bits=8)
        for seed in (0, 1):
            _same(fast.generate(batch, cfg, seed=seed), ref.generate(batch, cfg, seed=seed))


def test_one_step_equals_the_full_forward(tiny):
    """The step's logits against ``model(...)`` directly: a padded row, a row whose last token is masked out
    (a finished row), a cache filled by a prefill."""
    engine = HFRolloutEngine(tiny[0], fast_decode=False)
    step = DecodeStep.build(engine.model)
    assert step is not None
    ids = torch.tensor([[0, 0, 5, 6], [3, 4, 5, 6], [0, 7, 8, 9]])
    attn = ids != 0
    pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
    nxt, new_attn = torch.tensor([[10], [11], [12]]), torch.cat([attn, torch.tensor([[True], [False], [True]])], 1)
    new_pos = pos[:, -1:] + 1
    with torch.no_grad():
        caches = [engine._new_cache(), engine._new_cache()]
        for cache in caches:
            engine._logits(ids, attn, pos, cache)
        expected = engine._logits(nxt, new_attn, new_pos, caches[0])
        assert torch.equal(step(nxt, new_attn, new_pos, caches[1]), expected)


def test_falls_back_where_the_step_is_not_known_to_be_exact(tiny):
    sdpa = HFRolloutEngine(tiny[0], attn_implementation="sdpa")
    assert sdpa._decode_step is None  # the sdpa mask (boolean, or None without padding) is not rebuilt here
    other = copy.deepcopy(tiny[0])
    other.config.model_type = "gemma"  # scales its embeddings in the model's forward: not the plain sequence
    assert DecodeStep.build(other) is None


def test_no_deprecated_cache_keyword(tiny, batch):
    """transformers 5.2x renamed ``past_key_values`` to ``cache``: the engine passes the name its model takes."""
    engine = HFRolloutEngine(tiny[0], fast_decode=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.generate(batch[:2], SamplingConfig(max_new_tokens=3), seed=0)
    assert not [w for w in caught if "past_key_values" in str(w.message)]


def test_scoring_by_row_index_equals_the_gather(tiny):
    """score_tokens picks each completion position's logits by indexing rows; the earlier code gathered them with a
    [B, T, V] index. Same log-probs and same gradients, bitwise (a copy either way; the backward adds each
    gradient once into zeros)."""
    from offpolicy.rollout.base import pad_ids
    from offpolicy.rollout.sampling import process_logits
    from offpolicy.rollout.scoring import sequence_logprobs

    model, tok = tiny
    prompts = [tok(t)["input_ids"] for t in ("12+34=", "5-7=", "Use 3 5 7 to make 22:")]
    completions = [[21, 22, 23, 2], [24], [25, 26]]
    cfg = SamplingConfig(temperature=0.7)

    def grads():
        return [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    logp, mask = sequence_logprobs(model, prompts, completions, cfg)
    logp.sum().backward()
    new = (logp.detach(), grads())

    # the earlier code, step by step: the same forward (logits from the shortest prompt's last position on)
    model.zero_grad()
    ids, attn = pad_ids([p + c for p, c in zip(prompts, completions)], 0, side="right")
    p_len, t = torch.tensor([len(p) for p in prompts]), max(map(len, completions))
    src = (p_len[:, None] - 1 + torch.arange(t)[None, :]).clamp(max=ids.shape[1] - 1)
    targets = torch.gather(ids, 1, (src + 1).clamp(max=ids.shape[1] - 1))
    skip = min(map(len, prompts)) - 1
    out = model(input_ids=ids, attention_mask=attn.long(), use_cache=False,
                logits_to_keep=torch.arange(skip, ids.shape[1]))
    logits = torch.gather(out.logits, 1, (src - skip)[..., None].expand(3, t, out.logits.shape[-1]))
    old = torch.gather(process_logits(logits, cfg), -1, targets[..., None]).squeeze(-1)
    old = torch.where(mask, old, torch.zeros_like(old))
    old.sum().backward()
    assert torch.equal(new[0], old.detach())
    assert all(torch.equal(a, b) for a, b in zip(new[1], grads()))
    model.zero_grad()
