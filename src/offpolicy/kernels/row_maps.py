"""Per-row statistics of full logit rows, one row chunk at a time, differentiated chunk by chunk.

Some statistics need whole ``[rows, V]`` logit rows and are written with ordinary tensor operations that autograd
differentiates (sampling replay's truncated support, score centering's top-K centre). Over ``N`` rows of a 150k
vocabulary they must not build an ``[N, V]`` tensor, and the gradient must not cost more than the logits' own:

* :func:`head_row_map` — from hidden states ``h`` [N, H] and the lm_head ``W`` [V, H] (+ bias): each chunk's logits
  ``z = h Wᵀ + b`` in float32, ``fn(z, a, b)``; the backward recomputes ``z`` per chunk, takes ∂fn/∂z from autograd
  and pushes it through the matmul itself, into one float32 ∂W (and ∂h, ∂b) accumulated in place. (Autograd through
  a checkpointed ``h[a:b] @ W.T`` would allocate a fresh ``[V, H]`` gradient for every chunk, accumulate it in W's
  dtype — bf16 sums lose digits chunk by chunk — and an ``[N, H]`` zero tensor for every slice of ``h``.) A 16-bit
  head is up-cast to float32 (torch on CPU has no matmul with bf16 inputs and a float32 result) at most a quarter
  of the budget at a time: when its whole float32 copy fits in that quarter, once per forward and once per backward
  (:func:`_float32_head`), and the chunks share it; otherwise one vocabulary slice per chunk, never a whole
  ``[V, H]`` float32 copy, which costs V·H conversions per chunk (in the forward, the recompute and ∂h) but no
  memory. Either way the peak is one quarter-budget float32 buffer; the numbers are the same.
* :func:`logits_row_map` — from logits already materialised ``[N, V]`` (verl's engine hands them over): each chunk
  ``fn(logits[a:b], a, b)``; the backward writes each chunk's ∂fn/∂z into one ``[N, V]`` gradient of the logits'
  dtype (the logits' own gradient, which their producer needs anyway), not a zero-padded ``[N, V]`` per chunk.

``fn(z, a, b)`` gets the chunk's float32 logits ``z`` [b − a, V] (differentiable) and its row range, and returns a
tuple whose first entry is the differentiable result ``[b − a]`` and whose other entries (any number, ``[b − a]``,
no gradient) ride along. The maps return the same tuple over all N rows. ``fn`` must be deterministic: the backward
calls it again.

Both maps take ``differentiable=d``: the first ``d`` outputs are differentiable (the backward sums their
contributions into one ∂z per chunk, skipping those whose gradient is None; ``d = 0``: none is), so several
statistics of the same logits — a log-prob, an entropy, a centre — share one head matmul in the forward and one
recompute in the backward.
The forward calls ``fn`` under ``torch.no_grad()`` and the backward with grad enabled, where only the first ``d``
outputs are read: ``fn`` may test ``torch.is_grad_enabled()`` to skip the ride-along outputs in the recompute (it
must then still return at least the ``d`` differentiable ones, in the same order).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from offpolicy.kernels.chunking import DEFAULT_MEMORY_BUDGET_BYTES, chunk_rows, row_chunks

RowFn = Callable[[Tensor, int, int], tuple[Tensor, ...]]


def _slices(weight: Tensor, slice_bytes: int) -> list[tuple[int, int]]:
    """Vocabulary slices of ``weight`` [V, H] whose float32 copy fits in ``slice_bytes``."""
    return row_chunks(weight.shape[0], max(1, slice_bytes // (4 * max(weight.shape[1], 1))))


def _float32_head(weight: Tensor, slice_bytes: int) -> Tensor:
    """``weight`` [V, H] as float32 once for all chunks when that copy fits in ``slice_bytes`` (no more memory than
    one vocabulary slice of the per-chunk path), else ``weight`` itself, which :func:`head_logits` up-casts one slice
    at a time per chunk.

    >>> w = torch.ones(4, 2, dtype=torch.bfloat16)
    >>> _float32_head(w, 32).dtype, _float32_head(w, 31).dtype   # the float32 copy takes 4·2·4 = 32 bytes
    (torch.float32, torch.bfloat16)
    """
    return weight.float() if weight.dtype != torch.float32 and 4 * weight.numel() <= slice_bytes else weight


def head_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None = None, *,
                slice_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES // 4) -> Tensor:
    """``hidden`` [n, H] × ``weight`` [V, H]ᵀ (+ ``bias`` [V]) as float32 [n, V]; a 16-bit ``weight`` is up-cast one
    vocabulary slice of at most ``slice_bytes`` at a time (float32 arithmetic, no float32 copy of the whole head).

    >>> head_logits(torch.ones(1, 2, dtype=torch.bfloat16), torch.tensor([[1.0, 2.0], [3.0, 4.0]]).bfloat16())
    tensor([[3., 7.]])
    """
    h = hidden.float()
    if weight.dtype == torch.float32:
        z = h @ weight.T
    else:
        z = torch.empty(h.shape[0], weight.shape[0], dtype=torch.float32, device=h.device)
        for v0, v1 in _slices(weight, slice_bytes):
            torch.mm(h, weight[v0:v1].float().T, out=z[:, v0:v1])
    return z if bias is None else z.add_(bias.float())


def _outputs(fn: RowFn, z: Tensor, a: int, b: int) -> tuple[Tensor, ...]:
    out = fn(z, a, b)
    if not isinstance(out, tuple) or not out:
        raise ValueError("fn must return a tuple (differentiable [rows], *other [rows])")
    return out


def _joined(ctx, parts: list[tuple[Tensor, ...]], n_diff: int) -> tuple[Tensor, ...]:
    """The chunks' outputs over all rows; those after the first ``n_diff`` marked non-differentiable."""
    outs = tuple(torch.cat(x) for x in zip(*parts))
    if len(outs) < n_diff:
        raise ValueError(f"fn returned {len(outs)} outputs, fewer than differentiable={n_diff}")
    ctx.mark_non_differentiable(*outs[n_diff:])
    return outs


def _wanted(grads: tuple[Tensor | None, ...], n_diff: int) -> list[tuple[int, Tensor]]:
    """(index, gradient) of the differentiable outputs the loss used (None: not used)."""
    return [(i, g) for i, g in enumerate(grads[:n_diff]) if g is not None]


def _chunk_grad(fn: RowFn, z: Tensor, a: int, b: int, wanted: list[tuple[int, Tensor]]) -> Tensor | None:
    """∂(Σ wanted outputs · their gradients)/∂z of one chunk, ``fn`` recomputed on ``z`` (requires grad); None when
    no wanted output depends on ``z`` in this chunk."""
    with torch.enable_grad():
        outs = _outputs(fn, z, a, b)
    used = [(outs[i], g[a:b].to(outs[i].dtype)) for i, g in wanted if outs[i].requires_grad]
    if not used:
        return None
    (gz,) = torch.autograd.grad([o for o, _ in used], z, [g for _, g in used])
    return gz


class _HeadRowMap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, chunks, slice_bytes, n_diff, hidden, weight, bias):
        ctx.set_materialize_grads(False)  # an output the loss does not use sends None: no ∂z term for it
        parts = []
        head = _float32_head(weight, slice_bytes)  # up-cast once for all chunks when it fits in a slice's budget
        for a, b in chunks:
            with torch.no_grad():
                z = head_logits(hidden[a:b], head, bias, slice_bytes=slice_bytes)
                parts.append(_outputs(fn, z, a, b))
        ctx.fn, ctx.chunks, ctx.slice_bytes, ctx.n_diff = fn, chunks, slice_bytes, n_diff
        ctx.save_for_backward(hidden, weight, bias)
        return _joined(ctx, parts, n_diff)

    @staticmethod
    def backward(ctx, *grads):
        hidden, weight, bias = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[4:7]
        wanted = _wanted(grads, ctx.n_diff)
        if not wanted:
            return None, None, None, None, None, None, None
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) \
            if need_b and bias is not None else None
        head = _float32_head(weight, ctx.slice_bytes)  # as in the forward: once, when it fits
        slices = _slices(weight, ctx.slice_bytes)
        for a, b in ctx.chunks:
            z = head_logits(hidden[a:b], head, bias, slice_bytes=ctx.slice_bytes).requires_grad_()
            gz = _chunk_grad(ctx.fn, z, a, b, wanted)
            if gz is None:
                continue
            h = hidden[a:b].float()
            for v0, v1 in slices:
                g = gz[:, v0:v1]
                if grad_h is not None:
                    grad_h[a:b].addmm_(g, head[v0:v1].float())  # .float() of a float32 head: no copy
                if grad_w is not None:
                    grad_w[v0:v1].addmm_(g.T, h)
            if grad_b is not None:
                grad_b += gz.sum(0)
        return (None, None, None, None, None if grad_h is None else grad_h.to(hidden.dtype),
                None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype))


class _LogitsRowMap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, chunks, n_diff, logits):
        ctx.set_materialize_grads(False)  # an output the loss does not use sends None: no ∂z term for it
        parts = []
        for a, b in chunks:
            with torch.no_grad():
                parts.append(_outputs(fn, logits[a:b].float(), a, b))
        ctx.fn, ctx.chunks, ctx.n_diff = fn, chunks, n_diff
        ctx.save_for_backward(logits)
        return _joined(ctx, parts, n_diff)

    @staticmethod
    def backward(ctx, *grads):
        (logits,) = ctx.saved_tensors
        wanted = _wanted(grads, ctx.n_diff)
        if not wanted:
            return None, None, None, None
        grad_z = torch.zeros_like(logits)
        for a, b in ctx.chunks:
            gz = _chunk_grad(ctx.fn, logits[a:b].detach().float().requires_grad_(), a, b, wanted)
            if gz is not None:
                grad_z[a:b] = gz
        return None, None, None, grad_z


def _check_differentiable(differentiable: int) -> None:
    if isinstance(differentiable, bool) or not isinstance(differentiable, int) or differentiable < 0:
        raise ValueError(f"differentiable must be an int >= 0, got {differentiable!r}")


def head_row_map(fn: RowFn, hidden: Tensor, weight: Tensor, bias: Tensor | None = None, *, buffers: int,
                 memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES, differentiable: int = 1) -> tuple[Tensor, ...]:
    """``fn`` over row chunks of the logits ``hidden`` [N, H] × ``weight`` [V, H]ᵀ (+ ``bias``), chunks sized so that
    ``buffers`` float32 ``[rows, V]`` tensors fit in ``memory_budget_bytes``; differentiable w.r.t. ``hidden``,
    ``weight`` and ``bias`` through the first ``differentiable`` outputs (module docstring).

    >>> h = torch.tensor([[1.0], [2.0], [3.0]], requires_grad=True); w = torch.tensor([[1.0], [0.0]])
    >>> lse, zmax = head_row_map(lambda z, a, b: (z.logsumexp(-1), z.amax(-1)), h, w, buffers=1,
    ...                          memory_budget_bytes=8)   # one row per chunk
    >>> zmax.tolist(), torch.autograd.grad(lse.sum(), h)[0].flatten().tolist()  # ∂lse/∂h = softmax(z)·w = σ(h)
    ([1.0, 2.0, 3.0], [0.7310585975646973, 0.8807970285415649, 0.9525741338729858])
    """
    _check_differentiable(differentiable)
    n = hidden.shape[0]
    chunks = row_chunks(n, chunk_rows(n, weight.shape[0], buffers=buffers, memory_budget_bytes=memory_budget_bytes))
    chunks = chunks or [(0, 0)]  # no rows: fn once on an empty chunk gives the outputs' structure
    return _HeadRowMap.apply(fn, chunks, max(memory_budget_bytes // 4, 1), differentiable, hidden, weight, bias)


def logits_row_map(fn: RowFn, logits: Tensor, *, buffers: int,
                   memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES, differentiable: int = 1) -> tuple[Tensor, ...]:
    """``fn`` over row chunks of ``logits`` [N, V] (each chunk up-cast to float32), chunks sized so that ``buffers``
    float32 ``[rows, V]`` tensors fit in ``memory_budget_bytes``; differentiable w.r.t. ``logits`` through the first
    ``differentiable`` outputs, the gradient written chunk by chunk into one tensor like ``logits``.

    >>> z = torch.tensor([[0.0, 0.0], [1.0, 0.0]], requires_grad=True)
    >>> (lse,) = logits_row_map(lambda x, a, b: (x.logsumexp(-1),), z, buffers=1, memory_budget_bytes=8)
    >>> torch.autograd.grad(lse.sum(), z)[0]   # softmax of each row
    tensor([[0.5000, 0.5000],
            [0.7311, 0.2689]])
    """
    _check_differentiable(differentiable)
    n = logits.shape[0]
    chunks = row_chunks(n, chunk_rows(n, logits.shape[1], buffers=buffers, memory_budget_bytes=memory_budget_bytes))
    chunks = chunks or [(0, 0)]  # no rows: fn once on an empty chunk gives the outputs' structure
    return _LogitsRowMap.apply(fn, chunks, differentiable, logits)
