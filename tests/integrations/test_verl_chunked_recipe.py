"""The verl engine's sampling-recipe log-probs (DVP's min-p set, sampling replay) in row chunks: the values and the
logits' gradient of one pass over the whole ``[N, V]`` logits, at any chunk size, with verl's per-token temperature
and bf16 logits, and without a float32 or tempered copy of the whole logits."""

import pytest
import torch

pytest.importorskip("verl")

from offpolicy.corrections.vocabulary import SUPPORT_ORDER, constrained_logp, replay_support_logp  # noqa: E402
from offpolicy.forward_scores import token_scores  # noqa: E402
from offpolicy.integrations.verl.settings import parse_settings  # noqa: E402

SETTINGS = {"dvp": {"min_p": 0.05}, "replay": {"top_k": 5, "top_p": 0.9}, "both": {"min_p": 0.01, "top_k": 8}}


def _one_pass(logits, labels, t, recipe):
    z = logits.float() / t.reshape(-1, 1)
    if recipe.dvp_only:
        return constrained_logp(z, labels, rho=recipe.min_p).logp
    return replay_support_logp(z, labels, top_k=recipe.top_k, top_p=recipe.top_p, min_p=recipe.min_p,
                               order=SUPPORT_ORDER)[0]


@pytest.mark.parametrize("name", sorted(SETTINGS))
@pytest.mark.parametrize("budget", [2**30, 30 * 4 * 8, 3 * 30 * 4 * 8])  # one chunk; one row; three rows per chunk
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_recipe_log_probs_equal_one_pass(name, budget, dtype):
    g = torch.Generator().manual_seed(0)
    n, vocab = 9, 30
    logits = (3 * torch.randn(n, vocab, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), generator=g)
    t = torch.linspace(0.6, 1.2, n)  # verl's per-token temperature
    coef = torch.randn(n, generator=g)
    settings = parse_settings({"sampling": SETTINGS[name]})
    recipe = settings.sampling.config  # what the engine hands token_scores
    got = token_scores(labels, logits=logits, temperature=t, recipe=recipe, memory_budget_bytes=budget).logp
    (grad,) = torch.autograd.grad((got * coef).sum(), logits)
    ref_logits = logits.detach().clone().requires_grad_()
    want = _one_pass(ref_logits, labels, t, settings.sampling)
    (want_grad,) = torch.autograd.grad((want * coef).sum(), ref_logits)
    torch.testing.assert_close(got, want)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, want_grad)
    scalar = token_scores(labels, logits=logits, temperature=torch.full((n,), 0.8), recipe=recipe,
                          memory_budget_bytes=budget).logp  # one temperature for every row
    torch.testing.assert_close(scalar, _one_pass(logits.detach(), labels, torch.full((n,), 0.8), settings.sampling))
