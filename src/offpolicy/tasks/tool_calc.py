"""A two-turn tool task: the policy calls a calculator, the environment answers in text, the policy answers.

Conversation (one row; ``|`` marks the segments, never part of the text)::

    12*7=  |  calc(12*7)<eos>  |  \\n= 84\\n  |  84<eos>
    prompt    policy turn 1       tool          policy turn 2

Turn 1 is the call: ``calc(EXPR)`` or a bare ``EXPR`` (integers joined by ``+ - *``, at most four operands of at most
six digits; surrounding whitespace ignored). The environment evaluates it and answers ``"\\n= VALUE\\n"`` — or
``"\\n= error\\n"`` when the call does not parse — as *text*, which goes back to the engine through the tokenizer. Turn
2 is the final answer, rewarded like :class:`~offpolicy.tasks.arithmetic.ArithmeticTask`: 1.0 for the exact integer,
``partial`` (0.1) for another well-formed integer, 0.0 otherwise. The cheap policy — copy the prompt's expression into
the call, then copy the tool's value — earns the full reward, so a small model can learn the mechanics; a policy that
answers from the prompt directly must multiply in its head.

The point of the task is the mechanics of a multi-turn rollout (:mod:`offpolicy.rollout.multi_turn`): the tool's text is
tokenized on its own, and re-tokenizing the whole conversation can give other ids than the engine saw
(:mod:`offpolicy.rollout.turn_drift`).

>>> task = ToolCalcTask()
>>> ex = task.examples(1, seed=0)[0]
>>> ex.prompt, ex.answer
('63*4=', '252')
>>> task.respond(ex.prompt, ["calc(63*4)"]), task.respond(ex.prompt, [" 63*4 "]), task.respond(ex.prompt, ["x"])
('\\n= 252\\n', '\\n= 252\\n', '\\n= error\\n')
>>> task.reward(["252", "251", "two"], answer=["252"] * 3)
[1.0, 0.1, 0.0]
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from offpolicy.tasks.base import Example, check_int_options, exact_int_rewards, random_operand

_EXPR = re.compile(r"\d{1,6}(?:[+\-*]\d{1,6}){0,3}")
_CALL = re.compile(r"calc\((.*)\)")


def evaluate_call(text: str) -> int | None:
    """The value of a call ``calc(EXPR)`` or ``EXPR`` (see the module docstring), or None if it does not parse.

    Multiplication binds tighter than ``+`` / ``-``; evaluated left to right otherwise.

    >>> evaluate_call("calc(2+3*4)"), evaluate_call("7-10"), evaluate_call("calc(1/2)"), evaluate_call("")
    (14, -3, None, None)
    """
    s = text.strip()
    call = _CALL.fullmatch(s)
    if call is not None:
        s = call.group(1).strip()
    if not _EXPR.fullmatch(s):
        return None
    total, sign = 0, 1
    for term in re.split(r"([+\-])", s):
        if term in ("+", "-"):
            sign = 1 if term == "+" else -1
            continue
        product = 1
        for factor in term.split("*"):
            product *= int(factor)
        total += sign * product
    return total


@dataclass(frozen=True)
class ToolCalcTask:
    """``a*b=`` (or ``+`` / ``-``, see ``ops``) with operands of 1..``max_digits`` digits, answered in two policy
    turns around one calculator call (see the module docstring). ``turns`` = 2 policy turns; :meth:`respond` is the
    environment's answer to the conversation so far."""

    max_digits: int = 2
    ops: str = "*"
    partial: float = 0.1
    name: str = "tool_calc"
    turns: int = 2

    def __post_init__(self) -> None:
        check_int_options(("max_digits", self.max_digits, 1, 6))
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"ops must be a non-empty string of '+', '-' and '*', got {self.ops!r}")
        if self.turns != 2:
            raise ValueError(f"turns must be 2 (a call, then the answer), got {self.turns!r}")

    def examples(self, n: int, seed: int) -> list[Example]:
        """``n`` deterministic examples (``random.Random(seed)``; the digit count is drawn first)."""
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            a, b = (random_operand(rng, self.max_digits) for _ in range(2))
            op = rng.choice(self.ops)
            value = a * b if op == "*" else a + b if op == "+" else a - b
            out.append(Example(prompt=f"{a}{op}{b}=", answer=str(value), meta={"a": a, "b": b, "op": op}))
        return out

    def respond(self, prompt: str, turns: list[str], **meta: Any) -> str:
        """The environment's text after policy turn ``len(turns)``: the calculator's value of the first turn's call.

        ``turns`` are the policy's decoded turns so far (special tokens skipped). Only one tool call per
        conversation: after the first turn there is nothing left to answer (``ValueError``)."""
        if len(turns) != 1:
            raise ValueError(f"turns: the calculator answers after the first policy turn only, got {len(turns)} turns")
        value = evaluate_call(turns[0])
        return f"\n= {'error' if value is None else value}\n"

    def reward(self, completions: list[str], *, answer: list[str], **kwargs: Any) -> list[float]:
        """Exact-match integer reward on the final turn (``completions``): 1.0 / ``partial`` / 0.0."""
        return exact_int_rewards(completions, answer, self.partial)

