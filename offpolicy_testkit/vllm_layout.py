"""vLLM's log-prob layout, for stubs of vLLM: the tests' stand-in for TRL's ``VLLMClient`` and the TRL benchmark's
engine client answer in it."""

from __future__ import annotations

from offpolicy.rollout.base import RolloutOutput

__all__ = ["vllm_logprob_lists"]


def vllm_logprob_lists(out: RolloutOutput, k: int) -> tuple[list[list[list[float]]], list[list[list[int]]]]:
    """A rollout's log-probs in the layout TRL's ``VLLMClient.generate`` returns for ``logprobs=k``: per completion,
    per token, the top-``k`` log-probs and ids by rank, then the sampled token when it is not among them (alone when
    ``k`` = 0), as vLLM answers. ``out`` must carry ``topk_logp`` / ``topk_ids`` with at least ``k`` entries when k > 0.

    >>> import torch
    >>> out = RolloutOutput(prompt_ids=[[1]], completion_ids=[[5, 6]], logp=torch.tensor([[-0.1, -2.0]]),
    ...     mask=torch.ones(1, 2, dtype=torch.bool), topk_logp=torch.tensor([[[-0.1], [-0.5]]]),
    ...     topk_ids=torch.tensor([[[5], [7]]]))
    >>> vllm_logprob_lists(out, 1)   # token 6 is not the top-1 at the second position: appended after it
    ([[[-0.10000000149011612], [-0.5, -2.0]]], [[[5], [7, 6]]])
    """
    if k and (out.topk_logp is None or out.topk_ids is None):
        raise ValueError(f"vllm_logprob_lists: k={k} but the rollout has no top-K log-probs (set logprobs_topk)")
    lps, ids = [], []
    for i, completion in enumerate(out.completion_ids):
        row_lp, row_ids = [], []
        for t, y in enumerate(completion):
            top_ids = out.topk_ids[i, t, :k].tolist() if out.topk_ids is not None and k else []
            top_lp = out.topk_logp[i, t, :k].tolist() if out.topk_logp is not None and k else []
            if y not in top_ids:  # vLLM adds the sampled token after the top-K
                top_ids.append(y)
                top_lp.append(float(out.logp[i, t]))
            row_ids.append(top_ids)
            row_lp.append(top_lp)
        lps.append(row_lp)
        ids.append(row_ids)
    return lps, ids
