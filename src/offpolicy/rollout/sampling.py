"""Sampling configuration and logit processing: the *processed* distribution a rollout engine samples from.

The behaviour policy μ of an RL rollout is not the model's softmax but the distribution after temperature and
truncation (top-k / top-p / min-p). vLLM returns exactly this with ``logprobs_mode="processed_logprobs"``; HF's
``generate`` applies the same warpers in the same order (temperature → top-k → top-p → min-p). Importance ratios
must compare the trainer's log-probs against *this* μ, processed the same way on the trainer side, otherwise the
truncation itself shows up as (large, biased) "mismatch" (DVP, seed 000 §3; DeepSeek-V3.2 "keep sampling mask").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingConfig:
    """How a rollout engine samples; validated on construction (``ValueError`` naming the argument).

    ``logprobs_topk`` = K > 0 also returns the K most likely processed log-probs (and ids) at every step — what
    TRM's exact-KL fallback and sampling-support replay need.

    >>> SamplingConfig(temperature=0.7, top_p=0.9).top_p
    0.9
    >>> SamplingConfig(top_k=0)
    Traceback (most recent call last):
    ...
    ValueError: top_k must be None or an int >= 1, got 0
    """

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    logprobs_topk: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a finite float > 0, got {self.temperature!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be None or an int >= 1, got {self.top_k!r}")
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be None or in (0, 1], got {self.top_p!r}")
        if self.min_p is not None and not (isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be None or in [0, 1], got {self.min_p!r}")
        if isinstance(self.logprobs_topk, bool) or not isinstance(self.logprobs_topk, int) or self.logprobs_topk < 0:
            raise ValueError(f"logprobs_topk must be an int >= 0, got {self.logprobs_topk!r}")


def process_logits(logits: Tensor, cfg: SamplingConfig | None = None) -> Tensor:
    """Processed sampling log-probs ``[..., V]`` (float32) from raw logits ``[..., V]``.

    Order and tie rules follow HF's logits warpers (and vLLM's sampler): divide by temperature; top-k keeps every
    token whose logit is ≥ the k-th largest; top-p keeps the smallest most-likely set with mass ≥ p (the token that
    crosses p is kept, at least one token always); min-p keeps p(a) ≥ min_p · max_b p(b). Removed tokens get −inf,
    then ``log_softmax``. ``cfg=None`` means plain ``log_softmax`` (temperature 1, no truncation).

    No host sync and no branching on tensor values (config branches only), so it compiles with fullgraph.

    >>> z = torch.tensor([2.0, 1.0, 0.0, -1.0])
    >>> process_logits(z, SamplingConfig(top_k=2)).exp()  # softmax of [2, 1]: e/(e+1), 1/(e+1)
    tensor([0.7311, 0.2689, 0.0000, 0.0000])
    """
    x = logits.float()
    if cfg is None:
        return torch.log_softmax(x, dim=-1)
    if cfg.temperature != 1.0:
        x = x / cfg.temperature
    neg_inf = torch.tensor(float("-inf"), dtype=x.dtype, device=x.device)
    if cfg.top_k is not None and cfg.top_k < x.shape[-1]:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x = torch.where(x < kth, neg_inf, x)
    if cfg.top_p is not None and cfg.top_p < 1.0:
        # Ascending sort: drop a token iff the mass at or below it is ≤ 1 − top_p (HF / vLLM formula).
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= 1.0 - cfg.top_p
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = torch.where(drop, neg_inf, x)
    if cfg.min_p is not None and cfg.min_p > 0.0:
        # p(a) ≥ min_p · p_max  ⇔  z_a ≥ z_max + log(min_p)  (the normaliser cancels)
        z_max = x.max(dim=-1, keepdim=True).values
        x = torch.where(x < z_max + math.log(cfg.min_p), neg_inf, x)
    return torch.log_softmax(x, dim=-1)


def sample_tokens(logp: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Draw one token per row from processed log-probs ``[B, V]`` → ids ``[B]`` (int64), seeded by ``generator``.

    >>> g = torch.Generator().manual_seed(0)
    >>> sample_tokens(torch.log(torch.tensor([[0.0, 1.0, 0.0]])), g)
    tensor([1])
    """
    return torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)


def topk_logprobs(logp: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest processed log-probs and their ids, ``[..., k]`` each (−inf where fewer than k survive).

    >>> topk_logprobs(torch.tensor([[-2.0, -0.5, -1.0]]), 2)
    (tensor([[-0.5000, -1.0000]]), tensor([[1, 2]]))
    """
    values, ids = torch.topk(logp, k, dim=-1)
    return values, ids
