"""Reward functions, and how the scorer (and the evaluator) load and call them.

Calling convention: TRL's GRPOTrainer (``_calculate_rewards`` in TRL 1.16), by keyword::

    f(prompts=..., completions=..., completion_ids=..., **columns) -> list[float | None]

- ``prompts``: each completion's prompt as in the data: a string, or for conversational
  data the message list ``[{"role": ..., "content": ...}]``.
- ``completions``: decoded text WITHOUT the end-of-sequence token; for a conversational
  prompt ``[{"role": "assistant", "content": text}]``, as TRL passes them.
- ``completion_ids``: the sampled token ids (lists of int).
- ``columns``: every other key of the prompt dict under its own name (a dataset's
  ``solution``, sluice's ``answer``), one value per completion (None where a prompt lacks
  the key), plus ``finish_reason``: ``"stop"`` if the model emitted end-of-sequence,
  ``"length"`` otherwise (sluice's; TRL has none).
- What TRL passes besides: ``trainer_state`` is ``None`` (the trainer's state lives in
  another process; TRL's own rewards accept that), ``log_extra`` and ``log_metric`` are
  callables that drop what they are given (the scorer reports its own metrics);
  ``environments`` is not passed (episodes run in the generator, not here); a multi-turn
  episode instead brings ``env_reward`` (its environment's reward, parts summed) and
  ``env_reward_parts`` (the parts, summed over steps), None for single completions, and
  its ``completions`` entry is its turns as chat messages when the prompt is
  conversational (the transcript text otherwise).
- ``None`` in the result means "not applicable to this sample" (as in TRL).

So TRL's reward functions (``trl.rewards:accuracy_reward``, ``think_format_reward``, …)
and any ``def r(completions, solution, **kwargs)`` run unchanged. Reward functions are
named by import path (``"package.module:function"``) so that any process can load them;
nothing is pickled. `reward_matrix` computes rewards in-process (the evaluator); the
scorer calls them in its reward process (`workers.reward_runner`), through the same
`invoke_reward` and `validate`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import numbers
import re
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.config import Config, ConfigError, RewardSpec
from pipeline.imports import load_callable
from workers.tasks.catalog import Task, task_from_config
from workers.tasks.prompts import completion_for, completion_text, is_conversational

_EOS = None  # end-of-sequence marker in character lists; never equal to a character


class RewardError(RuntimeError):
    """A reward function failed, timed out or returned something invalid. ``problem``
    says how (for a raised exception: ``"raised TypeError(...)"``; the exception itself is
    ``__cause__`` in-process); ``detail`` is a raised exception as ``"TypeError: msg"``
    (what the start-up probe reports; it crosses from the reward process as text)."""

    def __init__(self, name: str, problem: str, detail: str | None = None) -> None:
        super().__init__(f"reward function {name!r}: {problem}")
        self.name = name
        self.problem = problem
        self.detail = detail


def _texts(completions: Sequence[Any]) -> list[str]:
    return [completion_text(c) for c in completions]


def _per_completion(values: Sequence[Any] | None, n: int, name: str) -> list[Any]:
    if values is None:
        raise ValueError(f"this reward needs the {name} column")
    values = list(values)
    if len(values) != n:
        raise ValueError(f"column {name!r} has {len(values)} values for {n} completions")
    return values


def match_reward(*, completions: Sequence[Any], answer: Sequence[Any] | None = None,
                 finish_reason: Sequence[str] | None = None, **kwargs: Any
                 ) -> list[float | None]:
    """Position-wise character match against ``answer`` + EOS, in [0, 1].

    ``target = list(answer) + [EOS]``; ``got = list(completion) + [EOS if stopped]``;
    reward = #{i < min(len): target[i] == got[i]} / max(len(target), len(got)).
    Exact answer then stop = 1.0; exact answer but no stop = len/(len+1); extra or
    missing characters cost through the denominator. ``None`` where there is no answer.
    """
    texts = _texts(completions)
    n = len(texts)
    answers = [None] * n if answer is None else _per_completion(answer, n, "answer")
    finished = _per_completion(finish_reason, n, "finish_reason")
    rewards: list[float | None] = []
    for a, completion, reason in zip(answers, texts, finished, strict=True):
        if a is None:
            rewards.append(None)
            continue
        target = [*str(a), _EOS]
        got = [*completion, *([_EOS] if reason == "stop" else [])]
        matches = sum(t == g for t, g in zip(target, got, strict=False))
        rewards.append(matches / max(len(target), len(got)))
    return rewards


copy_reward = match_reward


def exact_match(*, completions: Sequence[Any], answer: Sequence[Any] | None = None,
                finish_reason: Sequence[str] | None = None, **kwargs: Any
                ) -> list[float | None]:
    """1.0 iff the completion equals ``answer`` exactly and the model stopped, else 0.0;
    ``None`` where there is no answer."""
    texts = _texts(completions)
    n = len(texts)
    answers = [None] * n if answer is None else _per_completion(answer, n, "answer")
    finished = _per_completion(finish_reason, n, "finish_reason")
    return [None if a is None else float(c == str(a) and r == "stop")
            for a, c, r in zip(answers, texts, finished, strict=True)]


def format_reward(*, completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """1.0 iff the completion is one or more ASCII digits, else 0.0."""
    return [float(c.isascii() and c.isdigit()) for c in _texts(completions)]


_INTEGER = re.compile(r"-?\d+")


def first_number_reward(*, completions: Sequence[Any], answer: Sequence[Any] | None = None,
                        **kwargs: Any) -> list[float | None]:
    """1.0 iff the first integer in the completion (a run of digits, with a leading minus
    sign if any; thousands separators are not read) equals ``answer``, else 0.0; ``None``
    where there is no answer. The first, not the last: a model that answers in words
    states its answer first ("896 is larger than 473."), and a completion that explains
    before it answers is read by whatever number it names first, so rambling costs."""
    texts = _texts(completions)
    n = len(texts)
    answers = [None] * n if answer is None else _per_completion(answer, n, "answer")
    rewards: list[float | None] = []
    for a, text in zip(answers, texts, strict=True):
        found = _INTEGER.search(text)
        rewards.append(None if a is None else
                       float(found is not None and int(found.group()) == int(str(a))))
    return rewards


_BOXED = re.compile(r"\\boxed\{[^{}]*\}")


def env_reward(*, completions: Sequence[Any], env_reward: Sequence[Any] | None = None,
               **kwargs: Any) -> list[float | None]:
    """The environment's reward of each episode (its parts summed over parts and steps;
    `workers.environments`): the default reward of a run with an ``[environment]``.
    None for a completion no environment scored (so a mixed run is not given zeros)."""
    vals = [None] * len(completions) if env_reward is None else list(env_reward)
    return [None if v is None else float(v) for v in vals]


def boxed_format_reward(*, completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """1.0 iff the completion gives exactly one ``\\boxed{...}`` answer (what math-verify's
    accuracy reward extracts first), else 0.0: a format reward for math recipes."""
    return [float(len(_BOXED.findall(c)) == 1) for c in _texts(completions)]


@dataclass(frozen=True)
class RewardFn:
    """A loaded reward function; the scorer sums ``weight * reward`` over functions."""

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    path: str = field(default="", compare=False)  # "package.module:function", for messages

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
    obj = load_callable(path, f"reward {path!r}")
    attr = path.partition(":")[2]
    return RewardFn(name=attr, fn=obj, weight=weight, path=path)


def validate(name: str, result: Any, n: int) -> list[float | None]:
    """``result`` as ``n`` finite floats or Nones; anything else (not a list, a wrong
    length, a string, a value ``float()`` rejects such as ``10**400``, NaN, inf) raises
    ``RewardError``, never another exception: a bad value costs its group, not the role."""
    if hasattr(result, "tolist") and not isinstance(result, list | tuple):
        try:
            result = result.tolist()  # numpy arrays / torch tensors
        except Exception as e:
            raise RewardError(name, f"returned {type(result).__name__} whose tolist() "
                              f"raised {e!r}") from e
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
        try:
            value = float(value)
        except Exception as e:  # OverflowError of a huge int, a Real whose float() fails
            raise RewardError(name, f"reward {i} is not a finite float ({e})") from e
        if not math.isfinite(value):
            raise RewardError(name, f"reward {i} is not finite ({value})")
        out.append(value)
    return out


def _drop(*args: Any, **kwargs: Any) -> None:
    """``log_extra`` / ``log_metric`` of TRL: accepted and dropped."""


async def _in_daemon_thread(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """``fn(**kwargs)`` in a fresh daemon thread: the event loop keeps serving, and a
    call that never returns cannot keep the process from exiting (the default executor's
    threads are joined at exit)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not done.done():
            (done.set_result if ok else done.set_exception)(value)

    def target() -> None:
        try:
            outcome = (True, fn(**kwargs))
        except BaseException as e:  # handed to the awaiting coroutine
            outcome = (False, e)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (timed out)
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=target, name="sluice-reward", daemon=True).start()
    return await done


async def invoke_reward(rf: RewardFn, kwargs: dict[str, Any]) -> Any:
    """``rf(**kwargs)``, unbounded: async functions awaited, sync ones in a daemon thread
    (the event loop keeps serving). EVERY exception the function raises, ``SystemExit``
    and ``KeyboardInterrupt`` included, is its own failure: ``RewardError``."""
    try:
        if inspect.iscoroutinefunction(rf.fn):
            result = await rf.fn(**kwargs)
        else:
            result = await _in_daemon_thread(rf.fn, kwargs)
        if inspect.isawaitable(result):  # e.g. an object with an async __call__
            result = await result
    except asyncio.CancelledError:  # our own timeout cancelling the call
        raise
    except BaseException as e:  # the function's own failure, including its TimeoutError
        raise RewardError(rf.name, f"raised {e!r}", f"{type(e).__name__}: {e}") from e
    return result


async def call_reward(rf: RewardFn, kwargs: dict[str, Any], n: int,
                      timeout_s: float) -> list[float | None]:
    """Call one reward function in this process with TRL's keyword arguments
    (`reward_kwargs`) and return validated floats (or None), ``n`` of them.

    Every failure (exception, timeout, bad result) raises ``RewardError``. A timed-out
    sync function cannot be killed: its thread runs on, the result is dropped; an async
    one that blocks the loop is not interrupted at all. The scorer therefore calls its
    rewards in a separate process instead (`workers.reward_runner`).
    """
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    try:
        result = await asyncio.wait_for(invoke_reward(rf, kwargs), timeout_s)
    except TimeoutError as e:
        raise RewardError(rf.name, f"timed out after {timeout_s:g}s") from e
    return validate(rf.name, result, n)


def reward_kwargs(prompts: Sequence[Mapping[str, Any]], completions: Sequence[Any],
                  completion_ids: Sequence[Sequence[int]], finish_reasons: Sequence[str],
                  extra: Mapping[str, Sequence[Any]] | None = None) -> dict[str, Any]:
    """The keyword arguments of one reward call (module docstring), one entry per
    completion: ``prompts[i]`` is completion ``i``'s prompt dict (``text`` + columns).
    A completion is a text (conversational prompts get it as an assistant message) or
    already a message list (a multi-turn episode's turns, passed as they are); ``extra``
    adds per-completion columns (``env_reward``, ``env_reward_parts`` of episodes)."""
    n = len(completions)
    if not len(prompts) == len(completion_ids) == len(finish_reasons) == n:
        raise ValueError(f"{len(prompts)} prompts, {n} completions, {len(completion_ids)} "
                         f"id lists and {len(finish_reasons)} finish reasons: one each")
    columns: list[str] = []
    for p in prompts:  # union of keys, in first-seen order
        columns.extend(k for k in p if k != "text" and k not in columns)
    kwargs: dict[str, Any] = {k: [p.get(k) for p in prompts] for k in columns}
    for k, v in (extra or {}).items():
        if len(v) != n:
            raise ValueError(f"column {k!r} has {len(v)} values for {n} completions")
        kwargs[k] = list(v)
    kwargs.update(
        prompts=[p.get("text") for p in prompts],
        completions=[completion_for(p.get("text"), c) if isinstance(c, str) else c
                     for p, c in zip(prompts, completions, strict=True)],
        completion_ids=[[int(t) for t in ids] for ids in completion_ids],
        finish_reason=list(finish_reasons), trainer_state=None, log_extra=_drop,
        log_metric=_drop)
    return kwargs


def episode_inputs(prompts: Sequence[Mapping[str, Any]], rollouts: Sequence[Any]
                   ) -> tuple[list[Any], dict[str, list[Any]]]:
    """``completions`` and ``extra`` columns of `reward_matrix` for rollouts (anything with
    ``text``, ``messages`` and ``env_reward``: `pipeline.bus.schema.Rollout`): an episode's
    turns stand for its completion when its prompt is conversational, its text otherwise;
    ``env_reward`` / ``env_reward_parts`` are added when any rollout has them."""
    comps = [r.messages if r.messages is not None and is_conversational(p.get("text"))
             else r.text for p, r in zip(prompts, rollouts, strict=True)]
    if all(r.env_reward is None for r in rollouts):
        return comps, {}
    return comps, {
        "env_reward": [None if r.env_reward is None else float(sum(r.env_reward.values()))
                       for r in rollouts],
        "env_reward_parts": [None if r.env_reward is None else dict(r.env_reward)
                             for r in rollouts]}


async def reward_matrix(rewards: Sequence[RewardFn], prompts: Sequence[Mapping[str, Any]],
                        completions: Sequence[Any], completion_ids: Sequence[Sequence[int]],
                        finish_reasons: Sequence[str], *, timeout_s: float,
                        extra: Mapping[str, Sequence[Any]] | None = None) -> np.ndarray:
    """Rewards of ``n`` (prompt dict, completion) pairs under each function: ``[n, F]``
    float64, NaN where a function returned None.

    One call per function over all ``n`` pairs (so a reward model sees one batch), the
    functions concurrently. ``completions`` are texts; conversational prompts get them as
    assistant messages (`reward_kwargs`). Raises the first function's ``RewardError`` if
    any failed; the caller decides what a failure costs (the scorer: retry per group).
    """
    n = len(completions)
    kwargs = reward_kwargs(prompts, completions, completion_ids, finish_reasons, extra)
    cols = await asyncio.gather(*[call_reward(rf, kwargs, n, timeout_s) for rf in rewards],
                                return_exceptions=True)
    for col in cols:
        if isinstance(col, BaseException):
            raise col
    out = np.full((n, len(rewards)), np.nan, dtype=np.float64)
    for j, col in enumerate(cols):
        out[:, j] = [np.nan if v is None else v for v in col]  # type: ignore[union-attr]
    return out


async def probe_reward(rf: RewardFn, prompt: Mapping[str, Any], timeout_s: float) -> str | None:
    """Call ``rf`` once as the scorer would, on ``prompt`` with two dummy completions (its
    ``answer`` and an empty string, no token ids, finish reasons stop and length): None if
    the call works and returns two numbers or Nones, else the function's own error
    (``"TypeError: r() missing 1 required keyword-only argument: 'target'"``). The
    values are not judged; a dummy completion proves only that the function can be
    called with this task's columns."""
    try:
        await call_reward(rf, probe_kwargs(prompt), 2, timeout_s)
    except RewardError as e:
        return e.detail or e.problem
    return None


def probe_kwargs(prompt: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a probe call (`probe_reward`): two dummy completions."""
    answer = prompt.get("answer")
    texts = ["" if answer is None else str(answer), ""]
    return reward_kwargs([prompt, prompt], texts, [[], []], ["stop", "length"])


# ------------------------------------------------------------------ a config's rewards


def reward_specs(cfg: Config, key: str = "scoring.rewards") -> list[RewardSpec]:
    """The reward specs under ``key``: ``scoring.rewards``, or ``eval.rewards`` (the
    evaluator's, `Config.eval_rewards`)."""
    return cfg.scoring.rewards if key == "scoring.rewards" else cfg.eval_rewards


def load_rewards(cfg: Config, key: str = "scoring.rewards") -> list[RewardFn]:
    """The reward functions under ``key`` loaded; an import problem raises
    ``ConfigError`` naming the key."""
    out = []
    for i, spec in enumerate(reward_specs(cfg, key)):
        try:
            out.append(load_reward(spec.fn, spec.weight))
        except ValueError as e:
            raise ConfigError(f"{key}.{i}.fn: {e}") from None
    return out


async def probe_rewards(cfg: Config, rewards: list[RewardFn], task: Task | None = None,
                        key: str = "scoring.rewards",
                        probe: Callable[[Mapping[str, Any]], Awaitable[list[str | None]]]
                        | None = None) -> None:
    """Call each reward once on a held-out prompt of the task (the first training prompt
    if there is none; `probe_reward`, or ``probe``: the scorer's reward process,
    `workers.reward_runner.RewardRunner.probe`). ``ConfigError`` naming the first
    function (under ``key``) that cannot be called, with its own error message."""
    task = task or task_from_config(cfg)
    held = task.heldout(1)
    prompt = held[0] if held else task.prompt(0)
    timeout_s = cfg.scoring.reward_timeout_s
    problems = await probe(prompt) if probe is not None else await asyncio.gather(
        *[probe_reward(rf, prompt, timeout_s) for rf in rewards])
    for i, (rf, problem) in enumerate(zip(rewards, problems, strict=True)):
        if problem is not None:
            hint = " (raise scoring.reward_timeout_s?)" if problem.startswith("timed out") else ""
            raise ConfigError(f"{key}.{i}.fn {rf.path or rf.name!r}: {problem}{hint}")
