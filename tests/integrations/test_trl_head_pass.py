"""One pass over the lm_head for the TRL adapter (offpolicy.integrations.trl.head_pass): the log-probs, entropy, top-k
bounds and score centering's centre it returns equal, value and gradient, those of the separate functions it replaces
(TRL's softmax(z/T) head, replay_logp / replay_entropy, topk_divergence, topk_score_center), whatever the chunking."""

import pytest
import torch

from offpolicy.integrations.trl.head_pass import head_scores
from offpolicy.integrations.trl.replay import ENGINE_ORDERS, ReplayHistory, replay_logp
from offpolicy.integrations.trl.terms import replay_entropy
from offpolicy.integrations.trl.topk import topk_divergence, topk_score_center
from offpolicy.rollout.sampling import SamplingConfig

N, H, V, K = 9, 6, 23, 4
BUDGETS = [2**30, 3 * V * 4 * 40]  # one chunk; three rows per chunk (at most 40 buffers in the pass)


def _problem(seed):
    g = torch.Generator().manual_seed(seed)
    h = (2 * torch.randn(N, H, generator=g)).requires_grad_()
    w = torch.randn(V, H, generator=g).requires_grad_()
    b = torch.randn(V, generator=g).requires_grad_()
    y = torch.randint(0, V, (N,), generator=g)
    mu = torch.log_softmax(torch.randn(N, V, generator=g) * 2, -1)
    top_lp, top_ids = mu.topk(K, -1)
    return h, w, b, y, (top_lp, top_ids)


def _grads(value, params):
    return torch.autograd.grad(value, params, allow_unused=True, retain_graph=True)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_topk_pass_equals_trls_head_the_bounds_and_the_centre(budget, seed, temperature):
    h, w, b, y, top = _problem(seed)
    c1, c2 = torch.randn(N), torch.randn(N)
    s = head_scores(h, w, y, bias=b, temperature=temperature, entropy=True, topk=top, center=True,
                    memory_budget_bytes=budget)
    z = (h @ w.T + b) / temperature
    lp = torch.log_softmax(z, -1)
    ref_logp = lp.gather(-1, y[:, None])[:, 0]
    ref_ent = -(lp.exp() * lp).sum(-1)
    ref_lo, ref_up = topk_divergence(h, w, *top, bias=b, temperature=temperature)
    ref_c = topk_score_center(h, w, *top, bias=b, temperature=temperature)
    torch.testing.assert_close(s.logp, ref_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s.entropy, ref_ent.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close((s.kl_lower, s.kl_upper), (ref_lo, ref_up), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s.center, ref_c, atol=1e-5, rtol=1e-5)
    assert bool(s.inside.all()) and bool((s.mass == 1).all())
    assert not s.entropy.requires_grad and not s.kl_upper.requires_grad
    got = _grads((c1 * s.logp + c2 * s.center).sum(), (h, w, b))
    ref = _grads((c1 * ref_logp + c2 * ref_c).sum(), (h, w, b))
    for g_got, g_ref in zip(got, ref):
        torch.testing.assert_close(g_got, g_ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("budget", BUDGETS)
def test_the_entropy_trains_through_the_pass_when_asked(budget):
    h, w, b, y, top = _problem(2)
    s = head_scores(h, w, y, bias=b, entropy=True, entropy_grad=True, topk=top, memory_budget_bytes=budget)
    lp = torch.log_softmax(h @ w.T + b, -1)
    ref = -(lp.exp() * lp).sum(-1)
    got = _grads((s.logp - 0.3 * s.entropy).sum(), (h, w, b))
    want = _grads((lp.gather(-1, y[:, None])[:, 0] - 0.3 * ref).sum(), (h, w, b))
    for g_got, g_ref in zip(got, want):
        torch.testing.assert_close(g_got, g_ref, atol=1e-5, rtol=1e-4)


RECIPES = [
    dict(top_k=5, top_p=0.9, temperature=0.8),
    dict(top_p=0.7, min_p=0.05),
    dict(top_k=8, repetition_penalty=1.3),
]


@pytest.mark.parametrize("recipe_kw", RECIPES)
@pytest.mark.parametrize("engine", ["hf", "vllm"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_replay_pass_equals_replay_logp_and_replay_entropy(recipe_kw, engine, budget):
    h, w, b, y, top = _problem(3)
    recipe = SamplingConfig(**recipe_kw)
    order = ENGINE_ORDERS[engine]
    history = None
    if recipe.reads_history:  # three sequences of three tokens, the last one padded after its first token
        completion = y.reshape(3, 3)
        mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 0, 0]])
        rows = mask.reshape(-1).nonzero().squeeze(-1)
        history = ReplayHistory([[1, 2], [3], [4, 4]], completion, mask, rows)
        h_rows, y_rows = h[rows], y[rows]
    else:
        h_rows, y_rows = h, y
    s = head_scores(h_rows, w, y_rows, bias=b, recipe=recipe, order=order, history=history, entropy=True,
                    entropy_grad=True, topk=(top[0][:len(y_rows)], top[1][:len(y_rows)]), memory_budget_bytes=budget)
    r = replay_logp(h_rows, w, y_rows, recipe, order=order, bias=b, history=history, memory_budget_bytes=budget)
    e = replay_entropy(h_rows, w, recipe, order=order, bias=b, history=history, memory_budget_bytes=budget)
    torch.testing.assert_close(s.logp, r.logp, atol=1e-5, rtol=1e-5)
    assert torch.equal(s.inside, r.inside)
    torch.testing.assert_close((s.mass, s.entropy), (r.mass, e), atol=1e-5, rtol=1e-5)
    assert s.kl_upper is not None and s.center is None
    got = _grads((s.logp.masked_fill(~s.inside, 0) + 0.5 * s.entropy).sum(), (h, w, b))
    want = _grads((r.logp.masked_fill(~r.inside, 0) + 0.5 * e).sum(), (h, w, b))
    for g_got, g_ref in zip(got, want):
        torch.testing.assert_close(g_got, g_ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("min_p", [None, 0.05])
def test_a_temperature_min_p_recipe_without_topk_keeps_the_fused_kernel(min_p):
    h, w, b, y, _ = _problem(4)
    recipe = SamplingConfig(temperature=0.7, min_p=min_p)
    s = head_scores(h, w, y, bias=b, recipe=recipe, order=ENGINE_ORDERS["vllm"], entropy=True)
    r = replay_logp(h, w, y, recipe, order=ENGINE_ORDERS["vllm"], bias=b)
    torch.testing.assert_close((s.logp, s.mass), (r.logp, r.mass))
    torch.testing.assert_close(s.entropy, replay_entropy(h, w, recipe, order=ENGINE_ORDERS["vllm"], bias=b).detach())


def test_bad_combinations_are_named():
    h, w, b, y, top = _problem(0)
    with pytest.raises(ValueError, match="center"):
        head_scores(h, w, y, center=True)
    with pytest.raises(ValueError, match="entropy_grad"):
        head_scores(h, w, y, entropy_grad=True)


def test_a_bf16_head_gives_the_float32_head_scores():
    # the pass up-casts a 16-bit head to float32 (once when it fits a quarter of the budget, else per chunk): the
    # numbers are those of the float32 copy of the same bf16 weights, either way
    h, w, b, y, top = _problem(5)
    w16 = w.detach().bfloat16()
    ref = head_scores(h.detach(), w16.float(), y, bias=b.detach(), entropy=True, topk=top, center=True)
    for budget in (2**30, 4 * V * H):  # the whole float32 head fits a quarter; only a slice does
        s = head_scores(h.detach(), w16, y, bias=b.detach(), entropy=True, topk=top, center=True,
                        memory_budget_bytes=budget)
        for got, want in zip(s, ref):
            torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=1e-5)
