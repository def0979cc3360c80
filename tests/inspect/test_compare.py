"""The full-distribution comparison: KL/TV/top-k per position, the vocabulary-wide envelope, DVP's grid."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import offpolicy as op
from offpolicy.inspect.compare import DVP_RHO_GRID, compare_engines
from offpolicy.inspect.specs import build_inspect_engine
from offpolicy.inspect.vocabulary import dvp_check, vocabulary_stats
from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.scoring import sequence_logprobs
from offpolicy.rollout.spec import EngineSpec

CFG = SamplingConfig(max_new_tokens=8)
FP32_EAGER = EngineSpec("fp32-eager", dtype="float32", kv_cache=False, attn_implementation="eager")


def test_exact_kl_tv_match_an_independent_computation(tiny, prompts):
    """KL(μ‖π), KL(π‖μ), TV and top-k overlap at every position equal float64 sums over the engines' own logits."""
    model, tok = tiny
    rollout = EngineSpec("bf16", dtype="bfloat16")
    roll, train = build_inspect_engine(model, rollout, tok), build_inspect_engine(model, FP32_EAGER)
    m = compare_engines(model, prompts, rollout, FP32_EAGER, CFG, engines=(roll, train), dvp_rhos=None, topk=5)
    t = m.tokens
    out = roll.generate(prompts, CFG, seed=0)  # one micro-batch: the same seed, so the same samples
    assert t.completion_ids[t.mask].tolist() == sum(out.completion_ids, [])
    assert torch.equal(t.rollout_logp[t.mask], out.logp[out.mask])
    # bf16 + eager: a full forward reproduces the generation logits exactly (tests/rollout/test_hf.py)
    _, _, zr = roll.score(out.prompt_ids, out.completion_ids, return_logits=True)
    logp_t, mask, zt = sequence_logprobs(train.model, out.prompt_ids, out.completion_ids, return_logits=True)
    assert torch.equal(t.trainer_logp[t.mask], logp_t[mask])
    lq, lp = zr[mask].double().log_softmax(-1), zt[mask].double().log_softmax(-1)
    q, p = lq.exp(), lp.exp()
    torch.testing.assert_close(t.kl[t.mask].double(), (q * (lq - lp)).sum(-1), atol=2e-6, rtol=1e-4)
    torch.testing.assert_close(t.kl_reverse[t.mask].double(), (p * (lp - lq)).sum(-1), atol=2e-6, rtol=1e-4)
    torch.testing.assert_close(t.tv[t.mask].double(), 0.5 * (q - p).abs().sum(-1), atol=2e-6, rtol=1e-4)
    top_q, top_p = lq.topk(5).indices, lp.topk(5).indices
    overlap = torch.tensor([len(set(a.tolist()) & set(b.tolist())) / 5 for a, b in zip(top_q, top_p)])
    torch.testing.assert_close(t.topk_overlap[t.mask], overlap.float())
    assert torch.equal(t.topk_ids[t.mask], top_q)
    torch.testing.assert_close(t.rollout_topk_logp[t.mask].double(), lq.gather(1, top_q), atol=1e-5, rtol=0)
    torch.testing.assert_close(t.trainer_topk_logp[t.mask].double(), lp.gather(1, top_q), atol=1e-5, rtol=0)
    assert m.meta["capture_max_abs_error"] == 0.0
    assert m.vocab.corrected_violations == 0 and m.vocab.pairs == int(mask.sum()) * model.config.vocab_size


def test_same_numerics_give_no_mismatch(tiny, prompts):
    """On-policy: an fp32 engine without a KV cache against the same fp32 eager forward — KL 0, nothing to flag."""
    model, tok = tiny
    m = compare_engines(model, prompts, FP32_EAGER, FP32_EAGER, CFG, tokenizer=tok)
    t = m.tokens
    # a per-step full forward (kv_cache=False) and one forward of the whole sequence sum in different orders: ~1e-6
    assert float(t.kl[t.mask].abs().max()) < 1e-5 and float(t.tv[t.mask].max()) < 1e-5
    assert float((t.trainer_logp - t.rollout_logp)[t.mask].abs().max()) < 1e-5
    assert float(t.topk_overlap[t.mask].min()) == 1.0
    assert m.vocab.corrected_violations == 0
    assert m.dvp.check["kept_fraction"] == 1.0


def test_vocabulary_stats_by_hand():
    # π = (0.6, 0.3, 0.0999, 0.0001), ε = z_μ − z_π = (0, 0.1, −0.1, 0.2), ε_max = (0.2 − (−0.1)) / 2 = 0.15.
    # Δ_a = −ε_a + log E_π[e^ε]; E_π[e^ε] = 0.6 + 0.3·e^0.1 + 0.0999·e^−0.1 + 0.0001·e^0.2 = 1.0220667, log = 0.0218267
    # Δ = (0.0218267, −0.0781733, 0.1218267, −0.1781733); printed bound 2·0.15·(1 − p) = (0.12, 0.21, 0.27003, 0.29997)
    # head (p > 0.5): token 0; tail (p < 1e-3): token 3 → tail/head = 0.1781733 / 0.0218267 = 8.16308
    p = torch.tensor([[0.6, 0.3, 0.0999, 0.0001]])
    zt = p.log()
    zr = zt + torch.tensor([[0.0, 0.1, -0.1, 0.2]])
    s, x = vocabulary_stats(zr, zt, topk=2, scatter_from_pi=0, scatter_uniform=0)
    assert s.pairs == 4 and s.paper_violations == 0 and s.corrected_violations == 0
    assert math.isclose(x["eps_max"].item(), 0.15, rel_tol=1e-6)
    assert math.isclose(s.head_abs_delta, 0.0218267, rel_tol=1e-4) and s.head_count == 1
    assert math.isclose(s.tail_abs_delta, 0.1781733, rel_tol=1e-5) and s.tail_count == 1
    assert math.isclose(s.tail_head_ratio, 8.16308, rel_tol=1e-4)
    # decades: 0.6 and 0.3 → [0.1, 1] (bin 11), 0.0999 → [0.01, 0.1) (bin 10), 0.0001 → [1e-4, 1e-3) (bin 8)
    assert s.bin_count[11] == 2 and s.bin_count[10] == 1 and s.bin_count[8] == 1 and sum(s.bin_count) == 4
    assert x["topk_ids"].tolist() == [[0, 1]]
    assert x["topk_overlap"].item() == 1.0  # μ = (0.587, 0.324, 0.088, 0.0001): the same top 2


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 60), st.integers(1, 6), st.floats(0.0, 2.0), st.integers(0, 2**16))
def test_corrected_envelope_always_holds(vocab, rows, scale, seed):
    """|Δ_a| ≤ 2 ε_max (1 − p_a) e^{2 ε_max} for every token of every position (DVP Prop. 4.2, corrected form)."""
    g = torch.Generator().manual_seed(seed)
    zt = 4 * torch.randn(rows, vocab, generator=g)
    zr = zt + scale * (2 * torch.rand(rows, vocab, generator=g) - 1)
    s, x = vocabulary_stats(zr, zt, topk=1, generator=g)
    assert s.corrected_violations == 0
    assert s.pairs == rows * vocab == sum(s.bin_count)
    assert s.paper_violations <= s.pairs
    assert len(s.scatter_p) == rows * 4 and all(0 <= v <= 1 for v in s.scatter_p)
    assert bool((x["eps_max"] <= scale + 1e-5).all())


def test_printed_envelope_fails_at_the_corner():
    # p = (½, ½), ε = (−0.5, +0.5), ε_max = 0.5; log E_π[e^ε] = log cosh 0.5 = 0.1201:
    # Δ_0 = 0.5 + 0.1201 = 0.6201 > 2·0.5·(1 − ½) = 0.5 (the printed bound fails) but ≤ 0.5·e^1 = 1.359 (corrected);
    # Δ_1 = −0.5 + 0.1201 = −0.3799, inside both.
    zt = torch.zeros(1, 2)
    s, _ = vocabulary_stats(zt + torch.tensor([[-0.5, 0.5]]), zt, topk=1, scatter_from_pi=0)
    assert s.paper_violations == 1 and s.corrected_violations == 0
    assert all(min(abs(v - 0.6201145), abs(v - 0.3798855)) < 1e-6 for v in s.scatter_abs_delta)


def test_dvp_grid_equals_constrained_logp():
    """The one-pass grid gives the retained mass and membership that offpolicy.constrained_logp gives at each ρ."""
    g = torch.Generator().manual_seed(0)
    zt = 3 * torch.randn(24, 300, generator=g)
    zr = zt + 0.3 * torch.randn(24, 300, generator=g)
    targets = torch.randint(300, (24,), generator=g)
    _, x = vocabulary_stats(zr, zt, dvp_rhos=DVP_RHO_GRID, targets=targets, temperature=0.7)
    for j, rho in enumerate(DVP_RHO_GRID):
        c = dvp_check(zr, zt, targets, rho, temperature=0.7)
        torch.testing.assert_close(x["dvp_mass"][:, j], c["mass"], atol=1e-5, rtol=0)
        assert torch.equal(x["dvp_inside_trainer"][:, j], c["inside_trainer"])
        assert torch.equal(x["dvp_inside_rollout"][:, j], c["inside_rollout"])


def test_topk_view_brackets_the_exact_kl(tiny, prompts):
    """With only the rollout's top-k (what vLLM returns), lower ≤ exact ≤ upper at every position."""
    model, tok = tiny
    rollout = EngineSpec("bf16", dtype="bfloat16")
    trainer = EngineSpec("fp32", dtype="float32", kv_cache=False)
    exact = compare_engines(model, prompts, rollout, trainer, CFG, tokenizer=tok, topk=8, dvp_rhos=None)
    bounds = compare_engines(model, prompts, rollout, trainer, CFG, tokenizer=tok, topk=8, rollout_view="topk")
    assert torch.equal(exact.tokens.completion_ids, bounds.tokens.completion_ids)  # the same samples
    m = exact.tokens.mask
    lo, ex, hi = bounds.tokens.kl[m], exact.tokens.kl[m], bounds.tokens.kl_upper[m]
    assert bool((lo <= ex + 1e-6).all()) and bool((ex <= hi + 1e-6).all())
    assert bounds.tokens.kl_kind == "topk" and bounds.vocab is None and bounds.dvp.inside_rollout is None
    assert bounds.meta["rollout_view"] == "topk"


def test_logit_noise_is_part_of_mu(tiny, prompts):
    """An engine with logit noise: the captured logits plus the replayed noise reproduce μ (else compare raises)."""
    model, tok = tiny
    noisy = EngineSpec("noise", dtype="float32", logit_noise=0.3)
    m = compare_engines(model, prompts, noisy, FP32_EAGER, CFG, tokenizer=tok, dvp_rhos=None)
    assert m.meta["capture_error_over_tolerance"] < 1.0  # within the float32 rounding of two log-softmaxes
    assert float(m.tokens.kl[m.tokens.mask].mean()) > 1e-3  # σ = 0.3 on every logit is a real mismatch


def test_micro_batches_and_the_dvp_replay(tiny, prompts):
    """A budget too small for one batch: several micro-batches, and the DVP check regenerates them (deterministic)
    — its kept fraction is the grid's at the chosen ρ."""
    model, tok = tiny
    m = compare_engines(model, prompts, EngineSpec(dtype="bfloat16", kv_cache_bits=4), FP32_EAGER, CFG,
                        tokenizer=tok, memory_budget_bytes=300_000)
    assert m.meta["micro_batch_rows"] < len(prompts)
    j = m.dvp.rhos.index(m.dvp.check["rho"])
    inside = m.dvp.inside_trainer[:, j] & m.dvp.inside_rollout[:, j]
    assert m.dvp.check["kept_fraction"] == pytest.approx(float(inside.double().mean()))
    assert m.dvp.check["mass_min"] == pytest.approx(float(m.dvp.mass[:, j].min()), abs=1e-5)


def test_ignore_eos_runs_to_max_new_tokens(sharp, prompts):
    model, tok = sharp
    m = compare_engines(model, prompts, EngineSpec(dtype="bfloat16"), FP32_EAGER, CFG, tokenizer=tok,
                        ignore_eos=True, dvp_rhos=None)
    assert m.tokens.lengths.tolist() == [8] * len(prompts)


def test_bad_arguments(tiny, prompts):
    model, tok = tiny
    spec = EngineSpec(dtype="bfloat16")
    with pytest.raises(ValueError, match="rollout_view"):
        compare_engines(model, prompts, spec, FP32_EAGER, CFG, rollout_view="logits")
    with pytest.raises(ValueError, match="untruncated sampling"):
        compare_engines(model, prompts, spec, FP32_EAGER, SamplingConfig(top_k=5), rollout_view="topk")
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        compare_engines(model, [], spec, FP32_EAGER, CFG)
    with pytest.raises(ValueError, match="topk must be an int"):
        compare_engines(model, prompts, spec, FP32_EAGER, CFG, topk=0)
    with pytest.raises(ValueError, match="penalties"):
        compare_engines(model, prompts, spec, FP32_EAGER, SamplingConfig(repetition_penalty=1.2))
    with pytest.raises(ValueError, match="needs the model's tokenizer or a local model directory"):
        compare_engines(model, prompts, EngineSpec(backend="vllm"), FP32_EAGER, CFG)
    with pytest.raises(ValueError, match="takes dtype and kv_cache_dtype only"):
        compare_engines(model, prompts, EngineSpec(backend="vllm", weight_bits=8), FP32_EAGER, CFG, model_path=".")


def test_without_vllm_one_line_says_how_to_install_it(tiny, prompts, monkeypatch):
    import sys

    model, _ = tiny
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, installed or not
    with pytest.raises(ValueError, match="backend=vllm: VLLMRolloutEngine needs vLLM"):
        compare_engines(model, prompts, EngineSpec(backend="vllm"), FP32_EAGER, CFG, model_path=".")


def test_sample_with_compares_engines_on_identical_sequences(tiny, prompts):
    """--sample-with: the tokens come from one engine; each rollout spec scores those very tokens, so two specs are
    compared position by position (a paired comparison) — and the numbers are each engine's own full forward."""
    model, tok = tiny
    sampler = EngineSpec("fp32", dtype="float32")
    bf16, head = EngineSpec("bf16", dtype="bfloat16"), EngineSpec("fp32-head", dtype="bfloat16", lm_head_fp32=True)
    a = compare_engines(model, prompts, bf16, FP32_EAGER, CFG, tokenizer=tok, sample_with=sampler, dvp_rhos=None)
    b = compare_engines(model, prompts, head, FP32_EAGER, CFG, tokenizer=tok, sample_with=sampler, dvp_rhos=None)
    assert torch.equal(a.tokens.completion_ids, b.tokens.completion_ids) and torch.equal(a.tokens.mask, b.tokens.mask)
    assert torch.equal(a.tokens.trainer_logp, b.tokens.trainer_logp)
    m = a.tokens.mask
    out = build_inspect_engine(model, sampler, tok).generate(prompts, CFG, seed=0)
    assert a.tokens.completion_ids[m].tolist() == sum(out.completion_ids, [])
    engine = build_inspect_engine(model, head, tok)
    logp, _, zr = engine.score(out.prompt_ids, out.completion_ids, CFG, return_logits=True)
    assert torch.equal(b.tokens.rollout_logp[m], logp[out.mask])
    _, _, zt = sequence_logprobs(build_inspect_engine(model, FP32_EAGER).model, out.prompt_ids, out.completion_ids,
                                 return_logits=True)
    torch.testing.assert_close(b.tokens.kl[m], op.token_kl(zr[out.mask], zt[out.mask]))
    assert a.meta["sampled_with"]["name"] == "fp32" and a.meta["capture_max_abs_error"] is None
    with pytest.raises(ValueError, match="sample_with needs"):
        compare_engines(model, prompts, EngineSpec(logit_noise=0.1), FP32_EAGER, CFG, sample_with=sampler)


def test_a_non_finite_row_is_left_out_and_counted():
    """An fp16 overflow (an inf logit) has no envelope: that position is skipped and counted, the others are exact."""
    zt = torch.tensor([[0.0, 1.0, 2.0], [0.5, 0.0, -1.0]])
    zr = zt.clone()
    zr[0, 1] = float("inf")
    s, x = vocabulary_stats(zr, zt, topk=1)
    assert s.skipped_rows == 1 and s.pairs == 3 and sum(s.bin_count) == 3 and s.corrected_violations == 0
    assert math.isnan(x["eps_max"][0]) and x["eps_max"][1] == 0.0
    assert len(s.scatter_p) == 4  # two picks of each kind, from the finite row only


def test_a_bf16_trainer_is_scored_in_bf16_beside_a_bf16_engine(tiny, prompts):
    """The trainer side as a bf16 policy (``--trainer bf16``: its weights bf16, no autocast): scored in its own
    dtype — its log-probs are those of a bf16 forward, not an fp32 one — and the bf16 engine (KV cache) sits far
    closer to it than to the fp32 trainer, whose gap is the dtype's."""
    from offpolicy.inspect.specs import TRAINER_SPECS

    model, tok = tiny
    rollout = EngineSpec("bf16", dtype="bfloat16", attn_implementation="eager")
    bf16_trainer = EngineSpec("bf16-eager", dtype="bfloat16", kv_cache=False, attn_implementation="eager")
    assert TRAINER_SPECS["bf16"].dtype == "bfloat16" and TRAINER_SPECS["bf16"].autocast is None
    same = compare_engines(model, prompts, rollout, bf16_trainer, CFG, tokenizer=tok, dvp_rhos=None)
    mixed = compare_engines(model, prompts, rollout, FP32_EAGER, CFG, tokenizer=tok, dvp_rhos=None)
    t, u = same.tokens, mixed.tokens
    assert torch.equal(t.completion_ids[t.mask], u.completion_ids[u.mask])  # same seed, same engine: same samples
    bf16_model = build_inspect_engine(model, bf16_trainer).model
    assert next(bf16_model.parameters()).dtype == torch.bfloat16
    logp, mask = sequence_logprobs(bf16_model, t.prompt_ids, [r[m].tolist() for r, m in zip(t.completion_ids, t.mask)])
    assert torch.equal(t.trainer_logp[t.mask], logp[mask])  # the bf16 forward itself
    gap_same = float((t.trainer_logp - t.rollout_logp)[t.mask].abs().mean())
    gap_mixed = float((u.trainer_logp - u.rollout_logp)[u.mask].abs().mean())
    assert gap_same < 0.5 * gap_mixed, (gap_same, gap_mixed)


def test_capture_check_passes_rounding_and_names_a_changed_logit():
    """The capture check's tolerance is float32 rounding at the logits' size: an engine that computed μ in float64
    and rounded it passes (|z| ≈ 90, tail tokens: error 7.6e-6 nats); one that moved a logit after its lm_head by
    a few tolerances fails, naming the prompt and the position."""
    from offpolicy.inspect.compare import _check_capture
    from offpolicy.tolerances import log_softmax_tolerance

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 4099, generator=g) * 30
    ids = torch.randint(0, 4099, (2, 5), generator=g)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    exact = torch.log_softmax(logits.double(), -1).gather(-1, ids[..., None]).squeeze(-1).float()
    err, ratio = _check_capture(logits, exact, ids, mask, CFG)
    assert 0 < err and ratio < 1
    tol = log_softmax_tolerance(torch.float32, float(logits[1, 2].abs().max()), 4099)
    moved = exact.clone()
    moved[1, 2] += 5 * tol
    with pytest.raises(ValueError, match=r"prompt 9 position 2 differs by .* nats, above the float32 rounding.*"
                                         r"--rollout-view topk"):
        _check_capture(logits, moved, ids, mask, CFG, first_row=8)
    moved[1, 2] = math.nan  # NaN on one side only
    with pytest.raises(ValueError, match="prompt 1 position 2"):
        _check_capture(logits, moved, ids, mask, CFG)
    moved = exact.clone()
    moved[1, 4] = math.nan  # masked: ignored
    assert _check_capture(logits, moved, ids, mask, CFG)[1] < 1
