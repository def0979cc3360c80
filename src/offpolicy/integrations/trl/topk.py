"""The vLLM engine's top-k log-probs inside TRL, for Trust Region Masking on the engine's top-k (arXiv 2512.23075).

Asked for ``logprobs=K``, vLLM returns per token its K most likely processed log-probs, sorted by rank, plus the
sampled token's when it is not among them (K or K + 1 entries). TRL 1.16 keeps ``lp[0]`` — the top-1 token's
log-prob, which is the sampled token's only when K = 0. :func:`sampled_token_logprobs` takes the sampled token's
entry by id and keeps the top-K for the divergence; :func:`pad_topk` makes ``[B, T, K]`` tensors that travel in
TRL's batch dict (shuffled and split with it); the scoring forward reads TRM's KL bounds and score centering's centre
off them (:func:`offpolicy.forward_scores.token_scores`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from offpolicy.kernels.chunking import DEFAULT_MEMORY_BUDGET_BYTES
from offpolicy.topk_advice import own_topk_slack

TOPK_LOGP_KEY = "offpolicy_topk_logp"
TOPK_IDS_KEY = "offpolicy_topk_ids"


def _value(x: float | None) -> float:
    return float("nan") if x is None else float(x)


def sampled_token_logprobs(
    logprobs: Sequence[Sequence[Sequence[float | None]]],
    token_ids: Sequence[Sequence[Sequence[int]]],
    completion_ids: Sequence[Sequence[int]],
    k: int,
) -> tuple[list[list[float]], list[list[list[float]]], list[list[list[int]]]]:
    """Split vLLM's per-token log-probs (``(B, T_i, K or K+1)`` lists sorted by rank, as TRL's ``VLLMGeneration``
    returns them) into the sampled token's log-prob ``(B, T_i)`` and the top-``k`` ``(log-probs, ids)``
    ``(B, T_i, ≤ k)``. A missing value (vLLM's NaN, ``None`` in TRL's lists) is NaN for the sampled token (TRL's
    convention: the corrections ignore it) and −inf in the top-k (no mass). A sampled id that is not among the
    returned ids raises ``ValueError`` naming the completion and position.

    >>> # one completion, two tokens, K = 1: token 7 is the top-1; token 4 is sampled outside it (rank 2)
    >>> s, lp, ids = sampled_token_logprobs([[[-0.1], [-0.5, -2.0]]], [[[7], [9, 4]]], [[7, 4]], 1)
    >>> s, lp, ids
    ([[-0.1, -2.0]], [[[-0.1], [-0.5]]], [[[7], [9]]])
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if not (len(logprobs) == len(token_ids) == len(completion_ids)):
        raise ValueError(f"logprobs, token_ids and completion_ids must have one entry per completion, got "
                         f"{len(logprobs)}, {len(token_ids)}, {len(completion_ids)}")
    sampled: list[list[float]] = []
    top_lp: list[list[list[float]]] = []
    top_ids: list[list[list[int]]] = []
    for i, (lps, ids, completion) in enumerate(zip(logprobs, token_ids, completion_ids)):
        if not (len(lps) == len(ids) == len(completion)):
            raise ValueError(f"logprobs: completion {i} has {len(completion)} tokens but {len(lps)} log-prob entries "
                             f"and {len(ids)} id entries")
        row, row_lp, row_ids = [], [], []
        for t, (lp, tid, y) in enumerate(zip(lps, ids, completion)):
            if len(lp) != len(tid):
                raise ValueError(f"logprobs: completion {i} position {t} has {len(lp)} values but {len(tid)} ids")
            try:
                j = list(tid).index(y)
            except ValueError:
                raise ValueError(f"logprob_token_ids: completion {i} position {t}: the sampled id {y} is not among "
                                 f"the returned ids {list(tid)}") from None
            row.append(_value(lp[j]))
            head = min(k, len(tid))
            row_lp.append([(-math.inf if v is None or math.isnan(v) else float(v)) for v in lp[:head]])
            row_ids.append([int(v) for v in tid[:head]])
        sampled.append(row)
        top_lp.append(row_lp)
        top_ids.append(row_ids)
    return sampled, top_lp, top_ids


def pad_topk(top_lp: Sequence[Sequence[Sequence[float]]], top_ids: Sequence[Sequence[Sequence[int]]], width: int,
             k: int, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """``[B, width, k]`` float32 log-probs and int64 ids from ragged lists; unused slots get −inf and an id unused
    in that position (ids stay unique per position, as the divergence kernels require). Padding positions get a
    point mass (log-prob 0) on their first id so that every row is a distribution.

    >>> lp, ids = pad_topk([[[-0.1, -2.5]]], [[[5, 0]]], 2, 3)
    >>> lp.tolist(), ids.tolist()
    ([[[-0.10000000149011612, -2.5, -inf], [0.0, -inf, -inf]]], [[[5, 0, 1], [0, 1, 2]]])
    """
    b = len(top_lp)
    lp = torch.full((b, width, k), -math.inf)
    ids = torch.arange(k).repeat(b, width, 1)
    lp[:, :, 0] = 0.0
    for i, (row_lp, row_ids) in enumerate(zip(top_lp, top_ids)):
        if len(row_lp) > width:
            raise ValueError(f"top_lp: completion {i} has {len(row_lp)} positions, more than width {width}")
        for t, (vals, tid) in enumerate(zip(row_lp, row_ids)):
            used = set(tid)
            spare = [j for j in range(k + len(tid)) if j not in used][: k - len(tid)]
            ids[i, t] = torch.tensor(list(tid) + spare)
            lp[i, t] = torch.tensor(list(vals) + [-math.inf] * (k - len(vals)))
    return lp.to(device), ids.to(device)


@torch.no_grad()
def own_slack_rows(hidden: Tensor, weight: Tensor, rows: Tensor, shape: tuple[int, int], ks: list[int], *,
                   bias: Tensor | None = None, temperature: float = 1.0, max_sequences: int = 8,
                   memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> Tensor:
    """:func:`offpolicy.topk_advice.own_topk_slack` for the first ``max_sequences`` sequences of a ``[B, T]`` batch
    (``shape``) whose valid tokens are the flattened positions ``rows`` with hidden states ``hidden`` [len(rows), H]:
    ``[len(ks), min(B, max_sequences), T]``, 0 at padding.

    >>> # π = (¼, ¼, ½) at every token (h = 1); its top-1 is token 2, the tail's ½ may all sit on a ¼ token:
    >>> # ½ log(½ / ¼) = 0.3466 (the coarse-grained tail ½ log(½ / ½) = 0); top-3 covers everything: 0
    >>> w = torch.tensor([[0.25], [0.25], [0.5]]).log()
    >>> own_slack_rows(torch.ones(3, 1), w, torch.tensor([0, 1, 2]), (2, 2), [1, 3], max_sequences=1)
    tensor([[[0.3466, 0.3466]],
    <BLANKLINE>
            [[0.0000, 0.0000]]])
    """
    b, t = shape
    n_seq = min(b, max_sequences)
    pick = rows < n_seq * t
    z = hidden[pick].float() @ weight.float().T
    if bias is not None:
        z = z + bias.float()
    slack = own_topk_slack(z, ks, temperature=temperature, memory_budget_bytes=memory_budget_bytes)
    out = slack.new_zeros(len(ks), n_seq * t)
    out[:, rows[pick]] = slack.clamp(min=0.0)
    return out.reshape(len(ks), n_seq, t)

