"""Tasks from a JSONL file: one ``{"prompt": ..., "answer": ...}`` object per line, pluggable reward."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from offpolicy.tasks.base import Example, RewardFn


def exact_match_reward(completions: list[str], *, answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 where the completion equals the answer after stripping surrounding whitespace, else 0.0.

    >>> exact_match_reward([" yes", "no"], answer=["yes", "yes"])
    [1.0, 0.0]
    """
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer, strict=True)]


class JsonlTask:
    """Examples read eagerly from ``path`` (so a bad file fails at construction, naming the line).

    Extra keys of a line become ``Example.meta`` (and reward kwargs). ``reward_fn`` has TRL's signature
    ``(completions, *, answer, **columns) -> list[float]``; default :func:`exact_match_reward`.

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "t.jsonl")
    >>> _ = open(path, "w").write('{"prompt": "2+2=", "answer": "4"}\\n{"prompt": "1+1="}\\n')
    >>> JsonlTask(path)
    Traceback (most recent call last):
    ...
    ValueError: .../t.jsonl line 2: missing key 'answer'
    """

    def __init__(self, path: str | Path, reward_fn: RewardFn | None = None) -> None:
        self.path = Path(path)
        self.name = self.path.stem
        self.reward_fn = reward_fn if reward_fn is not None else exact_match_reward
        self._examples = _read_jsonl(self.path)

    def __len__(self) -> int:
        return len(self._examples)

    def examples(self, n: int, seed: int) -> list[Example]:
        """``n`` examples in a seeded random order; cycles through the file (reshuffled) if ``n`` > its length."""
        rng = random.Random(seed)
        out: list[Example] = []
        while len(out) < n:
            order = list(range(len(self._examples)))
            rng.shuffle(order)
            out.extend(self._examples[i] for i in order[: n - len(out)])
        return out

    def reward(self, completions: list[str], *, answer: list[str], **kwargs: Any) -> list[float]:
        """Delegate to ``reward_fn`` (validate the result with :func:`offpolicy.tasks.base.compute_rewards`)."""
        return list(self.reward_fn(completions, answer=answer, **kwargs))


def _read_jsonl(path: Path) -> list[Example]:
    if not path.is_file():
        raise ValueError(f"task file {str(path)!r} does not exist (expected JSONL lines with 'prompt' and 'answer')")
    examples = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} line {lineno}: invalid JSON ({err.msg})") from err
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {lineno}: expected a JSON object, got {type(row).__name__}")
            for key in ("prompt", "answer"):
                if key not in row:
                    raise ValueError(f"{path} line {lineno}: missing key {key!r}")
                if not isinstance(row[key], (str, int, float)) or isinstance(row[key], bool):
                    raise ValueError(f"{path} line {lineno}: {key!r} must be a string, got {type(row[key]).__name__}")
            meta = {k: v for k, v in row.items() if k not in ("prompt", "answer")}
            examples.append(Example(prompt=str(row["prompt"]), answer=str(row["answer"]), meta=meta))
    if not examples:
        raise ValueError(f"task file {str(path)!r} has no examples")
    return examples
