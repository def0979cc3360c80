"""The mismatch by position in the sequence: are late tokens further off-policy than early ones?

Long contexts are where users see the training–inference mismatch grow (a longer KV cache, more accumulated rounding;
Tinker's ``rl_numerics_check`` plots the KL against the depth in the context). This module bins the response
positions t = 0, 1, … (or the context depth, ``start + t``) into doubling bins [0, 8), [8, 16), [16, 32), …
(:func:`position_bin_edges`) and reports, per bin, over its valid tokens (r_t = log π_t − log μ_t):

=======================  ====================================================================================
name                     per bin
=======================  ====================================================================================
``kl``                   mean of log μ − log π            (k1; Tinker's ``kl_sample_train_v1``)
``k2_kl``                mean of ½ r²                     (Tinker's ``kl_sample_train_v2``)
``k3_kl``                mean of e^r − 1 − r              (≥ 0, unbiased for KL(μ‖π) under μ-samples)
``logp_abs_diff_mean``   mean of |r|                      (TRL's ``sampling_logp_difference/mean``)
``kl_exact``             mean of the exact per-token KL(μ‖π) from both logit sets, when given (``token_kl``)
``tokens``               how many valid tokens the bin holds
=======================  ====================================================================================

The same names as :func:`offpolicy.offpolicy_metrics`, so a bin's number reads like the step's. An empty bin reports
the on-policy value 0 (and ``tokens`` 0); a non-finite log-prob leaves its token out. Nothing syncs to the host: the
edges depend on T (a shape) only, so the trainer logs a fixed set of keys per length.

>>> lp = torch.tensor([[-1.0, -1.0, -1.0]]); mu = torch.tensor([[-1.0, -1.5, -2.0]])
>>> p = mismatch_by_position(lp, mu, torch.ones(1, 3), edges=[0, 1, 3])
>>> p.edges, p.stats["kl"].tolist()   # bin [0, 1): r = 0; bin [1, 3): μ − π = (−0.5, −1.0), mean −0.75
([0, 1, 3], [0.0, -0.75])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from offpolicy.batch import check_mask, check_same_shape, check_token_tensor
from offpolicy.ratios import LOG_RATIO_BOUND, as_mask, is_finite, zero_outside

FIRST_BIN = 8  # tokens in the first bin; every later bin is twice the previous one
POSITION_STATS: tuple[str, ...] = ("kl", "k2_kl", "k3_kl", "logp_abs_diff_mean", "kl_exact", "tokens")


def position_bin_edges(length: int, first: int = FIRST_BIN) -> list[int]:
    """Doubling bin edges [0, first, 2·first, 4·first, …] up to the first edge ≥ ``length`` (at least one bin).

    >>> position_bin_edges(200), position_bin_edges(1), position_bin_edges(0)
    ([0, 8, 16, 32, 64, 128, 256], [0, 8], [0, 8])
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be an int >= 0, got {length!r}")
    if isinstance(first, bool) or not isinstance(first, int) or first < 1:
        raise ValueError(f"first must be an int >= 1, got {first!r}")
    edges = [0, first]
    while edges[-1] < length:
        edges.append(edges[-1] * 2)
    return edges


def bin_label(lo: int, hi: int) -> str:
    """The key of the bin [lo, hi): ``pos00016-00031`` (zero-padded, so the keys sort by position).

    >>> bin_label(16, 32)
    'pos00016-00031'
    """
    return f"pos{lo:05d}-{hi - 1:05d}"


@dataclass(frozen=True)
class PositionProfile:
    """Per-bin statistics: ``edges`` (n + 1 ints; bin i is [edges[i], edges[i + 1])), ``stats`` name → [n] float32
    (:data:`POSITION_STATS`; ``kl_exact`` only when the per-token KL was given)."""

    edges: list[int]
    stats: dict[str, Tensor]

    def labels(self) -> list[str]:
        return [bin_label(lo, hi) for lo, hi in zip(self.edges[:-1], self.edges[1:])]


def mismatch_by_position(
    train_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    *,
    token_kl: Tensor | None = None,
    start: Tensor | None = None,
    edges: list[int] | None = None,
) -> PositionProfile:
    """The mismatch per position bin (module docstring) of ``[B, T]`` log-probs of the sampled tokens under the
    training engine (π) and the rollout engine (μ).

    Args:
        train_logp, rollout_logp: ``[B, T]`` log π and log μ (any float dtype; computed in float32).
        mask: ``[B, T]`` 1 for response tokens that count.
        token_kl: optional ``[B, T]`` exact per-token KL(μ‖π) (``offpolicy.token_kl``), binned as ``kl_exact``.
        start: optional ``[B]`` offset of each row's first response token (its prompt length) to bin by depth in
            the context, start + t; default 0 (the position in the response).
        edges: bin edges (increasing ints from 0); default :func:`position_bin_edges` of the deepest position.
    """
    check_token_tensor("train_logp", train_logp)
    check_token_tensor("rollout_logp", rollout_logp)
    check_same_shape("rollout_logp", rollout_logp, "train_logp", train_logp)
    check_mask(mask, train_logp, "train_logp")
    if token_kl is not None:
        check_token_tensor("token_kl", token_kl)
        check_same_shape("token_kl", token_kl, "train_logp", train_logp)
    rows, cols = train_logp.shape
    device = train_logp.device
    position = torch.arange(cols, device=device).expand(rows, cols).contiguous()
    if start is not None:
        if tuple(start.shape) != (rows,):
            raise ValueError(f"start must be [B={rows}] (each row's prompt length), got {tuple(start.shape)}")
        position = position + start.to(device=device, dtype=torch.long)[:, None]
    if edges is None:
        deepest = cols if start is None else cols + (int(start.max()) if rows else 0)
        edges = position_bin_edges(deepest)
    if len(edges) < 2 or edges[0] != 0 or any(b <= a for a, b in zip(edges[:-1], edges[1:])):
        raise ValueError(f"edges must be increasing ints starting at 0, got {edges!r}")
    r = train_logp.detach().float() - rollout_logp.detach().float()
    valid = as_mask(mask) & is_finite(r) & (position < edges[-1])
    r = zero_outside(r, valid)
    n_bins = len(edges) - 1
    # bin i holds edges[i] ≤ position < edges[i + 1]; positions beyond the last edge are left out (valid is False)
    index = torch.bucketize(position, torch.tensor(edges[1:], device=device), right=True).clamp(max=n_bins - 1)
    index = index.flatten()
    weight = valid.flatten().float()

    def per_bin(x: Tensor) -> Tensor:
        return torch.zeros(n_bins, device=device).index_add_(0, index, (x.flatten() * weight))

    tokens = per_bin(torch.ones_like(r))
    n = tokens.clamp(min=1.0)
    r_safe = r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    stats = {
        "kl": per_bin(-r) / n,
        "k2_kl": per_bin(0.5 * r * r) / n,
        "k3_kl": per_bin(torch.expm1(r_safe) - r_safe) / n,
        "logp_abs_diff_mean": per_bin(r.abs()) / n,
    }
    if token_kl is not None:
        kl_valid = valid & is_finite(token_kl)
        stats["kl_exact"] = (torch.zeros(n_bins, device=device).index_add_(
            0, index, zero_outside(token_kl.detach().float(), kl_valid).flatten())
            / per_bin(kl_valid.float()).clamp(min=1.0))
    stats["tokens"] = tokens
    return PositionProfile(list(edges), stats)


def position_metrics(
    train_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    *,
    token_kl: Tensor | None = None,
    prefix: str = "mismatch/by_position/",
    first: int = FIRST_BIN,
) -> dict[str, Tensor]:
    """:func:`mismatch_by_position` as flat 0-d tensors for a metrics log: ``<prefix><stat>/<bin>``, e.g.
    ``mismatch/by_position/k3_kl/pos00016-00031`` (bins from the response length T: fixed keys per T, no host sync).

    >>> m = position_metrics(torch.zeros(1, 9), torch.full((1, 9), -0.1), torch.ones(1, 9))
    >>> sorted(k for k in m if "/k2_kl/" in k), round(m["mismatch/by_position/k2_kl/pos00008-00015"].item(), 4)
    (['mismatch/by_position/k2_kl/pos00000-00007', 'mismatch/by_position/k2_kl/pos00008-00015'], 0.005)
    """
    profile = mismatch_by_position(train_logp, rollout_logp, mask, token_kl=token_kl,
                                   edges=position_bin_edges(train_logp.shape[-1], first))
    return {f"{prefix}{name}/{label}": values[i] for name, values in profile.stats.items()
            for i, label in enumerate(profile.labels())}
