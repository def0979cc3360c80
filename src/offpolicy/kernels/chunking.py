"""How much ``[rows, V]`` float32 scratch fits in a memory budget, and the row chunks that keep to it.

The fused kernels never materialise an ``[N, V]`` logits tensor. The forward takes full-row chunks when enough rows
fit (one pass gives the max, the logsumexp and the min-p safe set, which needs the max first); otherwise — and
always in the backward — it walks 2-D tiles (row block × vocabulary slice) of about ``budget / buffers`` elements,
so that every matmul sees many rows and ∂W is written once per row block instead of once per row chunk.
Per-row statistics that autograd differentiates as they are (sampling replay, the score-centering centre) map over
row chunks in :mod:`offpolicy.kernels.row_maps`.
"""

from __future__ import annotations

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
