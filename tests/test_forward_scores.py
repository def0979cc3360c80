"""The forward stage in one pass (offpolicy.forward_scores.token_scores): the log-probs, entropy, top-K bounds and
score centering's centre and drift it returns equal, value and gradient, the formulas applied to the whole ``[N, V]`` logits
at once (softmax(z/T), the recipe's support, :mod:`offpolicy.divergence`'s bounds, the centre), whatever the chunking,
from hidden states and the head (TRL) or from the logits (verl), with one temperature or one per row."""

import pytest
import torch

from offpolicy.corrections.vocabulary import SUPPORT_ORDER
from offpolicy.divergence import topk_kl_lower_bound, topk_kl_upper_bound
from offpolicy.forward_scores import penalised, support_entropy, support_scores, token_scores
from offpolicy.integrations.trl.replay import ENGINE_ORDERS, ReplayHistory
from offpolicy.objectives.score_centering import score_center_topk, topk_drift_tv
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
def test_one_pass_equals_the_softmax_the_bounds_and_the_centre(budget, seed, temperature):
    h, w, b, y, top = _problem(seed)
    c1, c2 = torch.randn(N), torch.randn(N)
    s = token_scores(y, hidden=h, weight=w, bias=b, temperature=temperature, entropy=True, topk=top, bounds=True,
                     center=True, memory_budget_bytes=budget)
    logits = h @ w.T + b
    lp = torch.log_softmax(logits / temperature, -1)
    ref_logp = lp.gather(-1, y[:, None])[:, 0]
    ref_ent = -(lp.exp() * lp).sum(-1)
    ref_lo = topk_kl_lower_bound(*top, logits.detach(), temperature=temperature)
    ref_up = topk_kl_upper_bound(*top, logits.detach(), temperature=temperature)
    ref_c = score_center_topk(logits, top[1], top[0], temperature=temperature)
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
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_drift_rides_along_without_changing_the_centre_or_its_gradient(budget, temperature):
    h, w, b, y, top = _problem(3)
    kw = dict(hidden=h, weight=w, bias=b, temperature=temperature, topk=top, center=True, memory_budget_bytes=budget)
    with_drift, plain = token_scores(y, drift=True, **kw), token_scores(y, **kw)
    ref = topk_drift_tv((h @ w.T + b).detach(), top[1], top[0], temperature=temperature)
    torch.testing.assert_close(with_drift.drift, ref, atol=1e-6, rtol=1e-5)
    assert plain.drift is None and not with_drift.drift.requires_grad
    assert bool((with_drift.drift >= 0).all()) and bool((with_drift.drift <= 1 + 1e-6).all())
    torch.testing.assert_close(with_drift.center, plain.center, atol=0, rtol=0)
    got = _grads((with_drift.logp + with_drift.center).sum(), (h, w, b))
    want = _grads((plain.logp + plain.center).sum(), (h, w, b))
    for g_got, g_ref in zip(got, want):
        torch.testing.assert_close(g_got, g_ref, atol=0, rtol=0)
    alone = token_scores(y, hidden=h, weight=w, bias=b, temperature=temperature, topk=top, drift=True,
                         memory_budget_bytes=budget)  # the drift without the centre
    torch.testing.assert_close(alone.drift, ref, atol=1e-6, rtol=1e-5)


def test_the_drift_on_the_engines_own_distribution_is_zero():
    # q = p: the head's q equals π's there, so ½‖q̂ − p‖₁ = 0 (and the head mass is p's)
    h, w, b, y, _ = _problem(4)
    lp = torch.log_softmax((h @ w.T + b).detach(), -1)
    top_lp, top_ids = lp.topk(K, -1)
    s = token_scores(y, hidden=h.detach(), weight=w.detach(), bias=b.detach(), topk=(top_lp, top_ids), center=True,
                     drift=True)
    torch.testing.assert_close(s.drift, torch.zeros(N), atol=1e-6, rtol=0)


@pytest.mark.parametrize("budget", BUDGETS)
def test_the_entropy_trains_through_the_pass_when_asked(budget):
    h, w, b, y, top = _problem(2)
    s = token_scores(y, hidden=h, weight=w, bias=b, entropy=True, entropy_grad=True, topk=top, bounds=True,
                     memory_budget_bytes=budget)
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
    dict(min_p=0.05, temperature=0.7),  # DVP's: no sort
]


@pytest.mark.parametrize("recipe_kw", RECIPES)
@pytest.mark.parametrize("engine", ["hf", "vllm"])
@pytest.mark.parametrize("budget", BUDGETS)
def test_a_recipe_in_one_pass_equals_its_support_on_the_whole_logits(recipe_kw, engine, budget):
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
    n = len(y_rows)
    s = token_scores(y_rows, hidden=h_rows, weight=w, bias=b, recipe=recipe, order=order, history=history,
                     entropy=True, entropy_grad=True, topk=(top[0][:n], top[1][:n]), bounds=True,
                     memory_budget_bytes=budget)
    z = penalised(h_rows @ w.T + b, recipe, None if history is None else history.chunk(0, n, V))
    ref_logp, ref_inside, ref_mass = support_scores(z, y_rows, recipe, order)
    ref_ent = support_entropy(z, recipe, order)
    torch.testing.assert_close(s.logp, ref_logp, atol=1e-5, rtol=1e-5)
    assert torch.equal(s.inside, ref_inside) and not bool(s.inside.all())  # the case is tested: some tokens out
    torch.testing.assert_close((s.mass, s.entropy), (ref_mass, ref_ent), atol=1e-5, rtol=1e-5)
    assert s.kl_upper is not None and s.center is None
    got = _grads((s.logp.masked_fill(~s.inside, 0) + 0.5 * s.entropy).sum(), (h, w, b))
    want = _grads((ref_logp.masked_fill(~ref_inside, 0) + 0.5 * ref_ent).sum(), (h, w, b))
    for g_got, g_ref in zip(got, want):
        torch.testing.assert_close(g_got, g_ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("min_p", [None, 0.05])
def test_a_temperature_min_p_recipe_without_topk_on_the_fused_kernel_equals_the_chunked_pass(min_p):
    h, w, b, y, _ = _problem(4)
    recipe = SamplingConfig(temperature=0.7, min_p=min_p)
    fused = token_scores(y, hidden=h, weight=w, bias=b, recipe=recipe, entropy=True)
    logits = (h @ w.T + b).detach()
    chunked = token_scores(y, logits=logits, recipe=recipe, entropy=True)
    torch.testing.assert_close((fused.logp, fused.mass, fused.entropy), (chunked.logp, chunked.mass, chunked.entropy))
    assert torch.equal(fused.inside, chunked.inside)


@pytest.mark.parametrize("recipe_kw", [None, dict(top_k=5, top_p=0.9), dict(min_p=0.05)])
def test_per_row_temperatures_on_logits_equal_the_logits_divided_first(recipe_kw):
    # verl's engine: logits [N, V] and a temperature per token; the recipe's own temperature is not applied again
    h, w, b, y, top = _problem(6)
    t = torch.linspace(0.6, 1.2, N)
    logits = (h @ w.T + b).detach().requires_grad_()
    recipe = None if recipe_kw is None else SamplingConfig(temperature=0.5, **recipe_kw)
    s = token_scores(y, logits=logits, temperature=t, recipe=recipe, order=SUPPORT_ORDER, topk=top, bounds=True,
                     center=True)
    scaled = logits / t[:, None]
    ref = token_scores(y, logits=scaled, recipe=None if recipe is None else SamplingConfig(temperature=1.0, **recipe_kw),
                       topk=top, bounds=True, center=True)
    for got, want in zip(s, ref):
        torch.testing.assert_close(got, want)
    c = torch.randn(N)
    (g_got,) = _grads((s.logp + c * s.center).sum(), (logits,))
    (g_want,) = _grads((ref.logp + c * ref.center).sum(), (logits,))
    torch.testing.assert_close(g_got, g_want, atol=1e-6, rtol=1e-5)


def test_the_logits_path_equals_the_hidden_state_path():
    h, w, b, y, top = _problem(7)
    recipe = SamplingConfig(top_k=6, top_p=0.9)
    logits = (h @ w.T + b).detach().requires_grad_()
    a = token_scores(y, hidden=h, weight=w, bias=b, recipe=recipe, topk=top, bounds=True, center=True, entropy=True)
    c = token_scores(y, logits=logits, recipe=recipe, topk=top, bounds=True, center=True, entropy=True,
                     memory_budget_bytes=3 * V * 4 * 40)
    for got, want in zip(a, c):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    (g_logits,) = _grads((c.logp + c.center).sum(), (logits,))
    (g_h,) = _grads((a.logp + a.center).sum(), (h,))
    torch.testing.assert_close(g_h, g_logits @ w.detach(), atol=1e-5, rtol=1e-4)  # ∂h = ∂z · W


@pytest.mark.parametrize("budget", BUDGETS)
def test_without_the_logp_the_centre_and_the_bounds_are_the_same(budget):
    """A host that keeps its own log-prob (verl's engine) asks only for the centre or the bounds: the same values and
    gradient, and no log-prob returned."""
    h, w, b, y, top = _problem(4)
    logits = (h @ w.T + b).detach().requires_grad_()
    full = token_scores(y, logits=logits, topk=top, bounds=True, center=True, entropy=True, temperature=0.8,
                        memory_budget_bytes=budget)
    only = token_scores(y, logits=logits, topk=top, bounds=True, center=True, entropy=True, temperature=0.8,
                        logp=False, memory_budget_bytes=budget)
    assert only.logp is None
    for name in ("center", "kl_lower", "kl_upper", "entropy", "inside", "mass"):
        torch.testing.assert_close(getattr(only, name), getattr(full, name), atol=0, rtol=0)
    torch.testing.assert_close(_grads(only.center.sum(), (logits,)), _grads(full.center.sum(), (logits,)))
    with torch.no_grad():  # the bounds alone: nothing differentiable
        bounds = token_scores(y, logits=logits, topk=top, bounds=True, logp=False, temperature=0.8,
                              memory_budget_bytes=budget)
    assert bounds.logp is None and bounds.center is None
    torch.testing.assert_close((bounds.kl_lower, bounds.kl_upper), (full.kl_lower, full.kl_upper), atol=0, rtol=0)


@pytest.mark.parametrize("recipe_kw", [dict(min_p=0.05), dict(top_k=5, top_p=0.9)])
def test_without_the_mass_the_rest_is_the_same(recipe_kw):
    h, w, b, y, top = _problem(5)
    logits = (h @ w.T + b).detach().requires_grad_()
    recipe = SamplingConfig(**recipe_kw)
    full = token_scores(y, logits=logits, recipe=recipe, temperature=torch.full((N,), 0.9))
    lean = token_scores(y, logits=logits, recipe=recipe, temperature=torch.full((N,), 0.9), mass=False)
    assert lean.mass is None and full.mass is not None and bool((full.mass < 1).any())
    assert torch.equal(lean.logp, full.logp) and torch.equal(lean.inside, full.inside)
    torch.testing.assert_close(_grads(lean.logp.sum(), (logits,)), _grads(full.logp.sum(), (logits,)), atol=0, rtol=0)


def test_bad_combinations_are_named():
    h, w, b, y, top = _problem(0)
    with pytest.raises(ValueError, match="topk"):
        token_scores(y, hidden=h, weight=w, center=True)
    with pytest.raises(ValueError, match="topk"):
        token_scores(y, hidden=h, weight=w, bounds=True)
    with pytest.raises(ValueError, match="topk"):
        token_scores(y, hidden=h, weight=w, drift=True)
    with pytest.raises(ValueError, match="entropy_grad"):
        token_scores(y, hidden=h, weight=w, entropy_grad=True)
    with pytest.raises(ValueError, match="logp=False with a recipe"):
        token_scores(y, hidden=h, weight=w, recipe=SamplingConfig(top_k=3), logp=False)
    with pytest.raises(ValueError, match="logits="):
        token_scores(y, hidden=h)
    with pytest.raises(ValueError, match="logits="):
        token_scores(y, logits=h @ w.T, hidden=h, weight=w)
    with pytest.raises(ValueError, match="history"):
        token_scores(y, hidden=h, weight=w, recipe=SamplingConfig(repetition_penalty=1.2))
    with pytest.raises(ValueError, match="temperature"):
        token_scores(y, logits=h @ w.T, temperature=torch.ones(N), recipe=SamplingConfig(repetition_penalty=1.2),
                     history=object())


def test_a_bf16_head_gives_the_float32_head_scores():
    # the pass up-casts a 16-bit head to float32 (once when it fits a quarter of the budget, else per chunk): the
    # numbers are those of the float32 copy of the same bf16 weights, either way
    h, w, b, y, top = _problem(5)
    w16 = w.detach().bfloat16()
    kw = dict(bias=b.detach(), entropy=True, topk=top, bounds=True, center=True, drift=True)
    ref = token_scores(y, hidden=h.detach(), weight=w16.float(), **kw)
    for budget in (2**30, 4 * V * H):  # the whole float32 head fits a quarter; only a slice does
        s = token_scores(y, hidden=h.detach(), weight=w16, memory_budget_bytes=budget, **kw)
        for got, want in zip(s, ref):
            torch.testing.assert_close(got.float(), want.float(), atol=1e-5, rtol=1e-5)
