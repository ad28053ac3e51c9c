"""User hooks named in the config, loaded once per process (import path, like rewards).

- ``generation.rollout``: `RolloutFn`, ``async def f(prompt, ctx) -> list[Episode]`` (TRL's
  ``rollout_func``): the group's rollouts, sampled through ``ctx``
  (`workers.episodes.RolloutContext`) so tokens, logprobs and versions stay exact. The
  environment runner is one such function (`load_rollout`).
- ``generation.filter_prompt``: ``f(prompt) -> bool``; False skips the prompt.
- ``scoring.advantages``: see `pipeline.rl.advantages.apply_hook`.

A hook that does not import (or is not callable) is a ``ConfigError`` naming its key, at
start.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from pipeline.config import Config, ConfigError
from pipeline.imports import load_callable
from workers.environments.runner import EnvironmentRunner, episode_prompt
from workers.episodes import Episode, RolloutContext
from workers.tasks.prompts import Messages, render_prompt

RolloutFn = Callable[[dict[str, Any], RolloutContext], Awaitable[list[Episode]]]


def load_rollout(cfg: Config, tokenizer: Any = None) -> RolloutFn | None:
    """How a group's rollouts are produced: None for single completions (the engine's
    batched ``generate``), the environment runner's episodes with ``[environment]`` (a
    named environment or ``environment.tools``; the function carries its runner as
    ``.runner``, for `tool_stats`), or the ``generation.rollout`` hook. A hook,
    environment or tool that does not import, or (given the policy's ``tokenizer``) a chat
    template that cannot hold the tools, is a ``ConfigError`` naming its key."""
    if cfg.environment.enabled:
        runner = EnvironmentRunner.from_config(cfg, tokenizer)

        async def episodes(prompt: dict[str, Any], ctx: RolloutContext) -> list[Episode]:
            return await runner.group(ctx)
        episodes.runner = runner  # type: ignore[attr-defined]
        return episodes
    return load_hook(cfg.generation.rollout, "generation.rollout")


def tool_stats(rollout: RolloutFn | None) -> dict[str, dict[str, float]] | None:
    """The per-tool counters (`workers.environments.tools.ToolStats.snapshot`) of a
    `load_rollout` function that runs ``environment.tools``; None for any other."""
    stats = getattr(getattr(getattr(rollout, "runner", None), "factory", None), "stats", None)
    return None if stats is None else dict(stats.snapshot())


def load_filter(cfg: Config) -> Callable[[dict[str, Any]], Any] | None:
    """The ``generation.filter_prompt`` hook, or None."""
    return load_hook(cfg.generation.filter_prompt, "generation.filter_prompt")


def load_hook(path: str, key: str) -> Callable[..., Any] | None:
    """The callable at ``path`` (None when empty); ``ConfigError`` naming ``key``."""
    if not path:
        return None
    try:
        return load_callable(path, key)
    except ValueError as e:
        raise ConfigError(str(e)) from None


@functools.lru_cache(maxsize=8)
def tool_schemas(paths: tuple[str, ...]) -> list[dict[str, Any]] | None:
    """The schemas of the tools ``paths`` names (None for none), built once per process:
    every group's prompt renders them. ``ConfigError`` as `load_rollout` raises it."""
    if not paths:
        return None
    from workers.environments.tools import load_tools

    try:
        return [t.schema for t in load_tools(paths)]
    except ValueError as e:
        raise ConfigError(str(e)) from None


def render_group_prompt(cfg: Config, tokenizer: Any, prompt: Any
                        ) -> tuple[list[int], Messages | None]:
    """A group's prompt ids (and, for an environment's episodes under a chat template, the
    conversation they render without the generation prompt: `episode_prompt`, with the
    tools' schemas when ``environment.tools`` names some)."""
    if cfg.environment.enabled:
        return episode_prompt(tokenizer, prompt, cfg.task.system_prompt,
                              tool_schemas(tuple(cfg.environment.tools)))
    return render_prompt(tokenizer, prompt, cfg.task.system_prompt), None
