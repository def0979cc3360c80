"""Countdown: combine the given numbers with + − × ÷ and parentheses to reach a target (TinyZero-style).

Completions are checked with a tiny recursive-descent parser over exact fractions — never ``eval`` — that accepts
only non-negative integer literals, the four operators and parentheses (no unary minus, names, calls, powers or
floats) and bounds the input length and nesting depth.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from offpolicy.tasks.base import Example

MAX_EXPRESSION_CHARS = 200
MAX_DEPTH = 32
_TOKEN = re.compile(r"\s*(?:(\d+)|([-+*/()]))")


def _tokenize(expr: str) -> list[str]:
    if len(expr) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    tokens, pos, end = [], 0, len(expr.rstrip())
    while pos < end:
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"unexpected character {expr[pos:].lstrip()[:1]!r} at position {pos}")
        tokens.append(m.group(1) or m.group(2))
        pos = m.end()
    if not tokens:
        raise ValueError("empty expression")
    return tokens


def safe_eval(expr: str) -> Fraction:
    """Exact value of an arithmetic expression of integers, ``+ - * /`` and parentheses.

    ``ValueError`` for anything else (names, unary minus, ``**``, floats, division by zero, > 200 characters,
    nesting deeper than 32).

    >>> safe_eval("(3*5)+7"), safe_eval("7/2")
    (Fraction(22, 1), Fraction(7, 2))
    >>> safe_eval("__import__('os')")
    Traceback (most recent call last):
    ...
    ValueError: unexpected character '_' at position 0
    """
    tokens = _tokenize(expr)
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        pos += 1
        return tokens[pos - 1]

    def expression(depth: int) -> Fraction:
        value = term(depth)
        while peek() in ("+", "-"):
            op, rhs = take(), term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(depth: int) -> Fraction:
        value = factor(depth)
        while peek() in ("*", "/"):
            op, rhs = take(), factor(depth)
            if op == "/" and rhs == 0:
                raise ValueError("division by zero")
            value = value * rhs if op == "*" else value / rhs
        return value

    def factor(depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise ValueError(f"parentheses nested deeper than {MAX_DEPTH}")
        tok = peek()
        if tok is None:
            raise ValueError("expression ends early")
        take()
        if tok == "(":
            value = expression(depth + 1)
            if peek() != ")":
                raise ValueError("missing ')'")
            take()
            return value
        if tok.isdigit():
            return Fraction(int(tok))
        raise ValueError(f"unexpected {tok!r}")

    value = expression(0)
    if pos != len(tokens):
        raise ValueError(f"unexpected {tokens[pos]!r} after a complete expression")
    return value


def expression_numbers(expr: str) -> list[int]:
    """The integer literals of ``expr`` in order (no validation).

    >>> expression_numbers("(3*5)+7")
    [3, 5, 7]
    """
    return [int(t) for t in re.findall(r"\d+", expr)]


@dataclass(frozen=True)
class CountdownTask:
    """``Use 3 5 7 to make 22:`` → an expression using each given number exactly once, e.g. ``3*5+7``.

    Reward: 1.0 if the completion parses (:func:`safe_eval`), uses exactly the given numbers (as a multiset) and
    equals the target; ``partial`` (0.1) for any other expression that parses; 0.0 otherwise. The numbers and
    target come from the ``numbers``/``target`` columns when given, else from the reference ``answer``
    expression (its literals and value), so the reward works with the answer column alone.

    >>> task = CountdownTask()
    >>> task.reward(["3*5+7", "7+5*3", "3*5", "3+5+7", "import os"], answer=["(3*5)+7"] * 5)
    [1.0, 1.0, 0.1, 0.1, 0.0]
    """

    n_numbers: int = 3
    max_number: int = 20
    max_target: int = 999
    partial: float = 0.1
    name: str = "countdown"

    def __post_init__(self) -> None:
        if not 2 <= self.n_numbers <= 6:
            raise ValueError(f"n_numbers must be in [2, 6], got {self.n_numbers}")
        if self.max_number < 2:
            raise ValueError(f"max_number must be >= 2, got {self.max_number}")

    def examples(self, n: int, seed: int) -> list[Example]:
        """``n`` deterministic puzzles whose target is a positive integer ≤ ``max_target`` reachable by a random
        expression over the numbers (that expression is the reference ``answer``)."""
        rng = random.Random(seed)
        out: list[Example] = []
        while len(out) < n:
            nums = [rng.randint(1, self.max_number) for _ in range(self.n_numbers)]
            expr, prec = str(nums[0]), 2
            for x in nums[1:]:
                op = rng.choice("+-*/")
                new_prec = 1 if op in "+-" else 2
                left = f"({expr})" if prec < new_prec else expr
                expr, prec = f"{left}{op}{x}", new_prec
            value = safe_eval(expr)
            if value.denominator != 1 or not 0 < value <= self.max_target:
                continue
            shown = nums[:]
            rng.shuffle(shown)
            prompt = f"Use {' '.join(map(str, shown))} to make {value.numerator}:"
            out.append(Example(prompt=prompt, answer=expr, meta={"numbers": shown, "target": value.numerator}))
        return out

    def reward(self, completions: list[str], *, answer: list[str], numbers: list[list[int]] | None = None,
               target: list[int] | None = None, **kwargs: Any) -> list[float]:
        """Exact-target reward with each number used once, see the class docstring."""
        rewards = []
        for i, (c, a) in enumerate(zip(completions, answer, strict=True)):
            nums = numbers[i] if numbers is not None else expression_numbers(a)
            goal = Fraction(target[i]) if target is not None else safe_eval(a)
            try:
                value = safe_eval(c)
            except ValueError:
                rewards.append(0.0)
                continue
            ok = value == goal and Counter(expression_numbers(c)) == Counter(nums)
            rewards.append(1.0 if ok else float(self.partial))
        return rewards
