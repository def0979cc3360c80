"""Staleness of asynchronous rollouts, per token, and the mismatch diagnostics split by it (imports no TRL).

In an asynchronous trainer a sample is sampled by the engine at policy version v_s and trained at the trainer's
version v_θ ≥ v_s; its staleness is d = v_θ − v_s (TRL's ``AsyncGRPOTrainer`` counts versions in weight syncs:
one per ``weight_sync_steps`` optimizer steps). Every completion token of the sample has the sample's d; prompt and
padding tokens have none (−1). The packed layout TRL trains on is flat — ``M`` loss terms, each with the index of
its completion (``segment_id``, non-decreasing, the completion's tokens in order) — so :func:`rows_from_packed` lays
the terms out as ``[S, T]`` rows (one per completion, the mask 0 past its end), the layout
:class:`~offpolicy.LogProbBatch` and every correction read.

:func:`offpolicy.metrics.metrics_by_staleness` logs ``staleness/mean`` and ``staleness/max`` over the valid tokens and, for each
staleness value d present, over its tokens: the mismatch k3 = E[ρ − log ρ − 1] with ρ = π_θ/μ
(:func:`offpolicy.offpolicy_metrics`' ``k3_kl``), and the correction's ``clipped_frac`` (weight ≠ the raw ratio:
truncated or dropped) and ``masked_frac`` (weight 0: dropped), 0 without a correction.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["rows_from_packed", "token_staleness"]


def rows_from_packed(segment_id: Tensor, *values: Tensor, fill: float = 0.0) -> tuple[Tensor, ...]:
    """``(mask, *rows)``: each flat ``[M]`` tensor of ``values`` as ``[S, T]`` rows, S = ``segment_id.max() + 1``
    completions, T = the longest; ``mask`` ``[S, T]`` float 1 on the terms, 0 on the padding (where each row holds
    ``fill``). Differentiable in ``values`` (an index_put).

    >>> mask, rows = rows_from_packed(torch.tensor([0, 0, 1]), torch.tensor([1.0, 2.0, 3.0]))
    >>> mask.tolist(), rows.tolist()
    ([[1.0, 1.0], [1.0, 0.0]], [[1.0, 2.0], [3.0, 0.0]])
    """
    if segment_id.dim() != 1 or segment_id.is_floating_point():
        raise ValueError(f"segment_id must be a 1-D integer tensor, got shape {tuple(segment_id.shape)} "
                         f"dtype {segment_id.dtype}")
    m = segment_id.numel()
    for i, v in enumerate(values):
        if v.shape != (m,):
            raise ValueError(f"values[{i}] has shape {tuple(v.shape)}, expected ({m},) like segment_id")
    if m == 0:
        return (torch.zeros(0, 0),) + tuple(v.new_zeros(0, 0) for v in values)
    if bool((segment_id[1:] < segment_id[:-1]).any()) or int(segment_id[0]) < 0:
        raise ValueError("segment_id must be non-decreasing from 0 (TRL packs each completion's terms in order)")
    s = int(segment_id.max()) + 1
    counts = torch.bincount(segment_id, minlength=s)
    first = torch.cumsum(counts, 0) - counts  # index of each completion's first term
    pos = torch.arange(m, device=segment_id.device) - first[segment_id]
    t = int(counts.max())
    mask = torch.zeros(s, t, device=segment_id.device)
    mask[segment_id, pos] = 1.0
    rows = []
    for v in values:
        row = torch.full((s, t), fill, dtype=v.dtype, device=v.device)
        rows.append(row.index_put((segment_id, pos), v))
    return (mask, *rows)


def token_staleness(sample_version: Tensor, segment_id: Tensor, policy_version: int) -> Tensor:
    """``[M]`` int64 staleness of each loss term: v_θ − the version of the sample it belongs to
    (``sample_version`` ``[S']``, S' ≥ the completions here; a negative entry is padding and may not be referenced).

    >>> token_staleness(torch.tensor([3, 1, -1]), torch.tensor([0, 0, 1, 1]), 4)
    tensor([1, 1, 3, 3])
    """
    versions = sample_version.long()[segment_id]
    if bool((versions < 0).any()):
        raise ValueError("sample_version: a loss term belongs to a sample without a version (padding)")
    staleness = policy_version - versions
    if bool((staleness < 0).any()):
        raise ValueError(f"sample_version: a sample's version is newer than the trainer's ({policy_version}): "
                         f"{int(versions.max())}")
    return staleness
