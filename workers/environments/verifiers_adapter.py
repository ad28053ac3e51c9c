"""Run a `verifiers <https://github.com/PrimeIntellect-ai/verifiers>`_ environment (its
classic API, 0.3.x: ``vf.MultiTurnEnv``, ``vf.ToolEnv``, ``vf.SingleTurnEnv``) unchanged
as a sluice environment::

    [environment]
    name = "workers.environments.verifiers_adapter:VerifiersEnv"
    kwargs = { env = "my_pkg.my_env:load_environment", env_args = { max_turns = 4 } }

``env`` names a callable returning a verifiers environment (an environment module's
``load_environment``, or an environment class), called with ``env_args``; it is built once
per process and shared by all episodes (verifiers keeps everything per rollout in its
``state``, so one environment serves concurrent rollouts, as in ``vf.Environment.generate``).

One episode is one verifiers rollout, driven turn by turn in the same order as
``MultiTurnEnv.rollout``, with sluice's engine in place of verifiers' client:

- ``reset(prompt)``: a verifiers row from sluice's prompt dict (``text`` -> ``prompt``
  messages and ``question``; ``answer``; ``info``: the ``info`` column, else the other
  columns), then ``init_state`` and ``setup_state``. Returns None: sluice has already
  rendered the prompt (set ``task.system_prompt`` to the environment's own system prompt
  if it has one). If ``setup_state`` extended ``state["prompt"]``, the added messages are
  the opening observation.
- ``step(action)``: the model's turn becomes the assistant message (with tool calls
  parsed, below) appended to the trajectory; then ``is_completed`` (the env's
  ``@vf.stop`` conditions: ``max_turns_reached``, ``no_tools_called``, ...); if not
  done, ``get_prompt_messages`` (which calls ``env_response``) and its new messages are
  the observation (roles kept: ``user``, ``tool``); a ``final_env_response`` or any stop
  condition that fires then ends the episode (the final response is not shown to the
  model, as in verifiers).
- When the episode ends: ``env.cleanup(state)`` (renders ``state["completion"]``, runs
  ``@vf.cleanup`` handlers), ``env.rubric.score_rollout(state)``, ``rubric.cleanup``.
  The reward is one part, ``{"reward": state["reward"]}`` — the rubric's weighted total
  (`workers.tasks.rewards:env_reward` gives exactly it); ``state["metrics"]`` (every reward
  function's and metric's unweighted value, e.g. ``num_turns``) and ``stop_condition``
  go to the step's ``info``. One total rather than the metrics as parts, because a
  ``RubricGroup`` (every ``MultiTurnEnv`` has one) sums rubrics whose weights are their
  own, and its zero-weight metrics are not rewards.

Tool calls: when the rollout has tools (``state["tool_defs"]``: a ``ToolEnv``'s, or a
row's ``info["tool_defs"]``; ``parse_tool_calls`` overrides), the model's text is parsed
in the Hermes format Qwen2.5/Qwen3 and vLLM's ``hermes`` parser use: each
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block (a last unclosed one
too) becomes a structured tool call (ids ``call_<turn>_<i>``), the text outside them the
message content. A block that is not a JSON object with a string ``name`` is left in the
content as text (vLLM does the same), so the turn counts as no tool call. The tools'
schemas are not added to the prompt (sluice renders prompts without ``tools=``):
describe them in the task's prompt or system prompt.

Not supported (refused when the environment is built): rubrics with group-level reward
functions (sluice scores each episode on its own, as soon as it ends) and environments
that are not a ``MultiTurnEnv``. An episode that sluice cuts (``environment.max_turns``,
``max_episode_tokens``) before verifiers' own limits end it is not scored (reward parts
empty, as for any environment); keep ``environment.max_turns`` at least the
environment's ``max_turns``. ``timeout_seconds`` of the environment is not applied
(``environment.step_timeout_s`` bounds each call). Any exception from verifiers (a
``vf.Error`` included, which verifiers itself records as the rollout's ``error``)
fails the episode, and so its group (`EpisodeFailure`).
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Mapping
from typing import Any

from workers.environments.base import Action, EpisodeFailure, StepResult
from workers.tasks.prompts import messages_of

_INSTALL = "pip install 'sluice[verifiers]' (verifiers>=0.3.1,<0.4)"
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_ENVS: dict[str, Any] = {}
_ENVS_LOCK = threading.Lock()


def _vf() -> Any:
    try:
        import verifiers as vf
    except ImportError as e:
        raise ImportError(f"the verifiers adapter needs verifiers: {_INSTALL}") from e
    if not hasattr(vf, "MultiTurnEnv"):
        raise ImportError(f"verifiers {getattr(vf, '__version__', '?')} has no classic "
                          f"API (vf.MultiTurnEnv): {_INSTALL}")
    return vf


def parse_hermes_tool_calls(text: str) -> tuple[str, list[dict[str, str]]]:
    """``(content, calls)`` of a model turn in the Hermes tool-call format (module
    docstring): each call ``{"name": str, "arguments": json str}``; the content is the
    text outside the parsed blocks, stripped."""
    calls: list[dict[str, str]] = []
    kept: list[str] = []
    pos = 0
    for m in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue  # stays in the content as text
        args = obj.get("arguments", {})
        calls.append({"name": obj["name"],
                      "arguments": args if isinstance(args, str) else json.dumps(args)})
        kept.append(text[pos:m.start()])
        pos = m.end()
    kept.append(text[pos:])
    return "".join(kept).strip(), calls


def _build(path: str, env_args: Mapping[str, Any]) -> Any:
    """The verifiers environment ``path(**env_args)``, built once per process."""
    from pipeline.imports import load_callable

    vf = _vf()
    key = f"{path}\0{json.dumps(env_args, sort_keys=True, default=repr)}"
    with _ENVS_LOCK:
        if key not in _ENVS:
            env = load_callable(path, f"verifiers env {path!r}")(**env_args)
            if not isinstance(env, vf.MultiTurnEnv):
                raise ValueError(f"verifiers env {path!r} built a {type(env).__name__}, not "
                                 "a vf.MultiTurnEnv (SingleTurnEnv, ToolEnv, ...)")
            if env.requires_group_rollouts or env.provides_advantages:
                raise ValueError(f"verifiers env {path!r}: its rubric has group-level reward "
                                 "functions, which sluice cannot run (each episode is "
                                 "scored alone)")
            _ENVS[key] = env
        return _ENVS[key]


def _row(prompt: Mapping[str, Any]) -> dict[str, Any]:
    """A verifiers dataset row (``RolloutInput``) from a sluice prompt dict."""
    text = prompt["text"]
    msgs = messages_of(text)
    question = text if isinstance(text, str) else next(
        (m["content"] for m in reversed(msgs) if m.get("role") == "user"), "")
    info = prompt.get("info")
    if not isinstance(info, Mapping | str):
        info = {k: v for k, v in prompt.items() if k not in ("text", "answer", "task")}
    ex = prompt.get("example_id")
    return {"prompt": msgs, "question": question, "answer": str(prompt.get("answer", "")),
            "info": info, "example_id": ex if isinstance(ex, int) else 0}


def _dump(messages: list[Any]) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
            for m in messages]


@functools.cache
def _client_class() -> type:
    """A verifiers ``Client`` that ``init_state`` accepts and nothing calls: the model's
    turns come from sluice's engine."""
    from verifiers.clients import Client

    class SluiceEngineClient(Client):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__(None)

        def setup_client(self, config: Any) -> None:
            return None

        async def to_native_tool(self, tool: Any) -> Any:
            return tool

        async def to_native_prompt(self, messages: Any) -> Any:
            return messages, {}

        async def get_native_response(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("sluice samples the model's turns; verifiers' client is "
                               "not used")

        async def raise_from_native_response(self, response: Any) -> None:
            return None

        async def from_native_response(self, response: Any) -> Any:
            return response

        async def close(self) -> None:
            return None

    return SluiceEngineClient


class VerifiersEnv:
    """One episode of a verifiers environment (module docstring).

    ``env``: ``"package.module:load_environment"`` (or an environment class);
    ``env_args``: its keyword arguments; ``parse_tool_calls``: parse Hermes tool calls
    from the model's text (None: when the environment declares tools)."""

    def __init__(self, env: str, env_args: Mapping[str, Any] | None = None,
                 parse_tool_calls: bool | None = None) -> None:
        self.env = _build(env, dict(env_args or {}))
        self.name = type(self.env).__name__
        self.parse_tool_calls = parse_tool_calls
        self.tools = False
        self.state: Any = None
        self.messages: list[Any] = []
        self.finished = False

    async def _lib(self, what: str, coro: Any) -> Any:
        try:
            return await coro
        except EpisodeFailure:
            raise
        except Exception as e:
            raise EpisodeFailure(f"verifiers {self.name}.{what} raised {e!r}") from e

    async def reset(self, prompt: Mapping[str, Any]) -> list[dict[str, Any]] | None:
        row = _row(prompt)
        self.state = await self._lib("init_state", self.env.init_state(
            row, client=_client_class()(), model="sluice"))
        self.state = (await self._lib("setup_state", self.env.setup_state(self.state))
                      or self.state)
        self.tools = (bool(self.state.get("tool_defs")) if self.parse_tool_calls is None
                      else self.parse_tool_calls)
        self.messages = list(self.state["prompt"])
        added = self.messages[len(row["prompt"]):]
        return _dump(added) or None

    def _assistant(self, action: Action) -> Any:
        from verifiers.types import AssistantMessage, ToolCall

        if not self.tools:
            return AssistantMessage(content=action.text)
        content, calls = parse_hermes_tool_calls(action.text)
        if not calls:
            return AssistantMessage(content=action.text)
        return AssistantMessage(
            content=content or None,
            tool_calls=[ToolCall(id=f"call_{action.turn}_{i}", name=c["name"],
                                 arguments=c["arguments"]) for i, c in enumerate(calls)])

    async def _completed(self) -> bool:
        done = bool(await self._lib("is_completed", self.env.is_completed(self.state)))
        if done and self.state.get("stop_condition") == "has_error":
            raise EpisodeFailure(f"verifiers {self.name}: the rollout failed: "
                                 f"{self.state.get('error')!r}")
        return done

    async def step(self, action: Action) -> StepResult:
        from verifiers.types import TrajectoryStep

        if self.state is None or self.finished:
            raise EpisodeFailure("step() before reset() or after the episode ended")
        reply = [self._assistant(action)]
        self.state["trajectory"].append(TrajectoryStep(
            prompt=self.messages, completion=reply, response=None, tokens=None,
            reward=None, advantage=None, is_truncated=False,
            trajectory_id=self.state["trajectory_id"], extras={}))
        self.messages = [*self.messages, *reply]
        if await self._completed():
            return await self._finish()
        nxt = list(await self._lib("env_response", self.env.get_prompt_messages(self.state)))
        if nxt[:len(self.messages)] != self.messages:
            raise EpisodeFailure(f"verifiers {self.name}: get_prompt_messages rewrote the "
                                 "conversation; only conversations that grow turn by turn "
                                 "can run in sluice")
        obs, self.messages = nxt[len(self.messages):], nxt
        if await self._completed() or self.state.get("final_env_response") is not None:
            return await self._finish()
        return StepResult(_dump(obs) or None, {}, False, {})

    async def _finish(self) -> StepResult:
        self.finished = True
        env, state = self.env, self.state
        await self._lib("cleanup", env.cleanup(state))
        if getattr(env, "score_rollouts", True):
            await self._lib("rubric.score_rollout", env.rubric.score_rollout(state))
        else:
            await self._lib("rubric.dummy_score_rollout", env.rubric.dummy_score_rollout(state))
        await self._lib("rubric.cleanup", env.rubric.cleanup(state))
        reward = state.get("reward")
        if not isinstance(reward, int | float):
            raise EpisodeFailure(f"verifiers {self.name}: the rubric gave reward {reward!r}")
        info = {"metrics": dict(state.get("metrics") or {}),
                "stop_condition": state.get("stop_condition")}
        return StepResult(None, {"reward": float(reward)}, True, info)

    async def close(self) -> None:
        """An episode sluice cut short still runs verifiers' cleanup handlers."""
        if self.state is not None and not self.finished:
            self.finished = True
            await self._lib("cleanup", self.env.cleanup(self.state))
