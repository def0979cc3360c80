"""Multi-turn diagnostics: retokenization drift per segment and the trainer–engine mismatch per policy turn.

Drift: for each segment of a conversation (prompt, policy turns, tool answers), the positions where the ids the trainer
scores differ from the ids the engine consumed or sampled — compared position by position, a position past the shorter
of the two counting as differing — and the first such position. With token-in/token-out (the ``engine`` view of
:func:`~offpolicy.rollout.conversation.trainer_view`) it is 0 by construction; re-tokenizing the decoded conversation
can make it positive (a BPE merge across a boundary, a canonicalised token split, a special token the decode skipped).

Mismatch per policy turn, over the turn's tokens in the loss, with r = log π_old − log μ:

* ``k3`` = mean (e^r − 1 − r) — Schulman's k3 estimator of KL(μ‖π_old) (unbiased under μ's samples;
  :func:`offpolicy.corrections.trust_region.k3`),
* ``abs_logp_diff`` = mean |r|,
* the same two at each turn's first token (``first_k3``, ``first_abs_logp_diff``): where a tool answer or the previous
  turn's boundary makes the engine and the trainer see different contexts, the first token shows it first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from offpolicy.corrections.trust_region import k3
from offpolicy.rollout.conversation import Conversation, TrainerView, trainer_view


def differing_positions(engine_ids: Sequence[int], trainer_ids: Sequence[int]) -> tuple[int, int]:
    """``(count, first)``: positions ``j < max(n, m)`` where the two id lists differ (a position only one list has
    differs), and the first of them (−1: none).

    >>> differing_positions([5, 6, 7], [5, 6, 7]), differing_positions([5, 6, 7], [5, 9, 7]), differing_positions([5, 6], [5])
    ((0, -1), (1, 1), (1, 1))
    """
    n = max(len(engine_ids), len(trainer_ids))
    diff = [j for j in range(n) if j >= len(engine_ids) or j >= len(trainer_ids) or engine_ids[j] != trainer_ids[j]]
    return len(diff), (diff[0] if diff else -1)


@dataclass
class DriftReport:
    """Drift of ``B`` conversations with ``S`` segments each (the same layout: prompt, turn, tool, turn, …).

    * ``roles``: ``S`` names — ``prompt``, ``turn1``, ``tool1``, ``turn2``, …
    * ``differing``: ``[B, S]`` int64, differing positions per segment;
    * ``first``: ``[B, S]`` int64, the first differing position within the segment (−1: none);
    * ``straddling``: ``[B]`` int64, trainer tokens that lie across a segment boundary (belong to no segment).
    """

    roles: list[str]
    differing: Tensor
    first: Tensor
    straddling: Tensor

    def metrics(self, prefix: str = "multi_turn/drift") -> dict[str, Tensor]:
        """Means over rows: ``{prefix}_positions`` (all segments), ``{prefix}_rows`` (fraction of rows with any
        drift), ``{prefix}/<role>`` per segment."""
        total = self.differing.sum(-1).float()
        out = {f"{prefix}_positions": total.mean(), f"{prefix}_rows": (total > 0).float().mean()}
        for k, role in enumerate(self.roles):
            out[f"{prefix}/{role}"] = self.differing[:, k].float().mean()
        return out


def segment_roles(conversation: Conversation) -> list[str]:
    """``prompt``, ``turn1``, ``tool1``, ``turn2``, … for the conversation's segments."""
    counts = {"policy": 0, "tool": 0}
    out = []
    for s in conversation.segments:
        if s.role == "prompt":
            out.append("prompt")
            continue
        counts[s.role] += 1
        out.append(f"{'turn' if s.role == 'policy' else 'tool'}{counts[s.role]}")
    return out


def view_drift(conversations: Sequence[Conversation], views: Sequence[TrainerView]) -> DriftReport:
    """The drift of the trainer's ``views`` against the ids the engine saw, per segment (see :class:`DriftReport`).

    >>> from offpolicy.rollout.conversation import Segment
    >>> conv = Conversation((Segment("prompt", (1,), "p"), Segment("policy", (7, 2), "x", (-0.5, -0.1))))
    >>> r = view_drift([conv], [trainer_view(conv, "engine")])
    >>> r.roles, r.differing.tolist(), r.first.tolist()
    (['prompt', 'turn1'], [[0, 0]], [[-1, -1]])
    """
    if len(conversations) != len(views) or not conversations:
        raise ValueError(f"views: need one per conversation (≥ 1), got {len(views)} for {len(conversations)}")
    roles = segment_roles(conversations[0])
    differing, first, straddling = [], [], []
    for i, (conv, view) in enumerate(zip(conversations, views)):
        if segment_roles(conv) != roles:
            raise ValueError(f"conversations[{i}] has segments {segment_roles(conv)}, the first has {roles}")
        pairs = [differing_positions(s.ids, view.segment_ids(k)) for k, s in enumerate(conv.segments)]
        differing.append([c for c, _ in pairs])
        first.append([f for _, f in pairs])
        straddling.append(sum(1 for s in view.segment if s < 0))
    return DriftReport(roles, torch.tensor(differing, dtype=torch.long), torch.tensor(first, dtype=torch.long),
                       torch.tensor(straddling, dtype=torch.long))


def retokenization_drift(conversations: Sequence[Conversation], tokenizer) -> DriftReport:
    """The drift a trainer that re-tokenizes the decoded conversations would see (:func:`view_drift` of the
    ``retokenize`` views)."""
    return view_drift(conversations, [trainer_view(c, "retokenize", tokenizer) for c in conversations])


def turn_mismatch(logp: Tensor, rollout_logp: Tensor, turn: Tensor, first: Tensor, n_turns: int) -> dict[str, Tensor]:
    """Per policy turn: mean k3 and mean |log π − log μ| over the turn's tokens, and both at the turn's first token.

    ``logp`` (π_old), ``rollout_logp`` (μ): ``[B, T]``; ``turn``: ``[B, T]`` int64 — the 0-based policy turn of each
    position in the loss, −1 elsewhere (tool tokens, padding, tokens out of the loss); ``first``: ``[B, T]`` bool, the
    first token of its turn. Returns ``k3``, ``abs_logp_diff``, ``first_k3``, ``first_abs_logp_diff``, ``tokens``
    (count) — each ``[n_turns]`` float32, NaN for a turn with no token.

    >>> logp = torch.tensor([[-1.0, -2.0, 0.0, -1.0]])
    >>> mu = torch.tensor([[-1.0, -1.5, 0.0, -2.0]])   # r = 0, -0.5, (tool), 1
    >>> out = turn_mismatch(logp, mu, torch.tensor([[0, 0, -1, 1]]), torch.tensor([[True, False, False, True]]), 2)
    >>> [round(v, 4) for v in out["abs_logp_diff"].tolist()], [round(v, 4) for v in out["k3"].tolist()]
    ([0.25, 1.0], [0.0533, 0.7183])
    >>> out["first_abs_logp_diff"].tolist(), out["tokens"].tolist()
    ([0.0, 1.0], [2.0, 1.0])
    """
    if not (logp.shape == rollout_logp.shape == turn.shape == first.shape) or logp.dim() != 2:
        raise ValueError(f"logp, rollout_logp, turn, first must share one [B, T] shape, got {tuple(logp.shape)}, "
                         f"{tuple(rollout_logp.shape)}, {tuple(turn.shape)}, {tuple(first.shape)}")
    valid = turn >= 0
    r = torch.where(valid, logp.detach().float() - rollout_logp.detach().float(), torch.zeros_like(logp, dtype=torch.float32))
    k3r, absr = k3(r), r.abs()
    names = ("k3", "abs_logp_diff", "first_k3", "first_abs_logp_diff", "tokens")
    out: dict[str, list[Tensor]] = {n: [] for n in names}
    nan = torch.tensor(float("nan"))
    for t in range(n_turns):
        sel = valid & (turn == t)
        sel_first = sel & first
        n, n_first = sel.sum(), sel_first.sum()
        out["k3"].append(k3r[sel].mean() if n > 0 else nan)
        out["abs_logp_diff"].append(absr[sel].mean() if n > 0 else nan)
        out["first_k3"].append(k3r[sel_first].mean() if n_first > 0 else nan)
        out["first_abs_logp_diff"].append(absr[sel_first].mean() if n_first > 0 else nan)
        out["tokens"].append(n.float())
    return {n: torch.stack([v.float().cpu() for v in vs]) for n, vs in out.items()}


def turn_metrics(mismatch: dict[str, Tensor], prefix: str = "multi_turn") -> dict[str, Tensor]:
    """:func:`turn_mismatch`'s result as flat metric names: ``{prefix}/turn{t}/{stat}`` (1-based turns)."""
    return {f"{prefix}/turn{t + 1}/{name}": v[t] for name, v in mismatch.items() for t in range(v.shape[0])}
