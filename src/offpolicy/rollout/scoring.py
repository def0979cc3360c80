"""Training-side scorer: log-probs of given completions under one full forward (no KV cache).

This is how the trainer gets π_old (and π_θ) for the tokens a rollout engine sampled: right-padded batch,
positions 0..L−1 per row, logits cast to float32 and processed with the *same* :class:`SamplingConfig` the engine
used, so that log π_old − log μ measures only the numerical mismatch (the three-policy decomposition of decoupled PPO, arXiv 2110.00641).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from offpolicy.rollout.base import pad_ids
from offpolicy.rollout.decode import cache_keyword
from offpolicy.rollout.routing import replay_routes
from offpolicy.rollout.sampling import SamplingConfig, completion_history, process_logits


def _forward_context(model: torch.nn.Module, dtype: torch.dtype):
    """Run in the model's own dtype, or autocast to a lower precision (bf16/fp16) — never silently upcast."""
    param_dtype = next(model.parameters()).dtype
    if dtype == param_dtype:
        return contextlib.nullcontext()
    if dtype in (torch.bfloat16, torch.float16):
        device_type = next(model.parameters()).device.type
        return torch.autocast(device_type=device_type, dtype=dtype)
    raise ValueError(f"dtype {dtype} cannot be used with a {param_dtype} model (use the model's dtype, bf16 or fp16)")


@functools.cache
def _accepts_logits_to_keep(forward: Callable[..., Any]) -> bool:
    return "logits_to_keep" in inspect.signature(forward).parameters


_cache_keyword = functools.cache(cache_keyword)  # once per model class


def _keeps_logits(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward takes transformers' ``logits_to_keep`` (logits of the last k positions only)."""
    return _accepts_logits_to_keep(type(model).forward)


def score_tokens(model: torch.nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                 cfg: SamplingConfig | None = None, *, dtype: torch.dtype | None = None, return_logits: bool = False,
                 past_key_values_factory=None, routes: list[Tensor | None] | None = None) -> tuple[Tensor, ...]:
    """:func:`sequence_logprobs` with an optional cache factory (the engines use it to replay KV quantisation)."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"prompt_ids has {len(prompt_ids)} rows but completion_ids has {len(completion_ids)}")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("prompt_ids: every prompt needs at least one token")
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype if dtype is None else dtype
    pad_id = getattr(model.config, "pad_token_id", None) or 0
    ids, attn = pad_ids([list(p) + list(c) for p, c in zip(prompt_ids, completion_ids)], pad_id, side="right")
    ids, attn = ids.to(device), attn.to(device)
    t_max = max((len(c) for c in completion_ids), default=0)
    b = len(prompt_ids)
    # Logit at position p_i − 1 + t predicts completion token t of row i.
    p_len = torch.tensor([len(p) for p in prompt_ids], device=device)
    c_len = torch.tensor([len(c) for c in completion_ids], device=device)
    t_idx = torch.arange(t_max, device=device)
    mask = t_idx[None, :] < c_len[:, None]
    src = (p_len[:, None] - 1 + t_idx[None, :]).clamp(max=max(ids.shape[1] - 1, 0))
    targets = torch.gather(ids, 1, (src + 1).clamp(max=max(ids.shape[1] - 1, 0)))
    # A fresh cache per forward only replays the engine's KV quantisation; scoring itself never reuses one.
    if past_key_values_factory is not None:
        kwargs = {_cache_keyword(type(model).forward): past_key_values_factory(), "use_cache": True}
    else:
        kwargs = {"use_cache": False}
    # Only the positions from the shortest prompt's last token on predict completion tokens: the output projection
    # (and its backward) skips the rest — the same logits at the kept positions (up to the matmul's rounding). An
    # index tensor, not an int: the int's slice of the hidden states is non-contiguous, and a matmul on it can copy
    # the weight once per row.
    skip = max(min((len(p) for p in prompt_ids), default=1) - 1, 0)
    if skip > 0 and _keeps_logits(model):
        kwargs["logits_to_keep"] = torch.arange(skip, ids.shape[1], device=device)
    else:
        skip = 0
    replay = replay_routes(model, routes) if routes is not None else contextlib.nullcontext()
    with _forward_context(model, dtype), replay:
        out = model(input_ids=ids, attention_mask=attn.long(), **kwargs)
    # rows × positions by indexing: a copy of whole [V] rows (a gather with a [B, T, V] index reads an index per logit,
    # and its backward scatters per logit — together ~4 ms of the tiny model's 32 × 16 scoring, for the same values)
    logits = out.logits[torch.arange(b, device=device)[:, None], src - skip].float()
    history = None
    if cfg is not None and cfg.reads_history:  # penalties see the prompt and the completion tokens before each one
        history = completion_history(prompt_ids, completion_ids, logits.shape[-1], cfg, device)
    logp_all = process_logits(logits, cfg, history)
    logp = torch.gather(logp_all, -1, targets[..., None]).squeeze(-1)
    logp = torch.where(mask, logp, torch.zeros_like(logp))
    return (logp, mask, logits) if return_logits else (logp, mask)


def sequence_logprobs(model: torch.nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                      cfg: SamplingConfig | None = None, *, dtype: torch.dtype | None = None,
                      return_logits: bool = False, routes: list[Tensor | None] | None = None) -> tuple[Tensor, ...]:
    """Log-probs ``[B, T]`` of ``completion_ids`` given ``prompt_ids`` under one batched full forward.

    Rows are right-padded (positions 0..L−1, the same positions a left-padded engine assigns with
    cumsum(attention_mask) − 1). Logits are cast to float32 and processed with ``cfg`` — the engine's whole recipe
    (bad words, logit bias, penalties over the prompt and the earlier completion tokens, temperature, top-k/p,
    min-p: :func:`process_logits`; ``cfg=None``: plain log-softmax). A sampled token that the processing removed
    gets −inf (the engine could not have sampled it with that config — the caller decides how to treat it).

    ``dtype``: forward precision; None (the default) or the model's own dtype runs the forward as the model is (a bf16
    policy in bf16), bf16/fp16 on an fp32 model autocasts (a mixed-precision trainer). A precision above the model's
    is refused: the weights' lost bits cannot be brought back, and an upcast copy would score another model.
    Gradients flow if the caller did not disable them (π_θ); wrap in ``torch.no_grad()`` for π_old.

    ``routes`` (mixture-of-experts models): one ``[P_i + C_i − 1, L, k]`` tensor per row, e.g. the engine's
    ``RolloutOutput.routed_experts`` — the forward routes each token to the recorded experts, with gate weights from
    this model's own router logits (routing replay, :func:`offpolicy.rollout.routing.replay_routes`; use that
    context manager directly for the flip rate).

    Returns ``(logp [B, T] float32 (0 at padding), mask [B, T] bool)`` and, with ``return_logits=True``, also the
    *raw* float32 logits ``[B, T, V]`` at the same positions (apply :func:`process_logits` for the processed ones,
    e.g. for TRM's exact KL). ``T`` = longest completion.

    >>> from offpolicy.models.tiny import build_tiny_model
    >>> model, tok = build_tiny_model()
    >>> logp, mask = sequence_logprobs(model, [[1, 19, 13], [1, 20]], [[21, 2], [22]])
    >>> logp.shape, mask.tolist(), bool((logp[mask] < 0).all())
    (torch.Size([2, 2]), [[True, True], [True, False]], True)
    """
    return score_tokens(model, prompt_ids, completion_ids, cfg, dtype=dtype, return_logits=return_logits,
                        routes=routes)
