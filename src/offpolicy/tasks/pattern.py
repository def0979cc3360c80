"""Pattern continuation: repeat a digit pattern for ``length`` digits, scored position by position — the lab's task.

"4817>" → "48174817481748174817…" (``length`` digits; the pattern's own length is its period).

Why this task: the answer is long (32–128 tokens, one token per digit) while the prompt is a handful of tokens, so a
step spends its compute on the response, where the mismatch lives; and the reward is dense. Each position is scored
by *local validity* — is the digit the one written one period earlier (the prompt's pattern for the first period)? —
so a wrong digit costs its own position and the one a period later that copies it, not the rest of the answer.

>>> task = PatternTask(length=8)
>>> ex = task.examples(1, seed=0)[0]
>>> ex.prompt, ex.answer
('6604>', '66046604')
>>> # "66146614": the 1 breaks the rule once; the 1 a period later copies what was written, so it counts.
>>> # "66146604": the same error, then the pattern resumed: the digit a period after the 1 is judged wrong too.
>>> # "6604": four positions missing. "66x46604": x is no digit.
>>> task.reward(["66046604", "66146614", "66146604", "6604", "66x46604"], answer=[ex.answer] * 5,
...             pattern=["6604"] * 5)
[1.0, 0.875, 0.75, 0.5, 0.75]
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from offpolicy.tasks.base import Example, check_int_options

DIGITS = "0123456789"


def local_validity(pattern: str, completion: str, length: int) -> float:
    """Fraction of the first ``length`` positions whose character is a digit equal to the character one period
    (``len(pattern)``) before it in ``pattern + completion``; a missing position scores 0.

    >>> local_validity("12", "1212", 4), local_validity("12", "1112", 4), local_validity("12", "12", 4)
    (1.0, 0.5, 0.5)

    ("1112": the second 1 should copy the 2 before it, and the last 2 should copy that second 1.)
    """
    period = len(pattern)
    text = pattern + completion[:length]
    correct = sum(1 for t in range(period, len(text)) if text[t] in DIGITS and text[t] == text[t - period])
    return correct / length


@dataclass(frozen=True)
class PatternTask:
    """A random pattern of ``period`` digits followed by ``>`` → the pattern repeated for ``length`` digits.

    Reward: :func:`local_validity`, per-position partial credit in [0, 1]. ``answer`` is the exact repetition (what a
    perfect policy writes); the reward judges each digit against what was actually written one period earlier.

    :meth:`demonstrations` are the warm start's training data: a written sequence in which each digit follows the
    rule with probability 1 − ``noise`` (else a uniform digit), and the rule's digit at every position as target —
    so the warm-started model has seen the rule applied to imperfect prefixes, like the ones it samples itself.
    """

    length: int = 32
    period: int = 4
    name: str = "pattern"

    def __post_init__(self) -> None:
        check_int_options(("length", self.length, 1, 512), ("period", self.period, 1, 16))

    @property
    def alphabet(self) -> str:
        """The characters an answer is made of (the warm start's calibration spreads mass over them)."""
        return DIGITS

    def examples(self, n: int, seed: int) -> list[Example]:
        """``n`` examples with uniformly random patterns (``random.Random(seed)``)."""
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            pattern = "".join(rng.choice(DIGITS) for _ in range(self.period))
            answer = (pattern * (self.length // self.period + 1))[: self.length]
            out.append(Example(prompt=f"{pattern}>", answer=answer, meta={"pattern": pattern}))
        return out

    def demonstrations(self, n: int, seed: int, noise: float = 0.0) -> list[tuple[str, str, str]]:
        """``n`` triples ``(prompt, written, target)``: ``written`` is a completion whose digits each follow the rule
        with probability 1 − ``noise`` (else a uniform digit); ``target[t]`` is the rule's digit given ``written``'s
        prefix (the digit one period before position t).

        >>> PatternTask(length=4, period=2).demonstrations(1, seed=0, noise=0.0)
        [('66>', '6666', '6666')]
        """
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise must be in [0, 1], got {noise!r}")
        rng = random.Random(seed)
        out = []
        for ex in self.examples(n, seed):
            text, targets = ex.meta["pattern"], []
            for _ in range(self.length):
                rule = text[-self.period]
                targets.append(rule)
                text += rule if rng.random() >= noise else rng.choice(DIGITS)
            out.append((ex.prompt, text[self.period :], "".join(targets)))
        return out

    def reward(self, completions: list[str], *, answer: list[str], pattern: list[str] | None = None,
               **kwargs: Any) -> list[float]:
        """:func:`local_validity` of each completion against its example's ``pattern`` column."""
        if pattern is None:
            raise ValueError("pattern: the pattern task's reward needs the 'pattern' column of its examples")
        return [local_validity(p, c, self.length) for c, p in zip(completions, pattern, strict=True)]
