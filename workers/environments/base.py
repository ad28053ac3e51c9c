"""The episode contract: what a multi-turn environment implements (docs/design.md §10).

An environment is named by import path in the config (``environment.name =
"package.module:Factory"``, like reward functions) and built once per episode as
``Factory(**environment.kwargs)``: every episode has its own instance, so an environment
may keep per-episode state on ``self`` (TRL's ``environment_factory`` does the same). Then::

    obs = await env.reset(prompt)          # prompt: the task's prompt dict (text, answer, ...)
    while not done:
        action = <the model's turn>        # Action(text, token_ids, turn)
        result = await env.step(action)    # StepResult(observation, reward, done, info)
    await env.close()                      # optional

``reset`` returns the first observation (appended after the prompt, before the model's
first turn) or None (the prompt alone opens the episode). ``step`` returns a `StepResult`
or the 4-tuple ``(observation, reward, done, info)``: the observation is text, a list of
chat messages (``[{"role": "tool", "content": "42"}]``), or None when ``done``; ``reward``
is a number or a map of named parts (``{"correct": 1.0, "format": 0.2}``); rewards of all
steps of an episode are summed per part. Methods may be async (awaited) or plain (run in a
worker thread, so a slow environment never stalls the generator's event loop).

Failure rules (`workers.episodes`): an environment that raises, exceeds
``environment.step_timeout_s`` in one call, or returns something else than the above
makes the whole group ``dead`` with the reason in ``dlq``; the run goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pipeline.imports import load_callable
from workers.tasks.prompts import Messages, check_messages

Observation = str | Messages | None


class EpisodeFailure(RuntimeError):
    """An environment (or a rollout hook) failed an episode: raised, timed out, returned
    something invalid. The message is the reason its dead group carries."""


@dataclass(frozen=True)
class Action:
    """The model's turn as the environment sees it: the decoded text (special tokens
    skipped), the exact sampled token ids, and the turn number (0-based)."""

    text: str
    token_ids: list[int]
    turn: int


@dataclass
class StepResult:
    observation: Observation = None
    reward: float | Mapping[str, float] = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (module docstring). ``close`` is optional."""

    async def reset(self, prompt: Mapping[str, Any]) -> Observation: ...

    async def step(self, action: Action) -> StepResult: ...


EnvFactory = Callable[[], Any]


def load_environment(path: str, kwargs: Mapping[str, Any] | None = None) -> EnvFactory:
    """A zero-argument factory of fresh environments from ``"package.module:Name"``;
    ``ValueError`` when the path does not import or what it names is not callable. (The
    factory is only called per episode; `check_environment` probes one at start.)"""
    obj = load_callable(path, f"environment {path!r}")
    kw = dict(kwargs or {})
    return lambda: obj(**kw)


async def call(fn: Callable[..., Any], *args: Any, timeout_s: float, what: str) -> Any:
    """``fn(*args)`` awaited (async) or in a worker thread (plain), under ``timeout_s``;
    any failure is an `EpisodeFailure` naming ``what``."""
    async def invoke() -> Any:
        if inspect.iscoroutinefunction(fn):
            out = await fn(*args)
        else:
            out = await asyncio.to_thread(fn, *args)
        return await out if inspect.isawaitable(out) else out

    try:
        return await asyncio.wait_for(invoke(), timeout_s)
    except TimeoutError:
        raise EpisodeFailure(f"{what} timed out after {timeout_s:g}s "
                             "(environment.step_timeout_s)") from None
    except EpisodeFailure:
        raise
    except Exception as e:
        raise EpisodeFailure(f"{what} raised {e!r}") from e


def check_observation(value: Any, what: str) -> Observation:
    """An observation as the contract allows it (text, messages or None), else
    `EpisodeFailure` saying what came back."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        try:
            return check_messages(value, what)
        except ValueError as e:
            raise EpisodeFailure(f"{what}: {e}") from None
    raise EpisodeFailure(f"{what} returned a {type(value).__name__}: an observation must be "
                         "text, a list of chat messages, or None")


def reward_parts(value: Any, what: str) -> dict[str, float]:
    """A step's reward as named finite parts (a bare number is the part ``env``)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        parts = {"env": float(value)}
    elif isinstance(value, Mapping):
        parts = {}
        for k, v in value.items():
            if not isinstance(k, str) or not isinstance(v, numbers.Real) or isinstance(v, bool):
                raise EpisodeFailure(f"{what}: reward parts must map names to numbers, got "
                                     f"{k!r}: {type(v).__name__}")
            parts[k] = float(v)
    elif value is None:
        parts = {}
    else:
        raise EpisodeFailure(f"{what}: reward must be a number or a map of named numbers, "
                             f"got {type(value).__name__}")
    for k, v in parts.items():
        if not math.isfinite(v):
            raise EpisodeFailure(f"{what}: reward part {k!r} is {v}")
    return parts


def step_result(value: Any, what: str) -> StepResult:
    """`StepResult` from what ``step`` returned (a `StepResult` or the 4-tuple), checked."""
    if isinstance(value, tuple) and len(value) == 4:
        value = StepResult(*value)
    if not isinstance(value, StepResult):
        raise EpisodeFailure(f"{what} returned a {type(value).__name__}: expected a "
                             "StepResult or (observation, reward, done, info)")
    obs = check_observation(value.observation, what)
    if not isinstance(value.done, bool):
        raise EpisodeFailure(f"{what}: done must be a bool, got {type(value.done).__name__}")
    if not isinstance(value.info, Mapping):
        raise EpisodeFailure(f"{what}: info must be a map, got {type(value.info).__name__}")
    return StepResult(obs, reward_parts(value.reward, what), value.done, dict(value.info))
