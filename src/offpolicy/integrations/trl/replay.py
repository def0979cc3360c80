"""Sampling replay inside TRL: the trainer scores every completion token under the recipe TRL's engine sampled with.

TRL hands the same recipe to both engines — ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``
(and ``generation_kwargs``) — but the engines apply it in different orders (DVP, arXiv 2512.23087 §3; DeepSeek-V3.2
"keep sampling mask"):

* Hugging Face ``generate``: repetition penalty → temperature → top-k → top-p → min-p
  (:data:`offpolicy.rollout.sampling.TRUNCATION_ORDER`);
* vLLM: penalties (repetition, frequency, presence) → temperature → min-p → top-k / top-p
  (:data:`offpolicy.corrections.vocabulary.SUPPORT_ORDER`).

The replayed log-prob of token y at a position is z_y/T − logsumexp_{a∈S} z_a/T over the support S the engine's
filters leave (after the penalties), i.e. the engine's processed log-prob μ evaluated with the trainer's weights:
:func:`offpolicy.forward_scores.token_scores` computes it from hidden states and the lm_head, given the recipe
(:func:`trl_sampling_recipe`), the engine's filter order (:data:`ENGINE_ORDERS`) and the token history its penalties
read (:class:`ReplayHistory`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from offpolicy.corrections.vocabulary import SUPPORT_ORDER
from offpolicy.rollout.sampling import TRUNCATION_ORDER, SamplingConfig, TokenHistory

# the filter order of each engine TRL can generate with
ENGINE_ORDERS: dict[str, tuple[str, ...]] = {"hf": TRUNCATION_ORDER, "vllm": SUPPORT_ORDER}
# generation_kwargs keys that change the sampling distribution and are not replayed: refused when replay is on
UNREPLAYED_KEYS = frozenset({
    "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h", "no_repeat_ngram_size", "encoder_repetition_penalty",
    "bad_words_ids", "bad_words", "sequence_bias", "logit_bias", "suppress_tokens", "begin_suppress_tokens",
    "min_new_tokens", "min_length", "min_tokens", "allowed_token_ids", "guidance_scale", "logits_processors",
    "structured_outputs", "guided_decoding",
})
_RECIPE_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
_VLLM_ONLY = ("frequency_penalty", "presence_penalty")


def trl_engine(args: Any) -> str:
    """``"vllm"`` when ``args.use_vllm`` (a ``GRPOConfig``), else ``"hf"`` (TRL's ``generate`` path).

    >>> from types import SimpleNamespace as A
    >>> trl_engine(A(use_vllm=True)), trl_engine(A(use_vllm=False))
    ('vllm', 'hf')
    """
    return "vllm" if getattr(args, "use_vllm", False) else "hf"


def trl_sampling_recipe(args: Any) -> SamplingConfig:
    """The recipe TRL hands its engine, from a ``GRPOConfig``: temperature, top-k (0 / −1 = off), top-p (1 = off),
    min-p (None / 0 = off), repetition penalty, and — vLLM only — frequency / presence penalties from
    ``generation_kwargs`` (which override the named fields, as in TRL). A ``generation_kwargs`` key that changes the
    distribution and is not replayed raises ``ValueError`` naming it.

    >>> from types import SimpleNamespace as A
    >>> r = trl_sampling_recipe(A(temperature=0.7, top_k=0, top_p=0.9, min_p=None, repetition_penalty=1.0,
    ...                           max_completion_length=8, use_vllm=False, generation_kwargs={"top_k": 5}))
    >>> r.temperature, r.top_k, r.top_p, r.min_p, r.processors
    (0.7, 5, 0.9, None, ('temperature', 'top_k', 'top_p'))
    """
    engine = trl_engine(args)
    extra = dict(getattr(args, "generation_kwargs", None) or {})
    bad = sorted(k for k in extra if k in UNREPLAYED_KEYS or (engine == "hf" and k in _VLLM_ONLY))
    if bad:
        raise ValueError(f"generation_kwargs: {bad[0]!r} changes the sampling distribution and is not replayed by "
                         "the trainer's scoring; remove it or turn sampling replay off")
    value = {k: extra.get(k, getattr(args, k, None)) for k in _RECIPE_KEYS}
    top_k = value["top_k"]
    top_p = value["top_p"]
    min_p = value["min_p"]
    penalties: dict[str, Any] = {k: float(extra[k]) for k in _VLLM_ONLY if k in extra} if engine == "vllm" else {}
    return SamplingConfig(
        max_new_tokens=int(getattr(args, "max_completion_length", 16) or 16),
        temperature=float(value["temperature"] if value["temperature"] is not None else 1.0),
        top_k=int(top_k) if top_k is not None and top_k > 0 else None,
        top_p=float(top_p) if top_p is not None and top_p < 1.0 else None,
        min_p=float(min_p) if min_p is not None and min_p > 0.0 else None,
        repetition_penalty=float(value["repetition_penalty"] if value["repetition_penalty"] is not None else 1.0),
        **penalties,
    )


@dataclass
class ReplayHistory:
    """The token history the penalties read, for the flattened scored positions of a ``[B, T]`` completion batch.

    ``prompts``: the B prompts as the engine saw them (HF ``generate``: the left-padded row, pad tokens included —
    its repetition penalty sees them; vLLM: the unpadded prompt). ``completion_ids`` / ``completion_mask`` [B, T].
    ``rows`` [N] are the flat indices b·T + t of the positions being scored (row-major).
    """

    prompts: list[list[int]]
    completion_ids: Tensor
    completion_mask: Tensor
    rows: Tensor

    def chunk(self, a: int, b: int, vocab: int) -> TokenHistory:
        """:class:`TokenHistory` ``[b − a, V]`` of scored positions ``rows[a:b]``: prompt tokens seen, and the counts of
        the completion's tokens strictly before each position. Built per chunk (never ``[N, V]``).

        >>> h = ReplayHistory([[3], [0]], torch.tensor([[1, 1, 2], [2, 0, 0]]), torch.tensor([[1, 1, 1], [1, 0, 0]]),
        ...                   torch.tensor([0, 1, 2, 3]))
        >>> c = h.chunk(0, 4, 4)
        >>> c.output_counts.tolist()   # before (0,0): nothing; (0,1): one 1; (0,2): two 1s; (1,0): nothing
        [[0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
        >>> c.prompt_seen[:, 3].tolist(), c.prompt_seen[:, 0].tolist()
        ([True, True, True, False], [False, False, False, True])
        """
        device = self.completion_ids.device
        t_len = self.completion_ids.shape[1]
        rows = self.rows[a:b].to(device)
        bi, ti = rows // t_len, rows % t_len
        width = max((len(p) for p in self.prompts), default=0)
        prompt = torch.full((len(self.prompts), max(width, 1)), vocab, dtype=torch.long, device=device)
        for i, p in enumerate(self.prompts):
            if p:
                prompt[i, : len(p)] = torch.as_tensor(list(p), dtype=torch.long, device=device)
        seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, prompt[bi], True)
        before = torch.arange(t_len, device=device)[None, :] < ti[:, None]
        ids = torch.where(before & self.completion_mask[bi].bool(), self.completion_ids[bi].long(),
                          torch.full((), vocab, dtype=torch.long, device=device))
        counts = torch.zeros(len(rows), vocab + 1, device=device).scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
        return TokenHistory(seen[:, :vocab], counts[:, :vocab])
