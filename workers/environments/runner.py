"""Run a group's episodes against an environment (the contract: `workers.environments.base`).

Per episode: build a fresh environment, ``reset`` it with the prompt dict, then alternate
the model's turn (sampled by the engine, kept exactly: `workers.episodes`) and the
environment's ``step``, whose observation is tokenised and inserted (mask 0), until the
environment says ``done`` (the episode ends ``stop``), ``environment.max_turns`` model
turns have been taken, or the episode's tokens reach ``environment.max_episode_tokens``
(it ends ``length``; the model's last turn is cut to fit, and an observation that does
not fit ends the episode there, or with ``overflow = "dead"`` retires the group). The
observation of the last allowed turn's step is not inserted: no model turn answers it. All
``n`` episodes of a group run concurrently; any `EpisodeFailure` (the environment raised,
timed out or returned something invalid) fails the group, which the generator retires
``dead`` with the reason.

Observations are tokenised as the chat template renders them (`observation_ids`); with
a chat template a group's prompt is rendered without the generation prompt and each
episode opens with its own mask-0 segment (the reset observation, then the generation
prompt: `episode_prompt`, `opening_text`), so an episode's tokens are exactly the
template's rendering of its messages.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from workers.environments.base import (
    Action,
    EnvFactory,
    EpisodeFailure,
    Observation,
    call,
    check_observation,
    load_environment,
    step_result,
)
from workers.episodes import Episode, RolloutContext
from workers.tasks.prompts import Messages, messages_of, render_prompt

log = logging.getLogger("sluice.environments")

_PROBE_USER, _PROBE_ASSISTANT = "u", "sluice-probe-7f3a"


Schemas = list[dict[str, Any]] | None
"""The tools' JSON schemas the chat template renders (``environment.tools``), or None."""


def _template(tokenizer: Any, messages: Messages, generation_prompt: bool,
              tools: Schemas = None) -> str:
    return str(tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                             add_generation_prompt=generation_prompt))


def observation_messages(obs: str | Messages, role: str) -> Messages:
    return [{"role": role, "content": obs}] if isinstance(obs, str) else list(obs)


def observation_text(tokenizer: Any, obs: str | Messages, *, role: str,
                     after_eos: bool, tools: Schemas = None) -> str:
    """The text inserted after a model turn for observation ``obs``.

    Without a chat template: the observation's text as is (messages: their contents
    joined). With one: what the template puts between an assistant turn's content and
    the next assistant turn's content — the end of the assistant turn (minus the eos the
    model already emitted, when ``after_eos``), the observation as ``role`` turn(s), and
    the generation prompt — found by rendering a probe conversation with and without the
    observation (``full = base + delta`` must hold, else the template cannot be extended
    turn by turn and we say so)."""
    if not getattr(tokenizer, "chat_template", None):
        if isinstance(obs, str):
            return obs
        return "".join(str(m.get("content", "")) for m in obs)
    base_msgs = [{"role": "user", "content": _PROBE_USER},
                 {"role": "assistant", "content": _PROBE_ASSISTANT}]
    base = _template(tokenizer, base_msgs, False, tools)
    full = _template(tokenizer, base_msgs + observation_messages(obs, role), True, tools)
    if not full.startswith(base):
        raise EpisodeFailure("the chat template renders an earlier conversation differently "
                             "once an observation follows; it cannot be extended turn by turn")
    close = base[base.rindex(_PROBE_ASSISTANT) + len(_PROBE_ASSISTANT):]
    eos = getattr(tokenizer, "eos_token", None)
    if after_eos and eos and close.startswith(eos):
        close = close[len(eos):]
    return close + full[len(base):]


def observation_ids(tokenizer: Any, obs: str | Messages, *, role: str,
                    after_eos: bool, tools: Schemas = None) -> list[int]:
    """Token ids of `observation_text` (no special tokens added around them)."""
    text = observation_text(tokenizer, obs, role=role, after_eos=after_eos, tools=tools)
    return list(tokenizer(text, add_special_tokens=False).input_ids) if text else []


def episode_prompt(tokenizer: Any, prompt: str | Messages, system_prompt: str = "",
                   tools: Schemas = None) -> tuple[list[int], Messages | None]:
    """A group's prompt ids for episodes, and the conversation they render.

    With a chat template the prompt is rendered *without* the generation prompt: each
    episode opens with its own mask-0 segment (`opening_text`: the reset observation, if
    any, as a turn of its own, then the generation prompt), so the tokens are exactly the
    template's rendering of the episode's messages. Without one: `render_prompt`'s ids
    and None (observations follow the prompt as plain text). ``tools``: the schemas the
    template renders (``environment.tools``), in every rendering of the episode."""
    if not getattr(tokenizer, "chat_template", None):
        return render_prompt(tokenizer, prompt, system_prompt), None
    conv = messages_of(prompt, system_prompt)
    text = _template(tokenizer, conv, False, tools)
    return list(tokenizer(text, add_special_tokens=False).input_ids), conv


def opening_text(tokenizer: Any, conversation: Messages, obs: Observation, *,
                 role: str, tools: Schemas = None) -> str:
    """What follows `episode_prompt`'s ids before the model's first turn: the reset
    observation as ``role`` turn(s) (none for None) and the generation prompt."""
    base = _template(tokenizer, conversation, False, tools)
    extra = observation_messages(obs, role) if obs else []
    full = _template(tokenizer, conversation + extra, True, tools)
    if not full.startswith(base):
        raise EpisodeFailure("the chat template renders the prompt differently once an "
                             "observation follows; it cannot be extended turn by turn")
    return full[len(base):]


async def _close(env: Any, timeout_s: float) -> None:
    close = getattr(env, "close", None)
    if close is None:
        return
    try:
        await call(close, timeout_s=timeout_s, what="close")
    except EpisodeFailure as e:  # the episode is done; a failing close costs nothing
        log.warning("environment close failed: %s", e)


class EnvironmentRunner:
    """Episodes of one configured environment (``environment.*``)."""

    def __init__(self, factory: EnvFactory, *, max_turns: int, max_episode_tokens: int,
                 step_timeout_s: float, observation_role: str = "user",
                 overflow: str = "truncate", tools: Schemas = None) -> None:
        self.factory = factory
        self.tools = tools  # the schemas every rendering passes to the template
        self.max_turns = max_turns
        self.max_episode_tokens = max_episode_tokens
        self.step_timeout_s = step_timeout_s
        self.role = observation_role
        self.overflow = overflow
        self.counts = {"episodes": 0, "turns": 0, "truncated": 0}

    @classmethod
    def from_config(cls, cfg: Any, tokenizer: Any = None) -> EnvironmentRunner:
        """The configured environment's runner; with ``environment.tools``, the tool-calling
        environment's (`workers.environments.tools`), whose template is checked when the
        policy's ``tokenizer`` is given. A bad setting is a ``ConfigError`` naming its key."""
        from pipeline.config import ConfigError

        e = cfg.environment
        if e.tools:
            from workers.environments.tools import ToolBox, check_template, load_tools

            try:
                tools = load_tools(e.tools)
                if tokenizer is not None:
                    check_template(tokenizer, [t.schema for t in tools])
            except ValueError as err:
                msg = str(err)
                raise ConfigError(msg if msg.startswith("environment.tools")
                                  else f"environment.tools: {msg}") from None
            box = ToolBox(tools, timeout_s=e.tool_timeout_s, max_turns=e.max_turns,
                          tokenizer=tokenizer)
            return cls(box, max_turns=e.max_turns, max_episode_tokens=e.max_episode_tokens,
                       step_timeout_s=e.step_timeout_s, observation_role="tool",
                       overflow=e.overflow, tools=box.schemas)
        try:
            factory = load_environment(e.name, e.kwargs)
        except ValueError as err:
            raise ConfigError(f"environment.name: {err}") from None
        try:  # one instance now, so wrong kwargs fail at start, not in every episode
            probe = factory()
        except Exception as err:
            raise ConfigError(f"environment.kwargs: {e.name}(**{e.kwargs!r}) raised "
                              f"{err!r}") from None
        for method in ("reset", "step"):
            if not callable(getattr(probe, method, None)):
                raise ConfigError(f"environment.name: {e.name} builds a "
                                  f"{type(probe).__name__}, which has no {method}() method")
        return cls(factory, max_turns=e.max_turns, max_episode_tokens=e.max_episode_tokens,
                   step_timeout_s=e.step_timeout_s, observation_role=e.observation_role,
                   overflow=e.overflow)

    async def group(self, ctx: RolloutContext) -> list[Episode]:
        """``ctx.n`` episodes of ``ctx.prompt``, concurrently; the first failure fails the
        group (the others are cancelled)."""
        tasks = [asyncio.ensure_future(self.episode(ctx)) for _ in range(ctx.n)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()

    async def episode(self, ctx: RolloutContext) -> Episode:
        t = self.step_timeout_s
        env = await call(self.factory, timeout_s=t, what="building the environment")
        try:
            return await self._play(env, ctx)
        finally:
            await _close(env, t)

    async def _play(self, env: Any, ctx: RolloutContext) -> Episode:
        t, tok = self.step_timeout_s, ctx.tokenizer
        for method in ("reset", "step"):
            if not callable(getattr(env, method, None)):
                raise EpisodeFailure(f"the environment has no {method}() method (a "
                                     f"{type(env).__name__})")
        b = ctx.episode()
        messages: Messages = []
        rewards: dict[str, float] = {}
        obs = check_observation(await call(env.reset, dict(ctx.prompt), timeout_s=t,
                                           what="reset"), "reset")
        finish = "length"
        if ctx.conversation is not None:  # a chat template: the episode's own opening
            ids = list(tok(opening_text(tok, ctx.conversation, obs, role=self.role,
                                        tools=self.tools),
                           add_special_tokens=False).input_ids)
            if len(ids) >= self.max_episode_tokens:
                raise EpisodeFailure(f"the episode's opening (reset observation and "
                                     f"generation prompt) is {len(ids)} tokens, no room in "
                                     f"environment.max_episode_tokens "
                                     f"({self.max_episode_tokens})")
            b.add_context(ids)
            if obs:
                messages.extend(observation_messages(obs, self.role))
        elif obs:
            ids = observation_ids(tok, obs, role=self.role, after_eos=False, tools=self.tools)
            if len(ids) >= self.max_episode_tokens:  # no room for a model turn after it
                raise EpisodeFailure(f"the reset observation does not fit "
                                     f"environment.max_episode_tokens "
                                     f"({self.max_episode_tokens}): {len(ids)} tokens")
            self._insert(b, messages, obs, tok, after_eos=False)
        for turn in range(self.max_turns):
            room = self.max_episode_tokens - len(b)
            if room <= 0:
                break
            c = await ctx.generate(ctx.prompt_ids + b.token_ids, max_new_tokens=room)
            b.add_model(c)
            text = ctx.decode(c.token_ids)
            messages.append({"role": "assistant", "content": text})
            self.counts["turns"] += 1
            res = step_result(await call(env.step, Action(text, c.token_ids.tolist(), turn),
                                         timeout_s=t, what=f"step (turn {turn})"),
                              f"step (turn {turn})")
            assert isinstance(res.reward, Mapping)  # step_result made it named parts
            for k, v in res.reward.items():
                rewards[k] = rewards.get(k, 0.0) + v
            if res.done:
                finish = "stop"
                break
            if turn + 1 == self.max_turns:  # no model turn follows: nothing to observe for
                break
            if res.observation and not self._insert(b, messages, res.observation, tok,
                                                    after_eos=c.finish_reason == "stop"):
                break
        self.counts["episodes"] += 1
        if finish == "length":
            self.counts["truncated"] += 1
        return b.finish(finish, messages=messages, env_reward=rewards)

    def _insert(self, b: Any, messages: Messages, obs: Observation, tok: Any, *,
                after_eos: bool) -> bool:
        """Insert an observation; False when it does not fit (the episode ends)."""
        assert obs is not None
        ids = observation_ids(tok, obs, role=self.role, after_eos=after_eos, tools=self.tools)
        # room for the observation and at least one model token after it
        if len(b) + len(ids) >= self.max_episode_tokens:
            if self.overflow == "dead":
                raise EpisodeFailure(
                    f"an observation of {len(ids)} tokens takes the episode past "
                    f"environment.max_episode_tokens ({self.max_episode_tokens}; "
                    f"{len(b)} used)")
            return False
        b.add_context(ids)
        messages.extend(observation_messages(obs, self.role))
        return True
