"""Top-K TRM in verl: the rollout's top-K as training-batch tensors, and the certified KL bounds from π_old's logits.

Trust Region Masking (arXiv 2512.23075 §4) masks a sequence when a per-token divergence KL(μ ‖ π) exceeds δ. With the
engine's top-K log-probs of μ only, the divergence is bounded, not known: :func:`offpolicy.topk_kl_lower_bound` (the
(K + 1)-bucket coarse-graining) and :func:`offpolicy.topk_kl_upper_bound` (certified: "keep iff upper ≤ δ" keeps only
sequences that pass the exact test). Both need π's full logits at every response position, which exist in verl only
inside the engine's forward — so the bounds are computed there, in the old-log-prob forward, and travel back as two
more outputs of the forward, laid out as its ``log_probs`` (verl keeps every key of the engine's ``model_output`` and
writes it to the TransferQueue, as it does ``entropy``). The plug-in's trainer then reads them where the advantages
exist and applies ``trm`` with ``token_divergence`` set (:mod:`.driver`).

How the top-K reaches the engine: the agent loop stores it per sample as two tensors ``[prompt + response, K]``
(:func:`sequence_topk`) — the layout of verl's no-padding ``input_ids`` — under :data:`TOPK_IDS_FIELD` /
:data:`TOPK_LOGP_FIELD`; verl's TransferQueue agent loop puts every key of the output's ``as_dict()`` into the
batch, and the training worker's micro-batches carry every field (as they carry ``teacher_logprobs`` for
distillation). Row ``t`` holds the distribution that predicted token ``t + 1`` (the engine's rolled labels), so
response token ``j`` is row ``prompt + j − 1``; the other rows are a point mass (a valid distribution, dropped by
verl's ``response_from_nested`` and the response mask).

This module does not import verl.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from offpolicy.integrations.trl.topk import pad_topk

TOPK_IDS_FIELD = "offpolicy_topk_ids"
TOPK_LOGP_FIELD = "offpolicy_topk_logp"
KL_LOWER_FIELD = "offpolicy_topk_kl_lower"
KL_UPPER_FIELD = "offpolicy_topk_kl_upper"


def sequence_topk(n_prompt: int, ids: Sequence[Sequence[int]], logps: Sequence[Sequence[float]],
                  k: int) -> tuple[Tensor, Tensor]:
    """The response's top-K ``ids`` / ``logps`` (lists of response length × K) as ``(logp, ids)`` tensors
    ``[n_prompt + response length, K]`` (float32, int64) in the engine's rolled layout (see the module docstring).

    >>> lp, ids = sequence_topk(2, [[7, 8], [9, 1]], [[-0.1, -3.0], [-0.2, -4.0]], 2)
    >>> ids.tolist()  # row 1 predicts response token 0, row 2 response token 1; rows 0 and 3 a point mass
    [[0, 1], [7, 8], [9, 1], [0, 1]]
    >>> lp[1].tolist(), lp[0].tolist()
    ([-0.10000000149011612, -3.0], [0.0, -inf])
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if isinstance(n_prompt, bool) or not isinstance(n_prompt, int) or n_prompt < 1:
        raise ValueError(f"n_prompt must be an int >= 1 (a response needs a prompt token before it), got {n_prompt!r}")
    if len(ids) != len(logps):
        raise ValueError(f"ids has {len(ids)} positions but logps {len(logps)}")
    for t, (row_ids, row_lp) in enumerate(zip(ids, logps)):
        if len(row_ids) != len(row_lp) or not 1 <= len(row_ids) <= k or len(set(row_ids)) != len(row_ids):
            raise ValueError(f"top-K position {t}: expected 1..{k} unique ids with one log-prob each, got ids "
                             f"{list(row_ids)} and {len(row_lp)} log-probs")
    width = n_prompt + len(ids)
    lp, top_ids = pad_topk([logps], [ids], width, k)  # response token j at row j, point mass on rows ≥ len(ids)
    # shift so that response token j sits at row n_prompt + j − 1; the point-mass rows wrap to the others
    return lp[0].roll(n_prompt - 1, dims=0), top_ids[0].roll(n_prompt - 1, dims=0)


def point_mass(n: int, k: int) -> tuple[Tensor, Tensor]:
    """``n`` rows of a point mass on id 0 as ``(logp, ids)`` [n, k]: log-probs (0, −inf, …), ids 0…k−1.

    >>> point_mass(1, 3)
    (tensor([[0., -inf, -inf]]), tensor([[0, 1, 2]]))
    """
    logp = torch.full((n, k), float("-inf"))
    logp[:, 0] = 0.0
    return logp, torch.arange(k).expand(n, k).clone()


def topk_rows(logps: Sequence[Tensor], ids: Sequence[Tensor], lengths: Sequence[int],
              padding: Sequence[bool]) -> tuple[Tensor, Tensor]:
    """The micro-batch's per-sample top-K ``[length_i, K]`` concatenated to ``(logp, ids)`` [Σ length_i, K].

    A sample whose top-K has another length than its sequence is accepted only when ``padding[i]`` (no response
    token): verl's synthetic padding samples (``upsample_batch_to_divisible_size``) copy every field of a real sample
    and resize only the ones verl knows; those get a point mass. Any other mismatch is a ``ValueError``.

    >>> lp, ids = topk_rows([torch.zeros(3, 2)], [torch.zeros(3, 2, dtype=torch.long)], [2], [True])
    >>> lp.tolist()
    [[0.0, -inf], [0.0, -inf]]
    """
    out_lp, out_ids = [], []
    for i, (lp, row_ids, n, pad) in enumerate(zip(logps, ids, lengths, padding)):
        if lp.shape != row_ids.shape or lp.ndim != 2:
            raise ValueError(f"{TOPK_LOGP_FIELD} / {TOPK_IDS_FIELD}: sample {i} has shapes {tuple(lp.shape)} and "
                             f"{tuple(row_ids.shape)}; expected [sequence length, K] each")
        if lp.shape[0] != n:
            if not pad:
                raise ValueError(f"{TOPK_IDS_FIELD}: sample {i} has {lp.shape[0]} rows for a sequence of {n} tokens: "
                                 "the top-K must be laid out as the sequence (sequence_topk)")
            lp, row_ids = point_mass(n, lp.shape[1])
        out_lp.append(lp.float().cpu())
        out_ids.append(row_ids.long().cpu())
    return torch.cat(out_lp), torch.cat(out_ids)


__all__ = ["KL_LOWER_FIELD", "KL_UPPER_FIELD", "TOPK_IDS_FIELD", "TOPK_LOGP_FIELD", "point_mass", "sequence_topk",
           "topk_rows"]
