import pytest
import torch

from offpolicy.rollout.sampling import SamplingConfig
from offpolicy.rollout.scoring import sequence_logprobs


def _row_by_row(model, prompt, completion, temperature=1.0):
    """Reference: one unpadded sequence, log_softmax(z / T)[next token] at each completion position."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)
    return torch.stack([lp[len(prompt) - 1 + t, completion[t]] for t in range(len(completion))])


def test_ragged_batch_matches_row_by_row(tiny):
    model, _ = tiny
    prompts = [[1, 19, 20, 13, 21], [1, 22], [1, 23, 24, 25, 26, 27, 28]]
    completions = [[30, 31, 2], [40], []]
    with torch.no_grad():
        logp, mask = sequence_logprobs(model, prompts, completions)
    assert logp.shape == (3, 3) and logp.dtype == torch.float32
    assert mask.tolist() == [[True, True, True], [True, False, False], [False, False, False]]
    for i, (p, c) in enumerate(zip(prompts, completions)):
        if c:
            torch.testing.assert_close(logp[i, : len(c)], _row_by_row(model, p, c), atol=1e-5, rtol=0)
    assert (logp[~mask] == 0).all()


def test_processing_is_applied(tiny):
    model, _ = tiny
    p, c = [[1, 19, 13, 20, 31]], [[21, 22, 2]]
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, p, c, SamplingConfig(temperature=0.5))
    torch.testing.assert_close(logp[0], _row_by_row(model, p[0], c[0], temperature=0.5), atol=1e-5, rtol=0)
    # a token outside a top-1 support gets −inf (the engine could not have sampled it)
    with torch.no_grad():
        lp_all, _, logits = sequence_logprobs(model, p, c, return_logits=True)
        top1 = logits[0].argmax(-1)
        other = [[int((top1[0] + 1) % logits.shape[-1])]]
        lp_k1, _ = sequence_logprobs(model, p, other, SamplingConfig(top_k=1))
    assert lp_k1[0, 0].item() == float("-inf")


def test_return_logits_are_raw_float32(tiny):
    model, _ = tiny
    logp, mask, logits = sequence_logprobs(model, [[1, 19]], [[20, 21]], SamplingConfig(temperature=2.0), return_logits=True)
    assert logits.shape == (1, 2, model.config.vocab_size) and logits.dtype == torch.float32
    # processed log-prob of the sampled token from the raw logits: log_softmax(z / 2)
    torch.testing.assert_close(logp[0, 0], torch.log_softmax(logits[0, 0] / 2.0, -1)[20])


def test_gradient_flows(tiny):
    model, _ = tiny
    logp, mask = sequence_logprobs(model, [[1, 19, 20]], [[21, 2]])
    logp.sum().backward()
    grad = model.model.embed_tokens.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_bf16_autocast_differs_but_is_close(tiny):
    model, _ = tiny
    with torch.no_grad():
        fp32, _ = sequence_logprobs(model, [[1, 19, 20]], [[21, 22, 2]])
        bf16, _ = sequence_logprobs(model, [[1, 19, 20]], [[21, 22, 2]], dtype=torch.bfloat16)
    diff = (fp32 - bf16).abs().max()
    assert 0 < diff < 0.1


def test_bad_input_names_argument(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="completion_ids"):
        sequence_logprobs(model, [[1]], [[2], [3]])
    with pytest.raises(ValueError, match="prompt_ids"):
        sequence_logprobs(model, [[]], [[2]])
    with pytest.raises(ValueError, match="dtype"):
        sequence_logprobs(model, [[1]], [[2]], dtype=torch.float64)
