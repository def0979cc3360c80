"""Row-chunked maps over logit rows (offpolicy.kernels.row_maps): the same values and gradients as one pass over all
rows, whatever the chunking, and no tensor as large as the whole logits (or a float32 copy of a 16-bit head)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from offpolicy.kernels.row_maps import head_logits, head_row_map, logits_row_map


class LargestTensor(TorchDispatchMode):
    """The largest tensor (in elements, and in float32 elements) any operator allocates while the mode is on (views
    and aliases of an operator's inputs are not allocations)."""

    def __init__(self):
        super().__init__()
        self.numel = 0
        self.float32_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        storages = {a.untyped_storage().data_ptr() for a in inputs}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in storages:
                self.numel = max(self.numel, t.numel())
                if t.dtype == torch.float32:
                    self.float32_numel = max(self.float32_numel, t.numel())
        return out


def _stats(z, a, b, y):
    """A row statistic with a real gradient (log-prob of y plus entropy) and two riders (the max, an int)."""
    lp = torch.log_softmax(z, -1)
    entropy = -(lp.exp() * lp).sum(-1)
    return lp.gather(-1, y[a:b, None])[:, 0] + entropy, z.amax(-1), torch.full((b - a,), a)


def _problem(dtype=torch.float32, n=7, hidden=5, vocab=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=g).to(dtype).requires_grad_()
    bias = torch.randn(vocab, generator=g).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, (n,), generator=g)
    coef = torch.randn(n, generator=g)
    return h, w, bias, y, coef


@pytest.mark.parametrize("budget", [2**30, 11 * 4, 3 * 11 * 4])  # one chunk; one row per chunk; three rows
@pytest.mark.parametrize("with_bias", [False, True])
def test_head_row_map_equals_one_pass(budget, with_bias):
    h, w, bias, y, coef = _problem()
    b = bias if with_bias else None
    z = h @ w.T + (bias if with_bias else 0)
    want = _stats(z, 0, 7, y)
    want_grads = torch.autograd.grad((want[0] * coef).sum(), (h, w, bias) if with_bias else (h, w))
    got = head_row_map(lambda z, a, c: _stats(z, a, c, y), h, w, b, buffers=1, memory_budget_bytes=budget)
    for x, ref in zip(got[:2], want[:2]):
        torch.testing.assert_close(x, ref)
    assert not got[1].requires_grad
    rows = {2**30: 7, 44: 1, 132: 3}[budget]  # the third rider is each row's chunk start
    assert got[2].tolist() == [rows * (i // rows) for i in range(7)]
    grads = torch.autograd.grad((got[0] * coef).sum(), (h, w, bias) if with_bias else (h, w))
    for x, ref in zip(grads, want_grads):
        torch.testing.assert_close(x, ref)


def test_head_row_map_bf16_head_float32_arithmetic():
    # a bf16 head: logits and ∂W in float32 (one rounding to bf16 at the end), equal to the float32 computation on
    # the up-cast tensors, however many chunks the gradient is summed over
    h, w, _, y, coef = _problem(torch.bfloat16, n=64, vocab=50)
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    want = _stats(h32 @ w32.T, 0, 64, y)[0]
    gh, gw = torch.autograd.grad((want * coef).sum(), (h32, w32))
    got = head_row_map(lambda z, a, c: _stats(z, a, c, y), h, w, buffers=1, memory_budget_bytes=50 * 4)  # 1 row
    torch.testing.assert_close(got[0], want)
    gh_got, gw_got = torch.autograd.grad((got[0] * coef).sum(), (h, w))
    assert gh_got.dtype == gw_got.dtype == torch.bfloat16
    torch.testing.assert_close(gw_got, gw.bfloat16(), rtol=0, atol=0)  # accumulated in float32, rounded once
    torch.testing.assert_close(gh_got, gh.bfloat16(), rtol=0, atol=0)


class UpCasts(TorchDispatchMode):
    """Elements converted from bfloat16 to float32 by the operators run while the mode is on."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) and out.dtype == torch.float32:
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            self.numel += src.numel() if src.dtype == torch.bfloat16 else 0
        return out


@pytest.mark.parametrize("fits", [True, False])
def test_bf16_head_up_cast_once_per_pass_when_it_fits(fits):
    # 16 rows in 16 chunks, a bf16 head [V = 50, H = 5] (1,000 bytes in float32): with a quarter budget ≥ 1,000 bytes
    # the head is up-cast once in the forward and once in the backward; below it, a slice per chunk, three times per
    # chunk (forward, recompute, ∂h) — and the values and gradients are the same either way
    h, w, _, y, coef = _problem(torch.bfloat16, n=16, vocab=50)
    budget = 4 * 1000 if fits else 4 * 999
    buffers = budget // (50 * 4)  # one row per chunk
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    want = _stats(h32 @ w32.T, 0, 16, y)[0]
    gh, gw = torch.autograd.grad((want * coef).sum(), (h32, w32))
    with UpCasts() as fwd:
        got = head_row_map(lambda z, a, c: _stats(z, a, c, y), h, w, buffers=buffers, memory_budget_bytes=budget)[0]
    with UpCasts() as bwd:
        gh_got, gw_got = torch.autograd.grad((got * coef).sum(), (h, w))
    head, rows = w.numel(), h.numel()  # besides the head: the rows h up-cast once per pass (twice in the backward)
    assert (fwd.numel - rows, bwd.numel - 2 * rows) == ((head, head) if fits else (16 * head, 2 * 16 * head))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(gw_got, gw.bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(gh_got, gh.bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("budget", [2**30, 11 * 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_row_map_equals_one_pass(budget, dtype):
    h, w, _, y, coef = _problem()
    logits = (h @ w.T).detach().to(dtype).requires_grad_()
    z32 = logits.detach().float().requires_grad_()
    want = _stats(z32, 0, 7, y)
    (want_grad,) = torch.autograd.grad((want[0] * coef).sum(), z32)
    got = logits_row_map(lambda z, a, c: _stats(z, a, c, y), logits, buffers=1, memory_budget_bytes=budget)
    torch.testing.assert_close(got[0], want[0])
    (grad,) = torch.autograd.grad((got[0] * coef).sum(), logits)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad, want_grad.to(dtype))


def test_no_tensor_as_large_as_the_logits_nor_a_float32_head():
    # N = 128 rows × V = 1000 in chunks of 8 rows, a bf16 head [V, H = 16]: nothing a quarter the size of [N, V]; in
    # the forward no float32 tensor the size of the head (the backward's float32 ∂W accumulator is the gradient)
    n, vocab, hidden = 128, 1000, 16
    h = torch.randn(n, hidden).bfloat16().requires_grad_()
    w = torch.randn(vocab, hidden).bfloat16().requires_grad_()
    y = torch.randint(0, vocab, (n,))
    budget = 8 * vocab * 4 * 3  # 8 rows of 3 buffers
    with LargestTensor() as fwd:
        out = head_row_map(lambda z, a, b: _stats(z, a, b, y), h, w, buffers=3, memory_budget_bytes=budget)[0]
    assert fwd.numel < n * vocab / 4 and fwd.float32_numel < vocab * hidden
    with LargestTensor() as bwd:
        out.sum().backward()
    assert bwd.numel < n * vocab / 4
    logits = torch.randn(n, vocab, requires_grad=True)
    with LargestTensor() as lg:
        (out,) = logits_row_map(lambda z, a, b: (z.logsumexp(-1),), logits, buffers=3, memory_budget_bytes=budget)
        out.sum().backward()
    assert lg.numel == n * vocab  # the logits' own gradient, once; no per-chunk [N, V] zero padding besides it


def test_empty_rows_and_head_logits():
    w = torch.randn(5, 3, requires_grad=True)
    h = torch.zeros(0, 3, requires_grad=True)
    (out,) = head_row_map(lambda z, a, b: (z.logsumexp(-1),), h, w, buffers=1)
    assert out.shape == (0,)
    out.sum().backward()
    assert torch.equal(w.grad, torch.zeros(5, 3))
    x = torch.randn(4, 3).bfloat16()
    wb = torch.randn(300, 3).bfloat16()
    torch.testing.assert_close(head_logits(x, wb), x.float() @ wb.float().T)
