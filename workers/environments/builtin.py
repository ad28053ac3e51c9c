"""Built-in environments that run on CPU with the tiny character model (and any other).

- `ToolArithmetic` (task ``add``: ``"123+45="``): the model may call a calculator by
  writing an expression (``123+45``); the environment answers ``=168`` as a ``tool``
  turn; a turn that is a plain number is the final answer and ends the episode. Reward
  parts: ``answer``, the position-wise character match of the final answer with the
  expected one (1.0 exactly when it is right: `workers.tasks.rewards.match_reward`'s rule); and
  shaping for a model that starts from random weights: ``call`` (0.2, once, for a call
  whose result is the answer) and ``format`` (up to 0.1 for a first turn made of digits
  and operators).
- `GuessNumber` (task ``guess``: a game id ``"4821?"`` with a hidden ``answer`` 0-9): the
  model guesses an integer, the environment answers ``+`` (higher) or ``-`` (lower) until
  it is found. Reward parts ``found`` (1.0 on the first guess, less per extra guess),
  ``near`` (when not found: credit for how close the closest guess came) and ``format``
  (for a first turn made of digits). The last two are shaping for a model that starts
  from random weights: it finds the format, then the range, then the number.

Both are strict about the model's turns (a turn that is neither a call nor an answer
ends the episode) and never evaluate model text as code: expressions are parsed here.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Mapping
from typing import Any

from workers.environments.base import Action, StepResult

_EXPR = re.compile(r"^\d{1,9}(?:[+*-]\d{1,9}){1,3}$")
_NUMBER = re.compile(r"^-?\d{1,18}$")
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def evaluate_expression(text: str) -> int:
    """Value of ``a op b op c ...`` (``+ - *``, the usual precedence); ``ValueError`` when
    ``text`` is not such an expression (at most four 9-digit operands)."""
    if not _EXPR.match(text):
        raise ValueError(f"not an expression: {text!r}")
    tokens = re.findall(r"\d+|[+*-]", text)
    terms: list[int] = [int(tokens[0])]
    signs: list[str] = []
    for op, num in zip(tokens[1::2], tokens[2::2], strict=True):
        if op == "*":
            terms[-1] = terms[-1] * int(num)
        else:
            signs.append(op)
            terms.append(int(num))
    value = terms[0]
    for op, term in zip(signs, terms[1:], strict=True):
        value = _OPS[op](value, term)
    return value


def char_match(got: str, want: str) -> float:
    """Position-wise character agreement / the longer length (1.0 iff equal)."""
    n = max(len(got), len(want))
    return sum(a == b for a, b in zip(got, want, strict=False)) / n if n else 1.0


class ToolArithmetic:
    """A calculator tool for arithmetic prompts (module docstring). ``max_calls`` tool
    calls per episode; one more ends it with no answer credit."""

    def __init__(self, max_calls: int = 2, call_weight: float = 0.2,
                 format_weight: float = 0.1) -> None:
        if max_calls < 1:
            raise ValueError(f"max_calls must be >= 1, got {max_calls}")
        self.max_calls = max_calls
        self.call_weight = call_weight
        self.format_weight = format_weight
        self.calls = 0
        self.answer = ""
        self.called_right = False

    async def reset(self, prompt: Mapping[str, Any]) -> None:
        self.answer = str(prompt["answer"])
        self.calls, self.called_right = 0, False
        return None

    async def step(self, action: Action) -> StepResult:
        text = action.text.strip()
        parts = {"answer": 0.0, "call": 0.0, "format": 0.0}
        if action.turn == 0:
            share = sum(ch.isdigit() or ch in "+-*" for ch in text) / max(len(text), 1)
            parts["format"] = self.format_weight * share
        if _NUMBER.match(text):
            parts["answer"] = char_match(text, self.answer)
            return StepResult(None, parts, True, {"calls": self.calls})
        if _EXPR.match(text) and self.calls < self.max_calls:
            self.calls += 1
            result = evaluate_expression(text)
            if str(result) == self.answer and not self.called_right:
                self.called_right = True
                parts["call"] = self.call_weight
            return StepResult([{"role": "tool", "content": f"={result}"}], parts)
        return StepResult(None, parts, True, {"calls": self.calls, "invalid": text[:40]})


class GuessNumber:
    """Guess-the-number with higher/lower feedback (module docstring). The hidden number
    is the prompt's ``answer``; finding it at guess ``k`` (0-based) scores
    ``found = max(1 - k * penalty, 0.25)``; wrong guesses earn ``near = near_weight * max(0,
    1 - d / 10)`` for the closest guess's distance ``d``, paid as increments whenever a
    guess comes closer (so an episode cut by the runner's ``max_turns`` has it too)."""

    def __init__(self, penalty: float = 0.15, format_weight: float = 0.1,
                 near_weight: float = 0.3) -> None:
        self.penalty = penalty
        self.format_weight = format_weight
        self.near_weight = near_weight
        self.secret = 0
        self.closest: int | None = None

    async def reset(self, prompt: Mapping[str, Any]) -> None:
        self.secret = int(prompt["answer"])
        self.closest = None
        return None

    def near(self) -> float:
        """Shaping credit of the closest guess so far (0 without a valid guess)."""
        if self.closest is None:
            return 0.0
        return self.near_weight * max(0.0, 1.0 - self.closest / 10)

    async def step(self, action: Action) -> StepResult:
        text = action.text.strip()
        valid = re.fullmatch(r"\d{1,4}", text) is not None
        parts = {"found": 0.0, "format": 0.0, "near": 0.0}
        if action.turn == 0:  # format credit once per episode, for its first turn
            share = sum(ch.isdigit() for ch in text) / max(len(text), 1)
            parts["format"] = self.format_weight * (1.0 if valid else 0.5 * share)
        if not valid:
            return StepResult(None, parts, True, {"invalid": text[:40]})
        guess = int(text)
        if guess == self.secret:
            parts["found"] = max(1.0 - action.turn * self.penalty, 0.25)
            return StepResult(None, parts, True, {"guesses": action.turn + 1})
        before = self.near()  # paid as increments: the episode's sum is the closest's credit
        d = abs(guess - self.secret)
        self.closest = d if self.closest is None else min(self.closest, d)
        parts["near"] = self.near() - before
        return StepResult("+" if self.secret > guess else "-", parts, False)

    async def close(self) -> None:
        return None
