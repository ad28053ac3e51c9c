"""Run an `OpenEnv <https://github.com/meta-pytorch/OpenEnv>`_ environment (``openenv-core``
0.3: a subclass of ``openenv.core.env_server.interfaces.Environment``) unchanged, in
process, as a sluice environment::

    [environment]
    name = "workers.environments.openenv_adapter:OpenEnvEnv"

    [environment.kwargs]
    env = "my_env.server.my_environment:MyEnvironment"
    action = "my_env.models:MyAction"
    action_field = "message"

Per episode a fresh environment ``env(**env_args)`` (OpenEnv environments keep their
episode on ``self``), then:

- ``reset(prompt)``: ``env.reset(**kw)``, ``kw`` taken from the prompt's columns as
  ``reset_args`` says (``{seed = "seed"}``: reset's ``seed`` is the prompt's ``seed``
  column; default none). Its observation's text is the opening observation, inserted
  after the prompt (``reset_observation = false``: the prompt alone opens the episode).
- ``step(action)``: the model's text becomes a typed action: ``action(**{action_field:
  text})``, or, with ``action_field = ""``, the text is a JSON object of the action's
  fields (``{"tool_name": ..., "arguments": {...}}`` for a ``CallToolAction``). A turn
  that does not validate (not JSON, a missing or unknown field: OpenEnv actions forbid
  extra fields) fails the episode with pydantic's message (`EpisodeFailure`). Then
  ``env.step(action)``: its ``reward`` (None counts 0) is the step's reward part
  ``reward`` (steps are summed: the episode's return), its ``done`` ends the episode,
  and so does ``max_steps`` steps (0: no limit but ``environment.max_turns``).
- The observation's text for the model is the field ``observation_field``; by default
  the first field declared as ``str`` on the observation class other than OpenEnv's own
  (``done``, ``reward``, ``metadata``): ``echoed_message`` for ``openenv init``'s echo
  environment. A value that is not a string is sent as JSON; None or "" sends nothing.
  The observation's ``metadata`` goes to the step's ``info``.

Calls follow OpenEnv's own server: an environment that overrides ``reset_async`` /
``step_async`` is awaited, a sync one runs in a worker thread (in one thread of its own
when the class sets ``REQUIRES_SINGLE_THREAD_EXECUTOR``); ``close()`` runs at the end.
Any exception from the environment fails the episode (`EpisodeFailure`).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import typing
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pipeline.imports import load_callable
from workers.environments.base import Action, EpisodeFailure, StepResult

_BASE_FIELDS = ("done", "reward", "metadata")


def _is_text(annotation: Any) -> bool:
    """``str``, ``str | None`` or ``Optional[str]``."""
    if annotation is str:
        return True
    args = typing.get_args(annotation)
    return bool(args) and str in args and all(a in (str, type(None)) for a in args)


def text_field(obs_cls: type) -> str | None:
    """The default observation field for the model (module docstring), or None."""
    fields = getattr(obs_cls, "model_fields", {})
    return next((name for name, f in fields.items()
                 if name not in _BASE_FIELDS and _is_text(f.annotation)), None)


def _is_async_override(env: Any, name: str) -> bool:
    """True when the environment's class overrides OpenEnv's default ``<name>`` (which
    only calls the sync method)."""
    try:
        from openenv.core.env_server.interfaces import Environment
    except ImportError:  # not an OpenEnv class: async only if it is a coroutine function
        return inspect.iscoroutinefunction(getattr(env, name, None))
    fn = getattr(type(env), name, None)
    return fn is not None and fn is not getattr(Environment, name)


class OpenEnvEnv:
    """One episode of an OpenEnv environment (module docstring)."""

    def __init__(self, env: str, action: str, env_args: Mapping[str, Any] | None = None,
                 action_field: str = "message", observation_field: str = "",
                 max_steps: int = 0, reset_observation: bool = True,
                 reset_args: Mapping[str, str] | None = None) -> None:
        self.factory = load_callable(env, f"OpenEnv env {env!r}")
        self.action_cls = load_callable(action, f"OpenEnv action {action!r}")
        self.env_args = dict(env_args or {})
        try:
            inspect.signature(self.factory).bind(**self.env_args)
        except TypeError as e:
            raise ValueError(f"OpenEnv env {env!r} does not take env_args "
                             f"{self.env_args!r}: {e}") from None
        except ValueError:  # no signature to check (a builtin): its call will say
            pass
        fields = getattr(self.action_cls, "model_fields", None)
        if fields is None:
            raise ValueError(f"OpenEnv action {action!r} is not a pydantic model (an "
                             "openenv Action subclass)")
        if action_field and action_field not in fields:
            raise ValueError(f"OpenEnv action {action!r} has no field {action_field!r} "
                             f"(fields: {', '.join(fields)})")
        if max_steps < 0:
            raise ValueError(f"max_steps must be >= 0, got {max_steps}")
        self.action_field = action_field
        self.observation_field = observation_field
        self.max_steps = max_steps
        self.reset_observation = reset_observation
        self.reset_args = dict(reset_args or {})
        self.name = getattr(self.factory, "__name__", env)
        self.env: Any = None
        self.steps = 0
        self._executor: ThreadPoolExecutor | None = None

    async def _run(self, what: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)`` in a worker thread, as an `EpisodeFailure` if it raises."""
        try:
            if self._executor is not None:
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(self._executor,
                                                  functools.partial(fn, *args, **kw))
            return await asyncio.to_thread(fn, *args, **kw)
        except Exception as e:
            raise EpisodeFailure(f"OpenEnv {self.name}.{what} raised {e!r}") from e

    async def _call(self, method: str, *args: Any, **kw: Any) -> Any:
        if _is_async_override(self.env, f"{method}_async"):
            try:
                return await getattr(self.env, f"{method}_async")(*args, **kw)
            except Exception as e:
                raise EpisodeFailure(f"OpenEnv {self.name}.{method}_async raised "
                                     f"{e!r}") from e
        return await self._run(method, getattr(self.env, method), *args, **kw)

    def _text(self, obs: Any) -> str | None:
        """The observation's text for the model (module docstring)."""
        name = self.observation_field or text_field(type(obs))
        fields = getattr(type(obs), "model_fields", {})
        if not name or name not in fields:
            raise EpisodeFailure(
                f"OpenEnv {self.name}: observation {type(obs).__name__} has "
                + (f"no field {name!r}" if name else "no text field")
                + f"; set observation_field to one of: {', '.join(fields)}")
        value = getattr(obs, name)
        if value is None or isinstance(value, str):
            return value or None
        return json.dumps(value, default=str)

    def _observation(self, obs: Any, what: str) -> Any:
        if not hasattr(obs, "done") or not hasattr(obs, "reward"):
            raise EpisodeFailure(f"OpenEnv {self.name}.{what} returned a "
                                 f"{type(obs).__name__}, not an Observation")
        return obs

    async def reset(self, prompt: Mapping[str, Any]) -> str | None:
        if getattr(self.factory, "REQUIRES_SINGLE_THREAD_EXECUTOR", False):
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="openenv")
        self.env = await self._run("__init__", self.factory, **self.env_args)
        kw = {}
        for arg, column in self.reset_args.items():
            if column not in prompt:
                raise EpisodeFailure(f"reset_args: the prompt has no column {column!r} "
                                     f"(for reset's {arg!r})")
            kw[arg] = prompt[column]
        obs = self._observation(await self._call("reset", **kw), "reset")
        if obs.done:
            raise EpisodeFailure(f"OpenEnv {self.name}.reset returned a done observation")
        return self._text(obs) if self.reset_observation else None

    def _action(self, text: str) -> Any:
        """The typed action of the model's turn; `EpisodeFailure` when it does not
        validate."""
        cls = self.action_cls
        what = f"the model's turn is not a valid {cls.__name__}"
        if self.action_field:
            fields: Any = {self.action_field: text}
        else:
            try:
                fields = json.loads(text)
            except ValueError as e:
                raise EpisodeFailure(f"{what}: not JSON ({e})") from None
            if not isinstance(fields, dict):
                raise EpisodeFailure(f"{what}: a JSON {type(fields).__name__}, not an "
                                     "object of its fields")
        try:
            return cls(**fields)
        except Exception as e:  # pydantic's ValidationError: one line per bad field
            errors = getattr(e, "errors", None)
            detail = ("; ".join(f"{'.'.join(map(str, err['loc'])) or '(action)'}: "
                                f"{err['msg']}" for err in errors())
                      if callable(errors) else repr(e))
            raise EpisodeFailure(f"{what}: {detail}") from None

    async def step(self, action: Action) -> StepResult:
        if self.env is None:
            raise EpisodeFailure("step() before reset()")
        obs = self._observation(await self._call("step", self._action(action.text)), "step")
        self.steps += 1
        reward = 0.0 if obs.reward is None else float(obs.reward)
        done = bool(obs.done) or (self.max_steps > 0 and self.steps >= self.max_steps)
        info = {"metadata": dict(obs.metadata or {})} if hasattr(obs, "metadata") else {}
        return StepResult(None if done else self._text(obs), {"reward": reward}, done, info)

    async def close(self) -> None:
        try:
            if self.env is not None and callable(getattr(self.env, "close", None)):
                await self._run("close", self.env.close)
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=False)
