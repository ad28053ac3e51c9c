"""Reward functions, and how the scorer loads and calls them.

Signature (TRL's): ``f(prompts, completions, completion_ids, **fields) -> list[float|None]``.

- ``prompts``: the prompt dicts (``{"text", "answer", ...}``, see ``workers.tasks``).
- ``completions``: decoded completion text, WITHOUT the end-of-sequence token.
- ``completion_ids``: the sampled token ids.
- ``fields``: every prompt key as a column (``answer=[...]``, like TRL's dataset
  columns) plus ``finish_reason=[...]``: ``"stop"`` if the model emitted end-of-sequence,
  ``"length"`` otherwise.
- ``None`` in the result means "not applicable to this sample" (as in TRL).

Reward functions are named by import path (``"package.module:function"``) so that any
process can load them; nothing is pickled.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

_EOS = None  # end-of-sequence marker in character lists; never equal to a character


class RewardError(RuntimeError):
    """A reward function failed, timed out or returned something invalid."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"reward function {name!r}: {problem}")
        self.name = name
        self.problem = problem


def _column(name: str, prompts: Sequence[dict], fields: dict[str, Any], n: int) -> list[Any]:
    """``fields[name]`` if given, else each prompt's ``name`` (None where absent)."""
    if name in fields:
        column = list(fields[name])
        if len(column) != n:
            raise ValueError(f"field {name!r} has {len(column)} values for {n} completions")
        return column
    return [p.get(name) for p in prompts]


def _finish_reasons(fields: dict[str, Any], n: int) -> list[Any]:
    if "finish_reason" not in fields:
        raise ValueError("this reward needs the finish_reason field ('stop' or 'length')")
    return _column("finish_reason", [], fields, n)


def match_reward(
    prompts: list[dict],
    completions: list[str],
    completion_ids: list[list[int]],
    **fields: Any,
) -> list[float | None]:
    """Position-wise character match against ``answer`` + EOS, in [0, 1].

    ``target = list(answer) + [EOS]``; ``got = list(completion) + [EOS if stopped]``;
    reward = #{i < min(len): target[i] == got[i]} / max(len(target), len(got)).
    Exact answer then stop = 1.0; exact answer but no stop = len/(len+1); extra or
    missing characters cost through the denominator. ``None`` where there is no answer.
    """
    n = len(completions)
    answers = _column("answer", prompts, fields, n)
    finished = _finish_reasons(fields, n)
    rewards: list[float | None] = []
    for answer, completion, reason in zip(answers, completions, finished, strict=True):
        if answer is None:
            rewards.append(None)
            continue
        target = [*str(answer), _EOS]
        got = [*completion, *([_EOS] if reason == "stop" else [])]
        matches = sum(t == g for t, g in zip(target, got, strict=False))
        rewards.append(matches / max(len(target), len(got)))
    return rewards


copy_reward = match_reward


def exact_match(
    prompts: list[dict],
    completions: list[str],
    completion_ids: list[list[int]],
    **fields: Any,
) -> list[float | None]:
    """1.0 iff the completion equals ``answer`` exactly and the model stopped, else 0.0."""
    n = len(completions)
    answers = _column("answer", prompts, fields, n)
    finished = _finish_reasons(fields, n)
    return [
        None if a is None else float(c == str(a) and r == "stop")
        for a, c, r in zip(answers, completions, finished, strict=True)
    ]


def format_reward(
    prompts: list[dict],
    completions: list[str],
    completion_ids: list[list[int]],
    **fields: Any,
) -> list[float | None]:
    """1.0 iff the completion is one or more ASCII digits, else 0.0."""
    return [float(c.isascii() and c.isdigit()) for c in completions]


@dataclass(frozen=True)
class RewardFn:
    """A loaded reward function; the scorer sums ``weight * reward`` over functions."""

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ValueError(f"reward {self.name!r} is not callable")
        if isinstance(self.weight, bool) or not isinstance(self.weight, numbers.Real):
            raise ValueError(f"reward {self.name!r}: weight must be a number")
        if not math.isfinite(self.weight):
            raise ValueError(f"reward {self.name!r}: weight must be finite, got {self.weight}")


def load_reward(path: str, weight: float = 1.0) -> RewardFn:
    """Import ``"package.module:function"`` (``function`` may be dotted, e.g.
    ``Class.method``). ``name`` is the part after the colon, for metric keys."""
    module_name, sep, attr = path.partition(":")
    if (
        not sep
        or ":" in attr
        or not all(p.isidentifier() for p in module_name.split("."))
        or not all(p.isidentifier() for p in attr.split("."))
    ):
        raise ValueError(f"reward {path!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {path!r}: cannot import module {module_name!r}: {e}") from e
    except Exception as e:
        raise ValueError(f"reward {path!r}: importing {module_name!r} failed: {e!r}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"reward {path!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"reward {path!r}: {attr!r} is {type(obj).__name__}, not callable")
    return RewardFn(name=attr, fn=obj, weight=weight)


def _validate(name: str, result: Any, n: int) -> list[float | None]:
    if hasattr(result, "tolist") and not isinstance(result, list | tuple):
        result = result.tolist()  # numpy arrays / torch tensors
    if not isinstance(result, list | tuple):
        raise RewardError(name, f"returned {type(result).__name__}, expected a list")
    if len(result) != n:
        raise RewardError(name, f"returned {len(result)} rewards for {n} completions")
    out: list[float | None] = []
    for i, value in enumerate(result):
        if value is None:
            out.append(None)
            continue
        if not isinstance(value, numbers.Real):
            raise RewardError(name, f"reward {i} is {type(value).__name__}, not a number")
        value = float(value)
        if not math.isfinite(value):
            raise RewardError(name, f"reward {i} is not finite ({value})")
        out.append(value)
    return out


async def call_reward(
    rf: RewardFn,
    prompts: list[dict],
    completions: list[str],
    completion_ids: list[list[int]],
    fields: dict[str, list[Any]],
    timeout_s: float,
) -> list[float | None]:
    """Call one reward function and return validated floats (or None), one per completion.

    Async functions are awaited; sync ones run in a worker thread so the event loop keeps
    serving. Every failure (exception, timeout, bad result) raises ``RewardError``. A
    timed-out sync function cannot be killed: its thread runs on, the result is dropped.
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")

    async def invoke() -> Any:
        try:
            if inspect.iscoroutinefunction(rf.fn):
                result = await rf.fn(prompts, completions, completion_ids, **fields)
            else:
                result = await asyncio.to_thread(
                    rf.fn, prompts, completions, completion_ids, **fields
                )
            if inspect.isawaitable(result):  # e.g. an object with an async __call__
                result = await result
        except Exception as e:  # the function's own failure, including its TimeoutError
            raise RewardError(rf.name, f"raised {e!r}") from e
        return result

    try:
        result = await asyncio.wait_for(invoke(), timeout_s)
    except TimeoutError as e:
        raise RewardError(rf.name, f"timed out after {timeout_s:g}s") from e
    return _validate(rf.name, result, len(completions))
