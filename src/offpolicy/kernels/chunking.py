"""How much ``[rows, V]`` float32 scratch fits in a memory budget, and a row-chunked map that keeps no more.

The fused kernels never materialise an ``[N, V]`` logits tensor. The forward takes full-row chunks when enough rows
fit (one pass gives the max, the logsumexp and the min-p safe set, which needs the max first); otherwise — and
always in the backward — it walks 2-D tiles (row block × vocabulary slice) of about ``budget / buffers`` elements,
so that every matmul sees many rows and ∂W is written once per row block instead of once per row chunk.
:func:`checkpointed_row_chunks` serves per-row statistics that autograd differentiates as they are (the adapters'
score-centering centre): it maps a function over row chunks under activation checkpointing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

DEFAULT_MEMORY_BUDGET_BYTES = 256 * 2**20


def chunk_rows(n_rows: int, vocab_size: int, *, buffers: int, itemsize: int = 4,
               memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> int:
    """Rows per chunk so that ``buffers`` live ``[rows, vocab_size]`` tensors fit in ``memory_budget_bytes``.

    Always at least 1 (a single row must fit whatever the budget) and at most ``n_rows`` (≥ 1).

    >>> chunk_rows(2048, 151936, buffers=4)            # 256 MiB / (4 · 151936 · 4 B) = 110.4
    110
    >>> chunk_rows(10, 100, buffers=4)
    10
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be ≥ 1, got {vocab_size}")
    if buffers < 1:
        raise ValueError(f"buffers must be ≥ 1, got {buffers}")
    if memory_budget_bytes <= 0:
        raise ValueError(f"memory_budget_bytes must be > 0, got {memory_budget_bytes}")
    per_row = vocab_size * itemsize * buffers
    return max(1, min(max(n_rows, 1), memory_budget_bytes // per_row))


def row_chunks(n_rows: int, rows_per_chunk: int) -> list[tuple[int, int]]:
    """``[(start, stop), …]`` covering ``range(n_rows)``; the last chunk may be shorter.

    >>> row_chunks(5, 2)
    [(0, 2), (2, 4), (4, 5)]
    """
    if rows_per_chunk < 1:
        raise ValueError(f"rows_per_chunk must be ≥ 1, got {rows_per_chunk}")
    return [(s, min(s + rows_per_chunk, n_rows)) for s in range(0, n_rows, rows_per_chunk)]


def checkpointed_row_chunks(fn: Callable[..., Tensor], rows: Sequence[Tensor], shared: Sequence[Any] = (), *,
                            width: int, buffers: int,
                            memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> Tensor:
    """``fn(*(r[a:b] for r in rows), *shared)`` → ``[b − a]`` over row chunks of the ``rows`` tensors (same first
    dimension N), each chunk sized so that ``buffers`` float32 ``[rows, width]`` tensors fit in the budget and
    recomputed in the backward pass (activation checkpointing: no chunk's ``[rows, width]`` intermediates are kept);
    the chunks' results concatenated → ``[N]`` (an empty float32 tensor for N = 0).

    >>> x = torch.arange(5.0, requires_grad=True)
    >>> y = checkpointed_row_chunks(lambda r, k: r * k, (x,), (3.0,), width=1, buffers=1, memory_budget_bytes=8)
    >>> y.tolist(), torch.autograd.grad(y.sum(), x)[0].tolist()   # chunks of 2 rows: (0, 2), (2, 4), (4, 5)
    ([0.0, 3.0, 6.0, 9.0, 12.0], [3.0, 3.0, 3.0, 3.0, 3.0])
    """
    n = rows[0].shape[0]
    size = chunk_rows(n, width, buffers=buffers, memory_budget_bytes=memory_budget_bytes)
    parts = [checkpoint(fn, *(r[a:b] for r in rows), *shared, use_reentrant=False) for a, b in row_chunks(n, size)]
    return torch.cat(parts) if parts else rows[0].new_zeros(0, dtype=torch.float32)
