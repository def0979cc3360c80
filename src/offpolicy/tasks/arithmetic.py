"""Multi-digit addition / subtraction: "12+34=" → "46". The warm-start and demo task of the tiny model."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from offpolicy.tasks.base import Example, exact_int_rewards, random_operand


@dataclass(frozen=True)
class ArithmeticTask:
    """``a+b=`` / ``a-b=`` with operands of 1..``max_digits`` digits; answers may be negative ("5-7=" → "-2").

    Reward: 1.0 for the exact integer (whitespace ignored), ``partial`` (0.1) for any other well-formed integer,
    0.0 otherwise — the partial credit gives a fresh model a gradient towards the answer *format*.

    >>> task = ArithmeticTask()
    >>> task.reward(["46", " 47", "4 6", ""], answer=["46"] * 4)
    [1.0, 0.1, 0.0, 0.0]
    """

    max_digits: int = 2
    ops: str = "+-"
    partial: float = 0.1
    name: str = "arithmetic"

    def __post_init__(self) -> None:
        if not 1 <= self.max_digits <= 6:
            raise ValueError(f"max_digits must be in [1, 6], got {self.max_digits}")
        if not self.ops or set(self.ops) - set("+-"):
            raise ValueError(f"ops must be a non-empty string of '+' and '-', got {self.ops!r}")

    def examples(self, n: int, seed: int) -> list[Example]:
        """``n`` deterministic examples (Python ``random.Random(seed)``; the digit count is drawn first so short
        operands are as common as long ones)."""
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            a = random_operand(rng, self.max_digits)
            b = random_operand(rng, self.max_digits)
            op = rng.choice(self.ops)
            value = a + b if op == "+" else a - b
            out.append(Example(prompt=f"{a}{op}{b}=", answer=str(value), meta={"a": a, "b": b, "op": op}))
        return out

    def reward(self, completions: list[str], *, answer: list[str], **kwargs: Any) -> list[float]:
        """Exact-match integer reward, see the class docstring."""
        return exact_int_rewards(completions, answer, self.partial)

