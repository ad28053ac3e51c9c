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

from collections.abc import Awaitable, Callable
from typing import Any

from pipeline.config import Config, ConfigError
from pipeline.imports import load_callable
from workers.environments.runner import EnvironmentRunner, episode_prompt
from workers.episodes import Episode, RolloutContext
from workers.tasks.prompts import Messages, render_prompt

RolloutFn = Callable[[dict[str, Any], RolloutContext], Awaitable[list[Episode]]]


def load_rollout(cfg: Config) -> RolloutFn | None:
    """How a group's rollouts are produced: None for single completions (the engine's
    batched ``generate``), the environment runner's episodes with ``[environment]``, or
    the ``generation.rollout`` hook. A hook or environment that does not import is a
    ``ConfigError`` naming its key."""
    if cfg.environment.name:
        runner = EnvironmentRunner.from_config(cfg)

        async def episodes(prompt: dict[str, Any], ctx: RolloutContext) -> list[Episode]:
            return await runner.group(ctx)
        return episodes
    return load_hook(cfg.generation.rollout, "generation.rollout")


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


def render_group_prompt(cfg: Config, tokenizer: Any, prompt: Any
                        ) -> tuple[list[int], Messages | None]:
    """A group's prompt ids (and, for an environment's episodes under a chat template, the
    conversation they render without the generation prompt: `episode_prompt`)."""
    if cfg.environment.name:
        return episode_prompt(tokenizer, prompt, cfg.task.system_prompt)
    return render_prompt(tokenizer, prompt, cfg.task.system_prompt), None
