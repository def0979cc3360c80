"""Free digits: continue a digit pattern whose last ``free`` slots are free — the other digits repeat, a free slot
takes any digit but the one written a period earlier. Many answers are right, so the best policy need not become
deterministic.

"4817>" with period 4 and one free slot → "4812 4813 4810 …" (spaces for reading only): 4, 8, 1 repeat, the fourth
digit of every period is any digit other than the fourth digit of the period before (the prompt's 7 for the first).

Why this task: on the pattern task (:mod:`offpolicy.tasks.pattern`) the policy soon puts almost all of its mass on
one token per position, and a numeric mismatch between two engines shrinks with the entropy it perturbs. Here a
free slot has nine right answers in every period and GRPO has no reason to prefer one (every right answer earns the
same reward, so a group that gets them all right has zero advantage): a fraction ``free / period`` of the answer's
tokens stays uncertain, as in real reasoning, so the mismatch cannot vanish as the policy improves. The prompt has
the pattern task's format, so the lab model (warm-started to copy the digit one period back) starts competent on
the fixed slots, and learning the free slots means *raising* its entropy there: the opposite of the pattern task.

>>> task = FreeDigitsTask(length=8, period=4, free=1)
>>> # "48124813": 4, 8, 1 repeat; the free slot goes 7 → 2 → 3, a new digit each period: all right.
>>> # "48174817": the pattern copied, free slots included: 2 of 8 positions wrong. "48124812": the second 2 repeats.
>>> # "4812": 4 positions missing.
>>> task.reward(["48124813", "48174817", "48124812", "4812"], answer=["-"] * 4, pattern=["4817"] * 4)
[1.0, 0.75, 0.875, 0.5]
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from offpolicy.tasks.base import Example, check_int_options

DIGITS = "0123456789"


def free_digit_validity(pattern: str, completion: str, length: int, free: int) -> float:
    """Fraction of the first ``length`` characters of ``completion`` that are right. With period ``len(pattern)``,
    a character in one of the first ``period − free`` slots of a period must be the digit one period before it in
    ``pattern + completion``; a character in one of the last ``free`` slots must be a digit *other* than that one.
    A missing position scores 0.

    >>> free_digit_validity("12", "1314", 4, 1), free_digit_validity("12", "1212", 4, 1)
    (1.0, 0.5)
    >>> free_digit_validity("12", "13", 4, 1), free_digit_validity("12", "1x13", 4, 1)
    (0.5, 0.75)

    ("1212": both free slots copy the 2 before them; "1x13": x is no digit — the 1 and the 3 after it are right.)
    """
    period = len(pattern)
    text = pattern + completion[:length]
    right = 0
    for t in range(period, len(text)):
        c, before = text[t], text[t - period]
        if t % period >= period - free:
            right += c in DIGITS and c != before
        else:
            right += c in DIGITS and c == before
    return right / length


@dataclass(frozen=True)
class FreeDigitsTask:
    """A random pattern of ``period`` digits followed by ``>`` → ``length`` digits that repeat the pattern's first
    ``period − free`` digits and fill each period's last ``free`` slots with digits different from the period before.

    Reward: :func:`free_digit_validity`, per-position partial credit in [0, 1]. ``answer`` is one right answer (each
    free slot adds 1 mod 10 per period), not the only one: the reward never compares with it. A policy that only
    copies the pattern (the pattern task's answer) scores ``1 − free / period``.
    """

    length: int = 32
    period: int = 4
    free: int = 1
    name: str = "free_digits"

    def __post_init__(self) -> None:
        check_int_options(("length", self.length, 1, 512), ("period", self.period, 1, 16), ("free", self.free, 1, 16))
        if self.free > self.period:
            raise ValueError(f"free must be ≤ period ({self.period}), got {self.free}")

    @property
    def alphabet(self) -> str:
        """The characters an answer is made of."""
        return DIGITS

    def examples(self, n: int, seed: int) -> list[Example]:
        """``n`` examples with uniformly random patterns (``random.Random(seed)``), the pattern task's prompts."""
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            pattern = "".join(rng.choice(DIGITS) for _ in range(self.period))
            text = pattern
            for t in range(self.period, self.period + self.length):
                before = text[t - self.period]
                text += str((int(before) + 1) % 10) if t % self.period >= self.period - self.free else before
            out.append(Example(prompt=f"{pattern}>", answer=text[self.period:], meta={"pattern": pattern}))
        return out

    def reward(self, completions: list[str], *, answer: list[str], pattern: list[str] | None = None,
               **kwargs: Any) -> list[float]:
        """:func:`free_digit_validity` of each completion against its example's ``pattern`` column."""
        if pattern is None:
            raise ValueError("pattern: the free_digits task's reward needs the 'pattern' column of its examples")
        return [free_digit_validity(p, c, self.length, self.free) for c, p in zip(completions, pattern, strict=True)]
