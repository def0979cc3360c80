"""What every rollout engine returns and the protocol it follows.

An engine samples completions *and* reports the processed log-probs of the tokens it sampled under its own
numerics — that is μ (``rollout_logp``). The trainer re-scores the same tokens with its own forward (π_old, see
:func:`offpolicy.rollout.scoring.sequence_logprobs`); the difference is the training–inference mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from offpolicy.rollout.sampling import SamplingConfig


@dataclass
class RolloutOutput:
    """One batch of sampled completions.

    * ``prompt_ids``: the prompts as given, ``B`` lists of ids.
    * ``completion_ids``: sampled ids per row, ending with eos if the engine produced it (eos is a valid token:
      it was sampled and its log-prob counts), at most ``max_new_tokens``.
    * ``logp``: ``[B, T]`` float32 processed sampling log-prob of each sampled token, 0 at padding
      (``T`` = longest completion).
    * ``mask``: ``[B, T]`` bool, True for sampled tokens.
    * ``topk_logp`` / ``topk_ids``: ``[B, T, K]`` processed log-probs / ids of the K most likely tokens when
      ``SamplingConfig.logprobs_topk = K > 0`` (0 / id 0 at padding; −inf where fewer than K tokens survive
      truncation), else None.
    * ``texts``: decoded completions (special tokens skipped), or ``""`` when the engine has no tokenizer.
    * ``routed_experts``: for mixture-of-experts models when the engine records routes, one integer tensor
      ``[P_i + C_i − 1, L, k]`` per row — the k experts of each of the L MoE layers at every position the engine
      forwarded (the prompt and the completion but its last token); else None. See :mod:`offpolicy.rollout.routing`.
    * ``sampling``: the recipe the engine applied (every logits processor, its temperature after any floor); with
      ``prompt_ids`` and ``completion_ids`` (the token history each step saw) it is what the trainer scores with.
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logp: Tensor
    mask: Tensor
    topk_logp: Tensor | None = None
    topk_ids: Tensor | None = None
    texts: list[str] | None = None
    routed_experts: list[Tensor] | None = None
    sampling: SamplingConfig | None = None

    def __post_init__(self) -> None:
        b = len(self.prompt_ids)
        if len(self.completion_ids) != b:
            raise ValueError(f"completion_ids has {len(self.completion_ids)} rows, prompt_ids has {b}")
        if self.logp.dim() != 2 or self.logp.shape[0] != b:
            raise ValueError(f"logp must be [B={b}, T], got {tuple(self.logp.shape)}")
        if self.mask.shape != self.logp.shape:
            raise ValueError(f"mask shape {tuple(self.mask.shape)} != logp shape {tuple(self.logp.shape)}")
        for name in ("topk_logp", "topk_ids"):
            t = getattr(self, name)
            if t is not None and tuple(t.shape[:2]) != tuple(self.logp.shape):
                raise ValueError(f"{name} must be [B, T, K] with [B, T] = {tuple(self.logp.shape)}, got {tuple(t.shape)}")
        if self.texts is None:
            self.texts = [""] * b
        if self.routed_experts is not None:
            if len(self.routed_experts) != b:
                raise ValueError(f"routed_experts has {len(self.routed_experts)} rows, prompt_ids has {b}")
            for i, r in enumerate(self.routed_experts):
                if r is not None and r.dim() != 3:
                    raise ValueError(f"routed_experts[{i}] must be [positions, layers, k], got {tuple(r.shape)}")


@runtime_checkable
class RolloutEngine(Protocol):
    """A sampler whose numerics may differ from the trainer's (bf16, KV cache, quantisation, another library).

    ``sync_weights(model)`` copies the trainer's current weights in (then casts/quantises them the engine's way);
    the trainer calls it once per step before ``generate``. ``generate`` is deterministic given ``seed``.
    """

    def sync_weights(self, model: torch.nn.Module) -> None: ...

    def generate(self, prompt_ids: list[list[int]], cfg: SamplingConfig, *, seed: int) -> RolloutOutput: ...


def check_prompt_ids(prompt_ids: list[list[int]], vocab_size: int | None = None) -> None:
    """Validate a batch of prompts (non-empty list of non-empty int lists, ids inside the vocabulary).

    >>> check_prompt_ids([[1, 2], []])
    Traceback (most recent call last):
    ...
    ValueError: prompt_ids[1] is empty: every prompt needs at least one token (e.g. bos)
    """
    if not isinstance(prompt_ids, (list, tuple)) or len(prompt_ids) == 0:
        raise ValueError("prompt_ids must be a non-empty list of token-id lists")
    for i, row in enumerate(prompt_ids):
        if len(row) == 0:
            raise ValueError(f"prompt_ids[{i}] is empty: every prompt needs at least one token (e.g. bos)")
        if vocab_size is not None and (min(row) < 0 or max(row) >= vocab_size):
            raise ValueError(f"prompt_ids[{i}] has an id outside [0, {vocab_size})")


def pad_ids(rows: list[list[int]], pad_id: int, *, side: str = "right") -> tuple[Tensor, Tensor]:
    """Pad id lists to ``[B, L]`` (int64) + bool mask; ``side`` is "left" (generation) or "right" (scoring).

    >>> pad_ids([[5, 6], [7]], 0, side="left")
    (tensor([[5, 6],
            [0, 7]]), tensor([[ True,  True],
            [False,  True]]))
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        if not r:
            continue
        sl = slice(width - len(r), width) if side == "left" else slice(0, len(r))
        ids[i, sl] = torch.tensor(r, dtype=torch.long)
        mask[i, sl] = True
    return ids, mask
