"""Routing flips as a measured mismatch: where a mixture-of-experts rollout engine routes a token to other experts
than the trainer's forward does, and what that costs in KL.

A MoE router picks each token's top-k experts; at a near-tie of two router logits, the rollout engine's numerics
(bf16 against the trainer's fp32) can pick the other expert — a *routing flip*, which swaps a whole expert MLP in
that token's hidden state instead of perturbing it by rounding (arXiv 2510.11370 §2; arXiv 2512.23075 names it among
the mismatch sources). ``offpolicy inspect`` on an MoE model records both sides' routes (the engine's with
:class:`~offpolicy.rollout.routing.RouteRecorder` during generation, the trainer's during its scoring forward) and
measures:

* the **flip rate per MoE layer** ℓ: the share of routed token slots (every position the engine forwarded — the
  prompt and all completion tokens but the last) whose top-k expert *set* differs between the two sides,
  flips_ℓ / routed_ℓ — the same count as :class:`~offpolicy.rollout.routing.replay_routes`' ``flip_rate`` in the
  trainer's ``routing/flip_rate`` metric;
* the **KL of flipped vs unflipped tokens**: response token j of a row is predicted at input position P − 1 + j (P
  prompt tokens); it counts as *flipped* when that position flips in at least one layer. The report gives the mean
  full-vocabulary KL(π_train ‖ π_engine) (and KL(μ‖π), the inspect report's own direction) over the flipped and over
  the unflipped response tokens, and their ratio. Flips at earlier positions reach a token only through attention;
  they are counted where they happen, not where they propagate to.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from offpolicy.rollout.routing import flip_rates, is_moe
from offpolicy.rollout.spec import EngineSpec


def recording_routes(model: nn.Module, spec: EngineSpec) -> EngineSpec:
    """``spec`` with ``record_routes`` on where the flips can be measured: a transformers engine (not compiled: the
    recorder's hooks need eager steps) on an MoE model; else ``spec`` as it is."""
    if spec.backend != "hf" or spec.compile or spec.record_routes or not is_moe(model):
        return spec
    return replace(spec, record_routes=True)


def route_flips(engine: list[Tensor], trainer: list[Tensor]) -> list[Tensor]:
    """Per row, whether each (position, layer) was routed to another expert set: ``[n_i, L]`` bool.

    ``engine`` / ``trainer``: one ``[n_i, L, k]`` integer tensor per row (the routes each side recorded for the same
    n_i positions). The order of the k experts does not matter, only the set.

    >>> e = [torch.tensor([[[0, 1]], [[2, 3]]])]          # 2 positions, 1 layer, top-2
    >>> t = [torch.tensor([[[1, 0]], [[2, 4]]])]
    >>> route_flips(e, t)[0].flatten().tolist()
    [False, True]
    """
    if len(engine) != len(trainer):
        raise ValueError(f"engine and trainer routes must have one tensor per row, got {len(engine)} and {len(trainer)}")
    out = []
    for i, (e, t) in enumerate(zip(engine, trainer)):
        if e.shape != t.shape or e.dim() != 3:
            raise ValueError(f"row {i}: engine routes {tuple(e.shape)} and trainer routes {tuple(t.shape)} must both "
                             "be [n, L, k]")
        out.append((e.long().sort(-1).values != t.long().sort(-1).values).any(-1))
    return out


def response_flips(flips: Tensor, prompt_len: int, completion_len: int) -> Tensor:
    """``[C]`` bool: response token j is flipped when position P − 1 + j (which predicts it) flipped in any layer.

    ``flips`` is one row's ``[P + C − 1, L]`` of :func:`route_flips`.

    >>> f = torch.tensor([[False], [True], [False], [False]])   # P = 2, C = 3: token 0 is predicted at position 1
    >>> response_flips(f, 2, 3).tolist()
    [True, False, False]
    """
    if flips.shape[0] != prompt_len + completion_len - 1:
        raise ValueError(f"a row's flips cover {flips.shape[0]} positions, not P + C − 1 = "
                         f"{prompt_len + completion_len - 1}")
    return flips[prompt_len - 1 :].any(-1)


@dataclass
class RoutingFlips:
    """An inspection's routing flips: ``flips`` / ``routed`` per MoE layer (counts over every forwarded position of
    every row) and ``tokens`` ``[B, T]`` bool, the response tokens with ≥ 1 flip (:func:`response_flips`; False at
    padding)."""

    flips: list[int]
    routed: list[int]
    tokens: Tensor

    @classmethod
    def from_rows(cls, per_row: list[Tensor], prompt_lens: list[int], completion_lens: list[int],
                  width: int) -> RoutingFlips:
        """From :func:`route_flips`' rows and each row's prompt / completion length, tokens padded to ``width``."""
        layers = per_row[0].shape[1]
        tokens = torch.zeros(len(per_row), width, dtype=torch.bool)
        for i, (f, p, c) in enumerate(zip(per_row, prompt_lens, completion_lens)):
            if c:
                tokens[i, :c] = response_flips(f, p, c)
        return cls(flips=[int(sum(int(f[:, layer].sum()) for f in per_row)) for layer in range(layers)],
                   routed=[int(sum(f.shape[0] for f in per_row))] * layers, tokens=tokens)

    @staticmethod
    def concat(parts: list[RoutingFlips], width: int) -> RoutingFlips:
        """Micro-batches' flips as one (tokens right-padded to ``width``)."""
        tokens = [torch.nn.functional.pad(p.tokens, (0, width - p.tokens.shape[1])) for p in parts]
        return RoutingFlips(flips=[sum(x) for x in zip(*(p.flips for p in parts))],
                            routed=[sum(x) for x in zip(*(p.routed for p in parts))],
                            tokens=torch.cat(tokens))


def _mean(x: Tensor | None, where: Tensor) -> float | None:
    if x is None or not bool(where.any()):
        return None
    return float(x[where].double().mean())


def routing_summary(routing: RoutingFlips, mask: Tensor, kl: Tensor | None, kl_reverse: Tensor | None
                    ) -> dict[str, Any]:
    """The report's ``routing`` block: flip rate per layer and overall, the share of response tokens with a flip,
    and the mean KL(π‖μ) (``kl_reverse``) and KL(μ‖π) (``kl``) over flipped vs unflipped tokens (``[B, T]``, at
    ``mask``), with flipped ÷ unflipped ratios (None where a side has no token or no KL was measured).

    >>> r = RoutingFlips(flips=[1, 0], routed=[4, 4], tokens=torch.tensor([[True, False]]))
    >>> s = routing_summary(r, torch.tensor([[True, True]]), torch.tensor([[0.4, 0.1]]), torch.tensor([[0.2, 0.1]]))
    >>> s["flip_rate_per_layer"], s["flip_rate"], s["flipped_tokens"], s["kl_reverse_ratio"]
    ([0.25, 0.0], 0.125, 1, 2.0)
    """
    tokens = routing.tokens[:, : mask.shape[1]]
    if tokens.shape[1] < mask.shape[1]:
        tokens = torch.nn.functional.pad(tokens, (0, mask.shape[1] - tokens.shape[1]))
    flipped, unflipped = tokens & mask, ~tokens & mask
    per_layer, overall = flip_rates(routing.flips, routing.routed)
    out: dict[str, Any] = {
        "layers": len(routing.flips),
        "flip_rate_per_layer": per_layer,
        "flip_rate": overall,
        "routed_slots": int(sum(routing.routed)),
        "flipped_tokens": int(flipped.sum()),
        "unflipped_tokens": int(unflipped.sum()),
        "flipped_token_share": float(flipped.sum() / mask.sum()) if bool(mask.any()) else 0.0,
    }
    for name, x in (("kl_reverse", kl_reverse), ("kl", kl)):
        a, b = _mean(x, flipped), _mean(x, unflipped)
        out[f"{name}_flipped_mean"], out[f"{name}_unflipped_mean"] = a, b
        out[f"{name}_ratio"] = a / b if a is not None and b else None
    return out


BESIDE_KEYS = ("kl_mean", "kl_reverse_mean", "k3_kl")


def beside_numbers(summary: dict[str, Any], model: str) -> dict[str, Any]:
    """What an inspection of ``model`` keeps for another's report to stand beside (``meta["beside"]``)."""
    routing = summary.get("routing") or {}
    return {"model": model, **{k: summary.get(k) for k in BESIDE_KEYS}, "flip_rate": routing.get("flip_rate")}


def beside_summary(summary: dict[str, Any], beside: dict[str, Any] | None) -> dict[str, Any] | None:
    """The report's ``beside`` block: the other model's numbers (:func:`beside_numbers`, the same engines, prompts
    and seed) and this model's over them, ``<key>_ratio`` for each of :data:`BESIDE_KEYS` (None where a side is
    missing or zero) — e.g. lab-moe's KL over the dense lab model's at bf16.

    >>> beside_summary({"kl_mean": 2e-3, "kl_reverse_mean": None, "k3_kl": 1e-3}, {"model": "lab", "kl_mean": 1e-3,
    ...                "kl_reverse_mean": 1e-3, "k3_kl": 0.0})
    {'model': 'lab', 'kl_mean': 0.001, 'kl_reverse_mean': 0.001, 'k3_kl': 0.0, 'kl_mean_ratio': 2.0, \
'kl_reverse_mean_ratio': None, 'k3_kl_ratio': None}
    """
    if not beside:
        return None
    out = dict(beside)
    for key in BESIDE_KEYS:
        mine, theirs = summary.get(key), beside.get(key)
        out[f"{key}_ratio"] = mine / theirs if mine is not None and theirs else None
    return out
