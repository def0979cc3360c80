"""Every logits processor of the sampling recipe: hand-computed, against HF's own processors, replayed by the trainer
exactly as the engine applied it, and refused where it cannot be replayed."""

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.generation.logits_process import (
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from offpolicy.rollout.hf import HFRolloutEngine
from offpolicy.rollout.sampling import SamplingConfig, TokenHistory, completion_history, process_logits
from offpolicy.rollout.scoring import sequence_logprobs

V = 8


def _history(prompt, completion_so_far, cfg, vocab=V):
    """The history before the next token: start from the prompt, advance through the completion so far."""
    h = TokenHistory.start([prompt], vocab, cfg)
    for tok in completion_so_far:
        h.advance(torch.tensor([tok]), torch.tensor([True]))
    return h


# ---------------------------------------------------------------------------------------------------------------------
# Each processor by hand
# ---------------------------------------------------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    z = torch.tensor([[2.0, -1.0, 0.5, 0.0, 1.0, -2.0, 3.0, 0.0]])
    cfg = SamplingConfig(repetition_penalty=2.0)
    h = _history(prompt=[0, 1], completion_so_far=[2], cfg=cfg)  # seen: 0, 1 (prompt), 2 (completion)
    # processed logits: 2/2 = 1, −1·2 = −2, 0.5/2 = 0.25, the rest unchanged
    expected = torch.log_softmax(torch.tensor([[1.0, -2.0, 0.25, 0.0, 1.0, -2.0, 3.0, 0.0]]), -1)
    torch.testing.assert_close(process_logits(z, cfg, h), expected)


def test_frequency_and_presence_penalties_count_completion_tokens_only():
    z = torch.zeros(1, V)
    cfg = SamplingConfig(frequency_penalty=0.5, presence_penalty=1.0)
    h = _history(prompt=[3, 3, 3], completion_so_far=[1, 1, 2], cfg=cfg)
    # token 1 seen twice: −0.5·2 − 1 = −2; token 2 once: −0.5 − 1 = −1.5; prompt token 3: untouched (vLLM / OpenAI)
    expected = torch.log_softmax(torch.tensor([[0.0, -2.0, -1.5, 0.0, 0.0, 0.0, 0.0, 0.0]]), -1)
    torch.testing.assert_close(process_logits(z, cfg, h), expected)


def test_logit_bias_adds_before_the_penalties_and_temperature():
    z = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    cfg = SamplingConfig(logit_bias={4: 3.0, 6: -1.0}, repetition_penalty=2.0, temperature=0.5)
    h = _history(prompt=[4], completion_so_far=[], cfg=cfg)
    # token 4: (1 + 3) / 2 (seen, positive) = 2, then / T = 4; token 6: (1 − 1) = 0 → 0; the others 1 / 0.5 = 2
    expected = torch.log_softmax(torch.tensor([[2.0, 2.0, 2.0, 2.0, 4.0, 2.0, 0.0, 2.0]]), -1)
    torch.testing.assert_close(process_logits(z, cfg, h), expected)


def test_bad_words_one_token_always_longer_ones_after_their_prefix():
    z = torch.zeros(1, V)
    cfg = SamplingConfig(bad_words_ids=[[7], [1, 2, 5]])
    banned = lambda h: torch.isinf(process_logits(z, cfg, h))[0].nonzero().flatten().tolist()  # noqa: E731
    assert banned(_history(prompt=[0, 1], completion_so_far=[2], cfg=cfg)) == [5, 7]  # "1 2" spans prompt|completion
    assert banned(_history(prompt=[1], completion_so_far=[3], cfg=cfg)) == [7]
    assert banned(_history(prompt=[2], completion_so_far=[], cfg=cfg)) == [7]  # history shorter than the prefix
    # every processed probability is still a distribution
    assert process_logits(z, cfg, _history([0, 1], [2], cfg)).exp().sum().item() == pytest.approx(1.0)


def test_completion_history_is_the_decoding_loops_history_at_every_position():
    cfg = SamplingConfig(repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1, bad_words_ids=[[1, 2, 3]])
    prompts, completions = [[4, 1], [6, 6, 6]], [[2, 3, 2, 1], [1]]
    batch = completion_history(prompts, completions, V, cfg)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        for t in range(len(c)):
            step = _history(p, c[:t], cfg)
            assert torch.equal(batch.prompt_seen[i, 0], step.prompt_seen[0])
            assert torch.equal(batch.output_counts[i, t], step.output_counts[0])
            assert torch.equal(batch.context[i, t], step.context[0])


@pytest.mark.parametrize("cfg", [
    SamplingConfig(repetition_penalty=1.7),
    SamplingConfig(repetition_penalty=0.6),
    SamplingConfig(logit_bias={1: 2.5, 5: -4.0, 7: 0.3}),
    SamplingConfig(bad_words_ids=[[3], [5, 6], [2, 4, 1]]),
    SamplingConfig(logit_bias={2: 1.5}, repetition_penalty=1.4, bad_words_ids=[[0, 4]]),
], ids=["repetition", "repetition<1", "logit-bias", "bad-words", "all-three"])
def test_processors_equal_hf_logits_processors(cfg):
    """HF's RepetitionPenalty / SequenceBias (one-token keys) / NoBadWords, in generate's order, on random logits and
    histories (input_ids = prompt + completion so far, as HF sees them)."""
    g = torch.Generator().manual_seed(0)
    hf = []
    if cfg.logit_bias:
        hf.append(SequenceBiasLogitsProcessor({(k,): b for k, b in cfg.logit_bias}))
    if cfg.repetition_penalty != 1.0:
        hf.append(RepetitionPenaltyLogitsProcessor(cfg.repetition_penalty))
    if cfg.bad_words_ids:
        hf.append(NoBadWordsLogitsProcessor([list(w) for w in cfg.bad_words_ids], eos_token_id=None))
    for _ in range(20):
        seq = torch.randint(0, V, (1, int(torch.randint(1, 9, (1,), generator=g))), generator=g)
        n_prompt = int(torch.randint(1, seq.shape[1] + 1, (1,), generator=g))
        z = 3 * torch.randn(1, V, generator=g)
        expected = z.clone()
        for proc in hf:
            expected = proc(seq, expected)
        ours = process_logits(z, cfg, _history(seq[0, :n_prompt].tolist(), seq[0, n_prompt:].tolist(), cfg))
        torch.testing.assert_close(ours, torch.log_softmax(expected, -1))


# ---------------------------------------------------------------------------------------------------------------------
# Engine → trainer: the reported log-prob is the replayed one, processor by processor
# ---------------------------------------------------------------------------------------------------------------------

RECIPES = {
    "repetition_penalty": SamplingConfig(max_new_tokens=10, repetition_penalty=1.8),
    "presence_penalty": SamplingConfig(max_new_tokens=10, presence_penalty=1.5),
    "frequency_penalty": SamplingConfig(max_new_tokens=10, frequency_penalty=0.8),
    "logit_bias": SamplingConfig(max_new_tokens=10, logit_bias={3: 2.0, 9: -3.0, 17: 1.0}),
    "bad_words": SamplingConfig(max_new_tokens=10, bad_words_ids=[[5], [11], [7, 8], [20, 21, 22]]),
    "temperature": SamplingConfig(max_new_tokens=10, temperature=0.6),
    "top_k": SamplingConfig(max_new_tokens=10, top_k=5),
    "top_p": SamplingConfig(max_new_tokens=10, top_p=0.8),
    "min_p": SamplingConfig(max_new_tokens=10, min_p=0.1),
    "everything": SamplingConfig(max_new_tokens=10, repetition_penalty=1.3, presence_penalty=0.4,
                                 frequency_penalty=0.3, logit_bias={3: 1.0}, bad_words_ids=[[5], [7, 8]],
                                 temperature=0.8, top_k=12, top_p=0.95),
}


@pytest.fixture(scope="module")
def peaked():
    """A tiny random Qwen2 with a peaked next-token distribution (larger init), so repeats and bans happen."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                                         eos_token_id=None, pad_token_id=0))
    return model.eval()


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_fp32_engine_reported_logprob_is_the_trainers_replayed_logprob(peaked, name):
    cfg = RECIPES[name]
    assert name == "everything" or cfg.processors == (name,)
    prompts = [[1, 3, 3, 9], [2, 7], [4, 4, 4, 4, 6]]
    out = HFRolloutEngine(peaked, dtype="float32", pad_token_id=0).generate(prompts, cfg, seed=1)
    assert out.sampling == cfg  # the engine reports the recipe it applied
    with torch.no_grad():
        replayed, mask = sequence_logprobs(peaked, prompts, out.completion_ids, out.sampling)
        plain, _ = sequence_logprobs(peaked, prompts, out.completion_ids, SamplingConfig(max_new_tokens=10))
    torch.testing.assert_close(replayed[mask], out.logp[mask], rtol=0, atol=2e-5)
    assert (plain[mask] - out.logp[mask]).abs().max() > 1e-3  # the processor changed μ: scoring without it is biased
    if name == "bad_words":
        flat = [t for c in out.completion_ids for t in c]
        assert 5 not in flat and 11 not in flat


def test_penalties_see_the_history_a_repeated_token_pays_more():
    cfg = SamplingConfig(max_new_tokens=4, frequency_penalty=1.0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    prompts, completions = [[1, 2]], [[5, 5, 5]]
    with torch.no_grad():
        _, _, logits = sequence_logprobs(model, prompts, completions, return_logits=True)
        lp, _ = sequence_logprobs(model, prompts, completions, cfg)
    # at t, token 5 has been sampled t times: its processed logit is z − t, normalised over the penalised vocabulary
    for t in range(3):
        z = logits[0, t].clone()
        z[5] -= t
        assert lp[0, t].item() == pytest.approx(torch.log_softmax(z, -1)[5].item(), abs=1e-5)


# ---------------------------------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg, name", [
    (SamplingConfig(repetition_penalty=1.2), "repetition_penalty"),
    (SamplingConfig(presence_penalty=0.5), "presence_penalty"),
    (SamplingConfig(frequency_penalty=0.5), "frequency_penalty"),
    (SamplingConfig(bad_words_ids=[[1, 2]]), "bad_words"),
])
def test_a_history_processor_without_the_history_is_refused_by_name(cfg, name):
    with pytest.raises(ValueError, match=f"^{name} reads the token history"):
        process_logits(torch.zeros(2, V), cfg)


def test_config_validation_names_the_processor():
    for kwargs, name in [
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: math.inf}}, "logit_bias"),
        ({"logit_bias": [(1, 1.0), (1, 2.0)]}, "logit_bias"),
        ({"bad_words_ids": [[]]}, "bad_words_ids"),
        ({"bad_words_ids": "abc"}, "bad_words_ids"),
        ({"bad_words_ids": [[1, -2]]}, "bad_words_ids"),
    ]:
        with pytest.raises(ValueError, match=name):
            SamplingConfig(**kwargs)
    with pytest.raises(ValueError, match="token id 9, outside the vocabulary of 8"):
        process_logits(torch.zeros(1, V), SamplingConfig(logit_bias={9: 1.0}))
    assert SamplingConfig(logit_bias={5: 1, 2: -1.0}).logit_bias == ((2, -1.0), (5, 1.0))  # hashable, sorted


def _replayed(logits, targets, cfg, history):
    """(logp, inside) of TRL's replay on whole logits: replay_support_logp with the recipe."""
    from offpolicy.corrections.vocabulary import replay_support_logp

    return replay_support_logp(logits, targets, recipe=cfg, history=history)


def _one_pass(logits, targets, cfg, history):
    """(logp, inside) of every host's one-pass scoring, token_scores, in HF's filter order (a banned word is inside
    its support at −inf: counted outside here, as process_logits's −inf is)."""
    from offpolicy.forward_scores import token_scores
    from offpolicy.rollout.sampling import TRUNCATION_ORDER

    vocab = logits.shape[-1]
    s = token_scores(targets.reshape(-1), logits=logits.reshape(-1, vocab), recipe=cfg, order=TRUNCATION_ORDER,
                     history=history if cfg.reads_history else None)
    assert s.logp is not None
    return s.logp.reshape(targets.shape), (s.inside & torch.isfinite(s.logp)).reshape(targets.shape)


@pytest.mark.parametrize("score", [_replayed, _one_pass], ids=["replay_support_logp", "token_scores"])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_replayed_recipe_is_process_logits_at_the_targets(name, score):
    cfg = RECIPES[name]
    g = torch.Generator().manual_seed(2)
    prompts, completions = [[1, 3, 3, 9], [2, 7, 8]], [[3, 7, 8, 20, 21], [9, 9, 4]]
    logits = (2 * torch.randn(2, 5, 32, generator=g)).requires_grad_(True)
    history = completion_history(prompts, completions, 32, cfg)
    targets = torch.tensor([[3, 7, 8, 20, 22], [9, 9, 4, 0, 0]])
    logp, inside = score(logits, targets, cfg, history)
    expected = process_logits(logits, cfg, history).gather(-1, targets[..., None]).squeeze(-1)
    assert torch.equal(inside, torch.isfinite(expected))
    torch.testing.assert_close(logp[inside], expected[inside])
    # the gradient reaches the logits through the processors, as the engine's processing would pass it
    (grad,) = torch.autograd.grad(logp[inside].sum(), logits)
    torch.testing.assert_close(grad, torch.autograd.grad(expected[inside].sum(), logits)[0])


def test_replay_support_logp_refuses_a_recipe_beside_its_own_settings():
    from offpolicy.corrections.vocabulary import replay_support_logp

    cfg = RECIPES["top_k"]
    with pytest.raises(ValueError, match="recipe carries temperature"):
        replay_support_logp(torch.zeros(1, 32), torch.zeros(1, dtype=torch.long), recipe=cfg, top_k=3)


def test_a_history_chunk_is_the_flattened_rows_of_the_history():
    cfg = SamplingConfig(frequency_penalty=1.0, bad_words_ids=[[3, 5]])
    h = completion_history([[1, 3], [2]], [[3, 5, 6], [4]], V, cfg)  # [B, T] = [2, 3]; prompt_seen is [2, 1, V]
    c = h.chunk(2, 5, V)  # rows (0, 2), (1, 0), (1, 1)
    assert torch.equal(c.output_counts, h.output_counts.reshape(-1, V)[2:5])
    assert torch.equal(c.prompt_seen, h.prompt_seen.expand(2, 3, V).reshape(-1, V)[2:5])
    assert torch.equal(c.context, h.context.reshape(-1, h.context.shape[-1])[2:5])
    with pytest.raises(ValueError, match="vocabulary of 8, the logits have 9"):
        h.chunk(0, 1, 9)
