"""A multi-turn rollout: the engine called once per policy turn, the environment's text tokenized in between.

For each policy turn the engine ``generate`` s from every row's context so far (token in); the sampled ids and μ
come back (token out) and are kept as they are. Between turns the task's environment reads the decoded turns and
answers with text (``task.respond``), which is tokenized once, on its own (no bos), and appended to the context —
the next turn's prompt is ``prompt ids + turn ids + tool ids``, never a re-tokenization of the text. The result is one
:class:`~offpolicy.rollout.conversation.Conversation` per row, from which the trainer takes its ids
(:func:`~offpolicy.rollout.conversation.trainer_view`).

This is what verl's agent loop and TRL's tool loop do (docs/multi-turn.md): the engine's ids are the record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from offpolicy.rollout.base import RolloutOutput
from offpolicy.rollout.conversation import Conversation, Segment, render_turn
from offpolicy.rollout.sampling import SamplingConfig


@dataclass(frozen=True)
class TurnPrompt:
    """One row's start: the prompt's text and ids (as the engine receives them) and the example's extra columns
    (passed to ``task.respond`` as keywords)."""

    text: str
    ids: list[int]
    meta: dict[str, Any]


def turn_seed(seed: int, turn: int) -> int:
    """The engine's seed for policy turn ``turn`` (0-based) of a rollout seeded ``seed``: turn 0 keeps ``seed``, so
    a one-turn rollout samples exactly what a single-turn one does.

    >>> turn_seed(7, 0), turn_seed(7, 1) != turn_seed(7, 0)
    (7, True)
    """
    return seed if turn == 0 else (seed * 1_000_003 + turn * 104_729) % (2**62)


def tool_ids(tokenizer: Any, text: str) -> list[int]:
    """The environment's ``text`` tokenized once, on its own, without special tokens (no bos in mid-conversation)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def run_turns(engine: Any, tokenizer: Any, task: Any, prompts: Sequence[TurnPrompt], sampling: SamplingConfig, *,
              seed: int) -> tuple[list[Conversation], RolloutOutput]:
    """``task.turns`` policy turns for every row (see the module docstring): ``(conversations, first turn's output)``
    (the first turn's :class:`~offpolicy.rollout.base.RolloutOutput` is a plain single-turn rollout: a sync check
    probes with it).

    Every turn samples with ``sampling`` (its ``max_new_tokens`` per turn). A turn that ends without eos (the token
    budget) is still followed by the environment's answer: the next turn reads what was written.
    """
    n_turns = int(task.turns)
    if n_turns < 1:
        raise ValueError(f"task.turns must be ≥ 1, got {n_turns}")
    contexts = [list(p.ids) for p in prompts]
    segments: list[list[Segment]] = [[Segment("prompt", tuple(p.ids), p.text)] for p in prompts]
    decoded: list[list[str]] = [[] for _ in prompts]
    first: RolloutOutput | None = None
    for t in range(n_turns):
        out = engine.generate(contexts, sampling, seed=turn_seed(seed, t))
        first = out if first is None else first
        logp = out.logp.detach().float().cpu()
        for i, ids in enumerate(out.completion_ids):
            ids = list(ids)
            text, rendered = render_turn(tokenizer, ids)
            segments[i].append(Segment("policy", tuple(ids), rendered, tuple(logp[i, : len(ids)].tolist())))
            decoded[i].append(text)
            contexts[i] += ids
            if t < n_turns - 1:
                answer = task.respond(prompts[i].text, list(decoded[i]), **prompts[i].meta)
                answer_ids = tool_ids(tokenizer, answer)
                segments[i].append(Segment("tool", tuple(answer_ids), answer))
                contexts[i] += answer_ids
    assert first is not None
    return [Conversation(tuple(s), tuple(d)) for s, d in zip(segments, decoded)], first
