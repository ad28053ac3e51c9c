"""Tools as plain Python functions (TRL's ``GRPOTrainer(tools=[...])``), run as an environment.

``environment.tools = ["pkg.mod:fn", ...]`` names the functions (sync or async); each one's
JSON schema comes from its signature and Google-style docstring through transformers'
``get_json_schema`` (what ``apply_chat_template(tools=[fn])`` does with a callable, and so
what TRL's prompts carry), built once at start: a function without a docstring or type
hints fails there, naming the key. The schemas go to the chat template (``tools=``) at
every rendering of an episode (`workers.environments.runner`), so the model sees them as
its template shows tools.

One episode is the environment runner's loop with `ToolCalling` as the environment: after
each model turn, `parse_tool_calls` reads the turn's tool calls; none ends the episode (the
turn is the answer); otherwise every call runs (concurrently, each under
``environment.tool_timeout_s``; a plain function in a worker thread) and the results come
back as ``{"role": "tool", "name": ..., "content": str(result)}`` messages, which the
runner renders with the template's ``tool`` role and inserts with mask 0. Model tokens stay
exactly as sampled (mask 1); nothing is re-tokenised.

TRL's semantics, and where sluice differs:

- a failure is what TRL counts as one: the function raised (the content is then TRL's
  ``str({"error": str(e)})``), the name is no configured tool (``Tool <name> not found.``),
  or the call is not of type ``function``; sluice adds a call over the timeout. A failure
  is the model's mistake, not the episode's: the episode goes on with the error as the
  tool's answer. A tool that raises never kills the group (an environment that raises
  does).
- a turn whose tool calls do not parse (TRL: ``parse_response`` fails) is plain content:
  no calls, the episode ends there.
- ``environment.max_turns = k + 1`` is TRL's ``max_tool_calling_iterations = k``: calls in
  the last allowed turn are not run (TRL leaves them unexecuted too); the episode then ends
  ``length``, as any episode cut by the turn budget does.
- TRL runs a turn's sync tools one after another and gathers its async ones (sync results
  first); sluice runs all of a turn's calls concurrently and keeps the model's order.
- the assistant messages of ``Episode.messages`` carry the turn's text (its tool-call
  markup included), not TRL's parsed ``tool_calls`` field.

Call parsing (`parse_tool_calls`): a tokenizer that ships a ``response_template``
(transformers' response parsing, what TRL uses) is parsed with
``tokenizer.parse_response``; any other is read in the Hermes format that Qwen2.5, Qwen3
and Hermes templates write, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
`check_template` proves at start that the model's template renders the tools, an assistant
tool call and a tool message, and that what it writes for a call parses back to that call;
a template that cannot (SmolLM2-135M-Instruct's plain ChatML ignores ``tools`` and
``tool_calls``) is a start error naming ``environment.tools``.

Statistics (`ToolStats`): per tool, calls, failures and the summed latency, per process;
the generator's heartbeat carries them and the trainer turns them into the ``tools/*``
series of its step rows (`pipeline.rollout_meter`).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.imports import load_callable
from workers.environments.base import Action, StepResult

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class Tool:
    """One configured function: its name (the schema's, i.e. the function's ``__name__``),
    the callable, and the JSON schema the chat template renders."""

    name: str
    fn: Any
    schema: dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    """A call as parsed from a model turn: ``kind`` is the call's type (``function``)."""

    name: str
    arguments: Any
    kind: str = "function"


def load_tools(paths: Sequence[str], key: str = "environment.tools") -> list[Tool]:
    """The functions ``paths`` name, with their schemas; ``ValueError`` naming ``key`` and
    the path when one does not import, is not a function, has no schema (transformers'
    ``get_json_schema``: a docstring with an ``Args:`` line per parameter, type hints), or
    shares its name with another."""
    from transformers.utils import get_json_schema

    tools: list[Tool] = []
    for path in paths:
        fn = load_callable(path, f"{key}: {path!r}")
        if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
            raise ValueError(f"{key}: {path!r} is a {type(fn).__name__}; a tool is a plain "
                             "function (sync or async)")
        try:
            schema = get_json_schema(fn)
        except Exception as e:
            raise ValueError(f"{key}: {path!r} has no tool schema: {e}") from None
        name = str(schema["function"]["name"])
        if any(t.name == name for t in tools):
            raise ValueError(f"{key}: two tools are named {name!r}")
        tools.append(Tool(name, fn, schema))
    return tools


def _call_of(item: Any) -> ToolCall:
    """A call from TRL's shapes: ``{"type", "function": {"name", "arguments"}}`` or the
    flat ``{"name", "arguments"}``; arguments given as a JSON string are decoded."""
    if not isinstance(item, Mapping):
        raise ValueError("a tool call must be a map")
    kind = str(item.get("type", "function"))
    fn = item.get("function", item)
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ValueError("a tool call needs a string name")
    args = fn.get("arguments", fn.get("parameters"))
    if isinstance(args, str):
        args = json.loads(args)
    return ToolCall(fn["name"], {} if args is None else args, kind)


def parse_hermes(text: str) -> list[ToolCall]:
    """The ``<tool_call>JSON</tool_call>`` blocks of ``text``; ``ValueError`` when a block
    is not a JSON call (TRL then takes the whole turn as plain content)."""
    calls = []
    for block in _HERMES.findall(text):
        try:
            calls.append(_call_of(json.loads(block)))
        except (json.JSONDecodeError, ValueError) as e:
            raise ValueError(f"malformed tool call {block[:60]!r}: {e}") from None
    return calls


def parse_tool_calls(tokenizer: Any, token_ids: Sequence[int], prefix: str,
                     schemas: list[dict[str, Any]] | None = None) -> list[ToolCall]:
    """The tool calls of one model turn (module docstring): the tokenizer's
    ``response_template`` when it has one (``prefix``: the rendered context before the
    turn, at least the assistant header), else the Hermes blocks of the turn's text
    (special tokens kept). A turn that does not parse has no calls, as in TRL."""
    try:
        if getattr(tokenizer, "response_template", None) is not None:
            try:
                parsed = tokenizer.parse_response(list(token_ids), prefix=prefix, tools=schemas)
            except TypeError:  # transformers < 5.15: no tools= (arguments left untyped)
                parsed = tokenizer.parse_response(list(token_ids), prefix=prefix)
            if not isinstance(parsed, Mapping):
                return []
            return [_call_of(c) for c in parsed.get("tool_calls") or []]
        text = str(tokenizer.decode(list(token_ids), skip_special_tokens=False))
        return parse_hermes(text)
    except (ValueError, TypeError, AttributeError):
        return []


def _render(tokenizer: Any, messages: list[dict[str, Any]], schemas: list[dict[str, Any]],
            generation_prompt: bool) -> str:
    return str(tokenizer.apply_chat_template(messages, tools=schemas or None, tokenize=False,
                                             add_generation_prompt=generation_prompt))


def check_template(tokenizer: Any, schemas: list[dict[str, Any]]) -> None:
    """``ValueError`` (its text says what is missing) unless the tokenizer's chat template
    can hold a tool-calling episode: it renders the tools' names when given ``tools=``, an
    assistant turn's ``tool_calls`` (name and arguments) and a ``tool`` message (TRL's
    ``supports_tool_calling``), and the text it writes for an assistant's call parses back
    (`parse_tool_calls`) to that very call, so calls the model learns to write are read."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template, so the tools cannot be "
                         "shown to the model")
    user = [{"role": "user", "content": "u"}]
    shown = _render(tokenizer, user, schemas, True)
    missing = [s["function"]["name"] for s in schemas if s["function"]["name"] not in shown]
    if missing:
        raise ValueError(f"the model's chat template does not render tools (tools= left "
                         f"out {missing}); use a model whose template does (Qwen2.5, Qwen3, "
                         "Llama 3.1, ...) or give the model folder such a chat template")
    name = schemas[0]["function"]["name"]
    call = {"type": "function", "function": {"name": name,
                                             "arguments": {"sluice_arg": "probe_7f3a"}}}
    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    tool_msg = {"role": "tool", "name": name, "content": "result_c4f9"}
    try:
        text = _render(tokenizer, [*user, turn, tool_msg], schemas, False)
    except Exception as e:
        raise ValueError(f"the model's chat template cannot render a tool call and its "
                         f"result: {e!r}") from None
    lost = [s for s in ("sluice_arg", "probe_7f3a", "result_c4f9") if s not in text]
    if lost:
        raise ValueError("the model's chat template drops an assistant's tool_calls or a "
                         "tool message (it renders message content only), so it cannot "
                         "hold a tool-calling episode")
    full = _render(tokenizer, [*user, turn], schemas, False)
    if not full.startswith(shown):
        raise ValueError("the model's chat template renders the conversation differently "
                         "once an assistant turn follows; it cannot be extended turn by turn")
    ids = list(tokenizer(full[len(shown):], add_special_tokens=False).input_ids)
    got = parse_tool_calls(tokenizer, ids, shown, schemas)
    if got != [ToolCall(name, {"sluice_arg": "probe_7f3a"})]:
        raise ValueError(f"the model's chat template writes a tool call as "
                         f"{full[len(shown):][:120]!r}, which sluice does not parse back "
                         "(it reads the tokenizer's response_template, else "
                         "<tool_call>JSON</tool_call> blocks)")


@dataclass
class ToolStats:
    """Per-tool counters of one process (thread-safe: plain tools end in worker threads).
    ``snapshot`` is what the generator's heartbeat carries."""

    calls: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    latency_s: dict[str, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, name: str, failed: bool, latency_s: float) -> None:
        with self._lock:
            self.calls[name] = self.calls.get(name, 0) + 1
            self.failures[name] = self.failures.get(name, 0) + int(failed)
            self.latency_s[name] = self.latency_s.get(name, 0.0) + latency_s

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{tool: {"calls", "failures", "latency_s"}}``, cumulative since the process
        started (``latency_s`` summed over calls, rounded to the microsecond)."""
        with self._lock:
            return {n: {"calls": c, "failures": self.failures[n],
                        "latency_s": round(self.latency_s[n], 6)}
                    for n, c in self.calls.items()}


class ToolBox:
    """The configured tools of one process: the environment factory of the runner (each
    call builds one episode's `ToolCalling`), the schemas for the template, the parser's
    prefix, and the statistics every episode adds to. ``tokenizer`` is the policy's
    (parsing decodes with it); ``max_turns`` is the runner's, so the last turn's calls are
    left unexecuted (module docstring)."""

    def __init__(self, tools: list[Tool], *, timeout_s: float, max_turns: int,
                 tokenizer: Any = None) -> None:
        self.tools = {t.name: t for t in tools}
        self.schemas = [t.schema for t in tools]
        self.timeout_s = timeout_s
        self.max_turns = max_turns
        self.tokenizer = tokenizer
        self.stats = ToolStats()
        self.prefix = ""
        if tokenizer is not None and getattr(tokenizer, "chat_template", None):
            self.prefix = str(tokenizer.apply_chat_template(
                [{"role": "user", "content": "u"}], tools=self.schemas, tokenize=False,
                add_generation_prompt=True))

    def __call__(self) -> ToolCalling:
        return ToolCalling(self)

    async def run(self, call: ToolCall) -> str:
        """One call's tool message content; the call counted (a failure as TRL counts
        one, plus a timeout) with its latency."""
        t0 = time.perf_counter()
        failed = True
        try:
            if call.kind != "function":
                return str({"error": f"Unsupported tool call type: {call.kind}"})
            tool = self.tools.get(call.name)
            if tool is None:
                return str({"error": f"Tool {call.name} not found."})
            try:
                result = await asyncio.wait_for(self._invoke(tool, call.arguments),
                                                self.timeout_s)
            except TimeoutError:
                return str({"error": f"Tool {call.name} timed out after "
                                     f"{self.timeout_s:g}s"})
            except Exception as e:
                return str({"error": str(e)})
            failed = False
            return str(result)
        finally:
            self.stats.record(call.name, failed, time.perf_counter() - t0)

    @staticmethod
    async def _invoke(tool: Tool, arguments: Any) -> Any:
        if not isinstance(arguments, Mapping):
            raise TypeError(f"arguments must be an object, got {type(arguments).__name__}")
        if inspect.iscoroutinefunction(tool.fn):
            return await tool.fn(**arguments)
        out = await asyncio.to_thread(tool.fn, **arguments)  # a timed-out thread runs on
        return await out if inspect.isawaitable(out) else out


class ToolCalling:
    """One episode's environment: every turn's tool calls run, their results are the
    observation; a turn without calls ends the episode. No reward of its own (the run's
    reward functions score the transcript)."""

    def __init__(self, box: ToolBox) -> None:
        self.box = box
        self.calls = 0

    async def reset(self, prompt: Mapping[str, Any]) -> None:
        return None

    async def step(self, action: Action) -> StepResult:
        box = self.box
        calls = parse_tool_calls(box.tokenizer, action.token_ids, box.prefix, box.schemas)
        if not calls:
            return StepResult(None, {}, True, {"tool_calls": self.calls})
        if action.turn + 1 >= box.max_turns:  # no turn would read the results
            return StepResult(None, {}, False, {"unexecuted_calls": len(calls)})
        results = await asyncio.gather(*(box.run(c) for c in calls))
        self.calls += len(calls)
        return StepResult([{"role": "tool", "name": c.name, "content": r}
                           for c, r in zip(calls, results, strict=True)], {}, False)
