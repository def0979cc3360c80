"""Per-layer localisation: where in the network the rollout engine's numbers leave the trainer's.

The same token sequences (prompt + sampled completion) go through both engines in one full forward each, with forward
hooks on the input embeddings, every decoder layer's output, the final norm and the logits. At each hooked point the
relative error over all non-padding positions is

    rel_error = ‖h_μ − h_π‖_F / ‖h_π‖_F

(float64 sums over micro-batches). The first point above ``threshold`` is where the divergence enters; a layer's
*share* is its increase of the relative error over the previous point, as a fraction of all increases — the layer
that adds most is where most of it enters. The rollout engine's forward replays its KV quantisation (a fresh
quantised cache, as :meth:`~offpolicy.rollout.hf.HFRolloutEngine.score` does), so a KV-cache-only engine is
localised to the layers whose cache it quantises.

Default threshold: 1e-3 — above float32 reduction-order noise (~1e-6) by far and below a single bf16 rounding of
the hidden state (2^-9 ≈ 2e-3 relative), so an engine whose parameters are 16-bit is flagged at the embeddings and a
float32 engine that differs in one layer is flagged at that layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from offpolicy.inspect.measurements import LayerError
from offpolicy.kernels import row_chunks
from offpolicy.perturbation import find_decoder_layers
from offpolicy.rollout.base import pad_ids
from offpolicy.rollout.scoring import score_tokens

LAYER_THRESHOLD = 1e-3
_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f")


def hook_points(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``[(name, module)]`` in forward order: ``embed``, ``layer.0`` … ``layer.{L−1}``, ``final_norm`` (when found),
    ``logits``.

    >>> from offpolicy.models.tiny import build_tiny_model
    >>> [name for name, _ in hook_points(build_tiny_model()[0])]
    ['embed', 'layer.0', 'layer.1', 'layer.2', 'layer.3', 'final_norm', 'logits']
    """
    lm: Any = model  # an HF model (torch types module attributes as Tensor | Module)
    points = [("embed", lm.get_input_embeddings())]
    points += [(f"layer.{i}", layer) for i, layer in enumerate(find_decoder_layers(model))]
    base = getattr(model, "base_model", model)
    norm = next((getattr(base, n) for n in _NORM_NAMES if isinstance(getattr(base, n, None), torch.nn.Module)), None)
    if norm is not None:
        points.append(("final_norm", norm))
    points.append(("logits", lm.get_output_embeddings()))
    return points


@contextlib.contextmanager
def _record(model: torch.nn.Module) -> Iterator[dict[str, Tensor]]:
    """Capture each hook point's output (the first element of a tuple output) during one forward."""
    seen: dict[str, Tensor] = {}
    handles = []
    for name, module in hook_points(model):
        def hook(mod, args, out, name=name):
            seen[name] = (out[0] if isinstance(out, (tuple, list)) else out).detach()
        handles.append(module.register_forward_hook(hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def layer_errors(rollout_engine, trainer_engine, prompt_ids: list[list[int]], completion_ids: list[list[int]], *,
                 trainer_autocast: torch.dtype | None = None, rows_per_batch: int = 16) -> list[LayerError]:
    """Relative error at every hook point between the two engines' forwards over prompt + completion sequences.

    ``rollout_engine`` / ``trainer_engine`` are :class:`~offpolicy.rollout.hf.HFRolloutEngine` (their ``model`` is the
    private copy with the engine's numerics). The rollout side runs :meth:`~offpolicy.rollout.hf.HFRolloutEngine.score`
    (its full forward, KV quantisation replayed); the trainer side :func:`~offpolicy.rollout.scoring.score_tokens`
    under ``trainer_autocast`` when given — the same right-padded batch for both.
    """
    if not prompt_ids or len(prompt_ids) != len(completion_ids):
        raise ValueError(f"prompt_ids ({len(prompt_ids)}) and completion_ids ({len(completion_ids)}) must be "
                         "non-empty and of the same length")
    names = [name for name, _ in hook_points(trainer_engine.model)]
    if names != [name for name, _ in hook_points(rollout_engine.model)]:
        raise ValueError("the two engines' models have different layer structures")
    diff_sq = dict.fromkeys(names, 0.0)
    ref_sq = dict.fromkeys(names, 0.0)
    for a, b in row_chunks(len(prompt_ids), max(1, rows_per_batch)):
        prompts, completions = prompt_ids[a:b], completion_ids[a:b]
        _, attn = pad_ids([list(p) + list(c) for p, c in zip(prompts, completions)], 0, side="right")
        with torch.no_grad():
            with _record(rollout_engine.model) as got_r:
                rollout_engine.score(prompts, completions)
            with _record(trainer_engine.model) as got_t:
                score_tokens(trainer_engine.model, prompts, completions, dtype=trainer_autocast)
        for name in names:
            hr, ht = got_r[name], got_t[name]
            for h in (hr, ht):
                if h.shape[0] != attn.shape[0] or h.shape[1] > attn.shape[1]:
                    raise ValueError(f"hook point {name!r} returned shape {tuple(h.shape)}, expected [B, L, ...]")
            # the scoring forwards compute logits only from the first completion position on (the trailing
            # positions): compare the positions both sides returned
            n = min(hr.shape[1], ht.shape[1])
            keep = attn[:, attn.shape[1] - n:]
            hr, ht = hr[:, hr.shape[1] - n:][keep].double(), ht[:, ht.shape[1] - n:][keep].double()
            diff_sq[name] += float((hr - ht).pow(2).sum())
            ref_sq[name] += float(ht.pow(2).sum())
    return [LayerError(name, (diff_sq[name] / ref_sq[name]) ** 0.5 if ref_sq[name] > 0 else 0.0) for name in names]


def first_divergent(layers: list[LayerError], threshold: float = LAYER_THRESHOLD) -> str | None:
    """Name of the first point whose relative error exceeds ``threshold`` (None: the engines agree everywhere).

    >>> first_divergent([LayerError("embed", 0.0), LayerError("layer.0", 2e-7), LayerError("layer.1", 0.03)])
    'layer.1'
    """
    return next((layer.name for layer in layers if layer.rel_error > threshold), None)


def layer_shares(layers: list[LayerError]) -> list[float]:
    """Each point's share of the growth of the relative error: max(0, e_l − e_{l−1}) / Σ of those (e_{−1} = 0).

    >>> layer_shares([LayerError("embed", 0.0), LayerError("layer.0", 0.01), LayerError("layer.1", 0.04)])
    [0.0, 0.25, 0.75]
    """
    steps, prev = [], 0.0
    for layer in layers:
        steps.append(max(0.0, layer.rel_error - prev))
        prev = layer.rel_error
    total = sum(steps)
    return [s / total if total > 0 else 0.0 for s in steps]
