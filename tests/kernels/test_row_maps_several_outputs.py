"""head_row_map with several differentiable outputs (offpolicy.kernels.row_maps, ``differentiable=d``): the values
and gradients of autograd over the whole logits, whatever the chunking; an output the loss does not use adds nothing;
the backward's recompute can skip the ride-along outputs."""

import pytest
import torch

from offpolicy.kernels.row_maps import head_row_map


def _problem(n=7, hidden=5, vocab=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).requires_grad_()
    w = torch.randn(vocab, hidden, generator=g).requires_grad_()
    bias = torch.randn(vocab, generator=g).requires_grad_()
    y = torch.randint(0, vocab, (n,), generator=g)
    return h, w, bias, y


def _two(z, y):
    """Two differentiable statistics of the same logits (log-prob of y, entropy) and a rider (the max)."""
    lp = torch.log_softmax(z, -1)
    return lp.gather(-1, y[:, None])[:, 0], -(lp.exp() * lp).sum(-1), z.amax(-1)


@pytest.mark.parametrize("budget", [2**30, 11 * 4, 3 * 11 * 4])  # one chunk; one row per chunk; three rows
@pytest.mark.parametrize("seed", [0, 1])
def test_two_differentiable_outputs_equal_autograd_over_the_whole_logits(budget, seed):
    h, w, bias, y = _problem(seed=seed)
    c1, c2 = torch.randn(7, generator=torch.Generator().manual_seed(9)), torch.randn(7)
    logp, ent, zmax = head_row_map(lambda z, a, b: _two(z, y[a:b]), h, w, bias, buffers=1,
                                   memory_budget_bytes=budget, differentiable=2)
    g_got = torch.autograd.grad((c1 * logp + c2 * ent).sum(), (h, w, bias))
    ref_logp, ref_ent, ref_max = _two(h @ w.T + bias, y)
    g_ref = torch.autograd.grad((c1 * ref_logp + c2 * ref_ent).sum(), (h, w, bias))
    torch.testing.assert_close((logp, ent, zmax), (ref_logp, ref_ent, ref_max.detach()))
    for got, ref in zip(g_got, g_ref):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert not zmax.requires_grad


def test_an_output_the_loss_does_not_use_adds_no_gradient():
    # only the entropy (the second output) enters the loss: the gradient is the entropy's alone
    h, w, bias, y = _problem()
    _, ent, _ = head_row_map(lambda z, a, b: _two(z, y[a:b]), h, w, bias, buffers=1, memory_budget_bytes=3 * 11 * 4,
                             differentiable=2)
    (g,) = torch.autograd.grad(ent.sum(), h)
    ref = torch.autograd.grad(_two(h @ w.T + bias, y)[1].sum(), h)[0]
    torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-5)


def test_the_recompute_may_skip_the_riders():
    # fn sees grad enabled in the backward only; the riders it skips there are not needed
    h, w, bias, y = _problem()
    calls = {"forward": 0, "backward": 0}

    def fn(z, a, b):
        logp, ent, zmax = _two(z, y[a:b])
        if torch.is_grad_enabled():
            calls["backward"] += 1
            return logp, ent
        calls["forward"] += 1
        return logp, ent, zmax

    logp, ent, zmax = head_row_map(fn, h, w, bias, buffers=1, memory_budget_bytes=3 * 11 * 4, differentiable=2)
    assert zmax.shape == (7,) and calls == {"forward": 3, "backward": 0}   # 7 rows, 3 per chunk
    (g,) = torch.autograd.grad((logp + ent).sum(), w)
    assert calls["backward"] == 3
    ref = torch.autograd.grad(sum(_two(h @ w.T + bias, y)[:2]).sum(), w)[0]
    torch.testing.assert_close(g, ref, atol=1e-5, rtol=1e-5)


def test_no_differentiable_output_reads_statistics_without_a_gradient():
    h, w, _, _ = _problem()
    w = w.clone().requires_grad_()
    (zmax,) = head_row_map(lambda z, a, b: (z.max(-1).values,), h, w, buffers=1, memory_budget_bytes=3 * 11 * 4,
                           differentiable=0)
    torch.testing.assert_close(zmax, (h @ w.T).max(-1).values.detach())
    assert not zmax.requires_grad  # a rider only, though w requires grad


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_differentiable_is_checked(bad):
    h, w, _, _ = _problem()
    with pytest.raises(ValueError, match="differentiable"):
        head_row_map(lambda z, a, b: (z.sum(-1),), h, w, buffers=1, differentiable=bad)


def test_fewer_outputs_than_differentiable_is_refused():
    h, w, _, _ = _problem()
    with pytest.raises(ValueError, match="differentiable=2"):
        head_row_map(lambda z, a, b: (z.sum(-1),), h, w, buffers=1, differentiable=2)
