"""Tools as plain functions (`workers.environments.tools`): schemas from signature and
docstring, call parsing (Hermes blocks and a tokenizer's response_template), TRL's failure
rules with a timeout, the chat-template check at start (Qwen2.5's template, as TRL ships
it, passes; plain ChatML is refused), the config keys, and whole episodes through the
environment runner on the tiny BPE model with Qwen2.5's template: model turns mask 1 and
exact, tool results mask 0 and exactly the template's ``tool`` rendering, counters."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.config import Config, ConfigError
from pipeline.model import load_tokenizer
from pipeline.rollout_meter import RolloutMeter
from tests.helpers import CHATML, build_bpe_model
from tests.tool_model import add as add  # a tool named by this module's path (ME)
from workers.engines.base import Completion, SamplingParams
from workers.environments import Action
from workers.environments.runner import EnvironmentRunner, episode_prompt
from workers.environments.tools import (
    ToolBox,
    ToolCall,
    check_template,
    load_tools,
    parse_hermes,
    parse_tool_calls,
)
from workers.episodes import RolloutContext, TurnBatcher
from workers.hooks import load_rollout, tool_stats

torch.set_num_threads(1)
trl = pytest.importorskip("trl")  # for Qwen2.5's chat template, as TRL ships it
QWEN25 = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
ME = "tests.unit.test_tools"



async def slow_echo(text: str, delay_s: float = 0.0) -> str:
    """Echo a text after a delay.

    Args:
        text: What to echo.
        delay_s: Seconds to wait first.
    """
    await asyncio.sleep(delay_s)
    return text


def sleepy(seconds: float) -> str:
    """Sleep in a worker thread.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


def broken(x: int) -> int:
    """Always raises.

    Args:
        x: Ignored.
    """
    raise RuntimeError(f"no luck with {x}")


def undocumented(x: int) -> int:
    return x


TOOLS = [f"{ME}:add", f"{ME}:slow_echo", f"{ME}:sleepy", f"{ME}:broken"]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny BPE model with Qwen2.5's chat template (its tokens are ChatML's)."""
    d = build_bpe_model(tmp_path_factory.mktemp("bpe") / "m")
    tok = load_tokenizer(d)
    tok.chat_template = QWEN25
    tok.save_pretrained(d)
    return d


# ---------------------------------------------------------------- schemas and parsing


def test_schemas_come_from_signature_and_docstring() -> None:
    tools = load_tools([f"{ME}:add", f"{ME}:slow_echo"])
    assert [t.name for t in tools] == ["add", "slow_echo"]
    fn = tools[0].schema["function"]
    assert tools[0].schema["type"] == "function" and fn["description"] == "Add two integers."
    assert fn["parameters"]["properties"]["a"] == {"type": "integer",
                                                   "description": "The first integer."}
    assert fn["parameters"]["required"] == ["a", "b"]
    assert tools[1].schema["function"]["parameters"]["required"] == ["text"]


@pytest.mark.parametrize(("paths", "match"), [
    ([f"{ME}:undocumented"], "has no tool schema"),
    ([f"{ME}:nothing"], "has no attribute"),
    ([f"{ME}:add", f"{ME}:add"], "two tools are named 'add'"),
    ([f"{ME}:TOOLS"], "not callable"),
])
def test_bad_tools_name_the_key(paths: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match) as e:
        load_tools(paths)
    assert str(e.value).startswith("environment.tools")


def test_parse_hermes_blocks() -> None:
    text = ('thinking <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
            '<tool_call>{"type": "function", "function": {"name": "slow_echo", '
            '"arguments": "{\\"text\\": \\"x\\"}"}}</tool_call><|im_end|>')
    assert parse_hermes(text) == [ToolCall("add", {"a": 1, "b": 2}),
                                  ToolCall("slow_echo", {"text": "x"})]
    assert parse_hermes("just an answer: 42") == []
    with pytest.raises(ValueError, match="malformed tool call"):
        parse_hermes('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>')
    with pytest.raises(ValueError, match="malformed tool call"):
        parse_hermes('<tool_call>{"arguments": {}}</tool_call>')


def test_parse_tool_calls_from_token_ids(qwen_dir: Path) -> None:
    tok = load_tokenizer(qwen_dir)
    ids = tok('<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
              '<|im_end|>', add_special_tokens=False).input_ids
    assert parse_tool_calls(tok, ids, "") == [ToolCall("add", {"a": 3, "b": 4})]
    bad = tok('<tool_call>{"name": "add"', add_special_tokens=False).input_ids
    assert parse_tool_calls(tok, bad, "") == []  # TRL: a malformed call is plain content


def test_parse_tool_calls_reads_a_response_template(qwen_dir: Path) -> None:
    """A tokenizer that ships a response_template is parsed by transformers' parser, with
    the arguments typed by the tool's schema (TRL's qwen3 template, built here)."""
    tok = load_tokenizer(qwen_dir)
    tok.response_template = {
        "defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n",
        "fields": {"tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*",
                                  "repeats": True, "content": "json",
                                  "transform": {"type": "function", "function": "{content}"}},
                   "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"}}}
    schemas = [t.schema for t in load_tools([f"{ME}:add"])]
    ids = tok('<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
              '<|im_end|>', add_special_tokens=False).input_ids
    prefix = "<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"
    assert parse_tool_calls(tok, ids, prefix, schemas) == [ToolCall("add", {"a": 3, "b": 4})]
    plain = tok("no call<|im_end|>", add_special_tokens=False).input_ids
    assert parse_tool_calls(tok, plain, prefix, schemas) == []
    check_template(tok, schemas)  # the round trip goes through the response_template too


# ---------------------------------------------------------------- template checks


def test_qwen25_template_passes_and_plain_chatml_is_refused(qwen_dir: Path) -> None:
    tok = load_tokenizer(qwen_dir)
    schemas = [t.schema for t in load_tools(TOOLS)]
    check_template(tok, schemas)
    tok.chat_template = CHATML  # content only: ignores tools= and tool_calls
    with pytest.raises(ValueError, match="does not render tools"):
        check_template(tok, schemas)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        check_template(tok, schemas)


def _cfg(model: Path, **env: Any) -> Config:
    return Config.model_validate({
        "model": {"path": str(model), "init": ""},
        "environment": {"tools": TOOLS, "max_turns": 3, "max_episode_tokens": 600, **env}})


def test_config_keys_and_start_errors(qwen_dir: Path, tmp_path: Path) -> None:
    cfg = _cfg(qwen_dir)
    assert cfg.environment.enabled and cfg.multi_turn and cfg.max_rollout_tokens == 600
    assert cfg.scoring.rewards[0].fn == "workers.tasks.rewards:copy_reward"  # not env_reward
    with pytest.raises(ValueError, match=r"environment\.tools: the tools run as an environment"):
        _cfg(qwen_dir, name="workers.environments.builtin:GuessNumber")
    with pytest.raises(ValueError, match=r"environment\.tool_timeout_s: 30s must be below"):
        _cfg(qwen_dir, tool_timeout_s=30.0)
    with pytest.raises(ValueError, match=r"environment\.tools"):
        _cfg(qwen_dir, tools=["not a path"])
    with pytest.raises(ConfigError, match=r"environment\.tools: .*has no tool schema"):
        load_rollout(_cfg(qwen_dir, tools=[f"{ME}:undocumented"]))
    chatml = build_bpe_model(tmp_path / "chatml")  # the plain ChatML template
    with pytest.raises(ConfigError, match=r"environment\.tools: the model's chat template "
                                          r"does not render tools"):
        load_rollout(_cfg(chatml), load_tokenizer(chatml))
    load_rollout(_cfg(chatml))  # no tokenizer (preflight before the model exists): no check


# ---------------------------------------------------------------- running calls


def test_calls_results_and_failures_as_trl_counts_them() -> None:
    box = ToolBox(load_tools(TOOLS), timeout_s=0.5, max_turns=4)
    calls = [ToolCall("add", {"a": 2, "b": 3}), ToolCall("slow_echo", {"text": "hi"}),
             ToolCall("broken", {"x": 7}), ToolCall("nope", {}),
             ToolCall("add", {"a": 1}), ToolCall("sleepy", {"seconds": 4.0}),
             ToolCall("add", [1, 2]), ToolCall("add", {"a": 1, "b": 1}, kind="other")]
    out, elapsed_s = asyncio.run(_gather(box, calls))
    assert elapsed_s < 3.5  # the turn did not wait for the 4 s thread past its 0.5 s timeout
    assert out[:4] == ["5", "hi", str({"error": "no luck with 7"}),
                       str({"error": "Tool nope not found."})]
    assert out[4].startswith("{'error': ") and "missing 1 required positional" in out[4]
    assert out[5] == str({"error": "Tool sleepy timed out after 0.5s"})
    assert out[6] == str({"error": "arguments must be an object, got list"})
    assert out[7] == str({"error": "Unsupported tool call type: other"})
    snap = box.stats.snapshot()
    assert {k: (v["calls"], v["failures"]) for k, v in snap.items()} == {
        "add": (4, 3), "slow_echo": (1, 0), "broken": (1, 1), "nope": (1, 1),
        "sleepy": (1, 1)}
    assert 0.45 < snap["sleepy"]["latency_s"] < 1.5


async def _gather(box: ToolBox, calls: list[ToolCall]) -> tuple[list[str], float]:
    t0 = time.perf_counter()
    out = list(await asyncio.gather(*(box.run(c) for c in calls)))
    return out, time.perf_counter() - t0


# ---------------------------------------------------------------- episodes


class ScriptedEngine:
    """Answers request k with ``turns[k]``; logprob -0.5 and version 3 per token."""

    def __init__(self, turns: list[list[int]], eos: int) -> None:
        self.turns, self.eos = [list(t) for t in turns], eos
        self.contexts: list[list[int]] = []

    async def generate(self, prompts: list[list[int]], n: int,
                       params: SamplingParams) -> list[list[Completion]]:
        out = []
        for p in prompts:
            self.contexts.append(list(p))
            ids = self.turns.pop(0)[:params.max_new_tokens]
            out.append([Completion(np.array(ids, np.int32), np.full(len(ids), -0.5, np.float32),
                                   np.full(len(ids), 3, np.int32),
                                   "stop" if ids and ids[-1] == self.eos else "length")])
        return out


def _runs(mask: np.ndarray, value: int) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate([*mask.tolist(), -1]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            out.append((start, i))
            start = None
    return out


def _episode(qwen_dir: Path, turns: list[str], max_turns: int = 3) -> tuple[Any, ...]:
    tok = load_tokenizer(qwen_dir)
    eos = tok.eos_token_id
    cfg = _cfg(qwen_dir, max_turns=max_turns)
    rollout = load_rollout(cfg, tok)
    runner: EnvironmentRunner = rollout.runner  # type: ignore[union-attr]
    eng = ScriptedEngine([[*tok(t, add_special_tokens=False).input_ids, eos] for t in turns],
                         eos)
    ids, conv = episode_prompt(tok, "Copy 12=", tools=runner.tools)
    ctx = RolloutContext({"text": "Copy 12=", "answer": "12"}, ids, 1, SamplingParams(200),
                         tok, TurnBatcher(eng), conversation=conv)
    (e,) = asyncio.run(runner.group(ctx))
    return tok, e, ctx, eng, rollout


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 5, "b": 7}}\n</tool_call>'
TWO = (CALL + '\n<tool_call>\n{"name": "broken", "arguments": {"x": 1}}\n</tool_call>')


def test_episode_runs_calls_and_renders_as_the_template(qwen_dir: Path) -> None:
    """Two tool turns, then an answer: the sequence is exactly the template's rendering of
    the prompt (with the tools) and the episode's messages; model tokens mask 1 with their
    logprobs, tool results mask 0 and logprob 0; the failure is the model's to read."""
    tok, e, ctx, eng, rollout = _episode(qwen_dir, [TWO, CALL, "12"])
    assert e.finish_reason == "stop" and e.turns == 3
    want_msgs = [
        {"role": "assistant", "content": TWO},
        {"role": "tool", "name": "add", "content": "12"},
        {"role": "tool", "name": "broken", "content": str({"error": "no luck with 1"})},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "name": "add", "content": "12"},
        {"role": "assistant", "content": "12"}]
    assert e.messages == want_msgs
    schemas = rollout.runner.tools
    want = tok.apply_chat_template([{"role": "user", "content": "Copy 12="}, *want_msgs],
                                   tools=schemas, tokenize=False)
    got = tok.decode(ctx.prompt_ids + e.token_ids.tolist())
    assert got + "\n" == want  # the template closes the last turn with eos + "\n"
    assert "# Tools" in tok.decode(ctx.prompt_ids) and '"name": "add"' in tok.decode(
        ctx.prompt_ids)  # the prompt shows the schemas
    model, (opening, *tool) = _runs(e.mask, 1), _runs(e.mask, 0)
    assert len(model) == 3 and len(tool) == 2
    assert tok.decode(e.token_ids[opening[0]:opening[1]].tolist()) == "<|im_start|>assistant\n"
    assert (e.logprobs[e.mask == 1] == -0.5).all() and (e.logprobs[e.mask == 0] == 0).all()
    assert all("<tool_response>" in tok.decode(e.token_ids[s:t].tolist()) for s, t in tool)
    starts = [s for s, _ in model]  # each turn continued the exact sequence so far
    assert eng.contexts == [ctx.prompt_ids + e.token_ids[:s].tolist() for s in starts]
    stats = tool_stats(rollout)
    assert stats is not None
    assert {k: (v["calls"], v["failures"]) for k, v in stats.items()} == {
        "add": (2, 0), "broken": (1, 1)}


def test_calls_in_the_last_allowed_turn_are_not_run(qwen_dir: Path) -> None:
    """max_turns = 2 is TRL's max_tool_calling_iterations = 1: the second turn's call is
    left unexecuted and the episode ends length."""
    _, e, _, _, rollout = _episode(qwen_dir, [CALL, CALL], max_turns=2)
    assert e.finish_reason == "length" and e.turns == 2
    assert [m["role"] for m in e.messages] == ["assistant", "tool", "assistant"]
    assert tool_stats(rollout) == {"add": {"calls": 1, "failures": 0,
                                           "latency_s": tool_stats(rollout)["add"]["latency_s"]}}


def test_a_turn_without_calls_ends_the_episode(qwen_dir: Path) -> None:
    _, e, *_ = _episode(qwen_dir, ["Copy 12"])
    assert e.finish_reason == "stop" and e.turns == 1
    assert len(_runs(e.mask, 0)) == 1 and e.mask[-1] == 1  # the opening, then the answer


def test_step_reads_the_actions_tokens_not_its_text(qwen_dir: Path) -> None:
    tok = load_tokenizer(qwen_dir)
    box = ToolBox(load_tools([f"{ME}:add"]), timeout_s=1.0, max_turns=3, tokenizer=tok)
    ids = tok(CALL + "<|im_end|>", add_special_tokens=False).input_ids
    res = asyncio.run(box().step(Action("ignored", list(ids), 0)))
    assert res.observation == [{"role": "tool", "name": "add", "content": "12"}]
    assert not res.done


# ---------------------------------------------------------------- metrics


def _beat(completions: int, **tools: tuple[int, int, float]) -> dict[str, Any]:
    return {"completions": completions, "tools": {
        k: {"calls": c, "failures": f, "latency_s": lat} for k, (c, f, lat) in tools.items()}}


def test_meter_counts_a_fresh_runs_first_beat_in_full() -> None:
    """In a fresh run the calls made before the trainer's first read (those of the groups
    its first step trained) count in that step: the generator's counts start at 0."""
    m = RolloutMeter()
    assert m.update({"g1": _beat(8, add=(4, 1, 0.4))}) == {
        "tools/add/calls": 4.0, "tools/add/failures": 1.0,
        "tools/add/latency_s": pytest.approx(0.1), "tools/call_frequency": 0.5,
        "tools/failure_frequency": 0.25}
    out = m.update({"g1": _beat(10, add=(6, 1, 0.6))})
    assert out["tools/add/calls"] == 2 and out["tools/add/failures"] == 0


def test_meter_turns_heartbeat_counters_into_step_series() -> None:
    m = RolloutMeter(resumed=True)
    assert m.update({"g1": {"completions": 5}}) == {}  # a run without tools: no series
    assert m.update({"g1": _beat(8, add=(4, 1, 0.4))}) == {
        "tools/add/calls": 0.0, "tools/add/failures": 0.0,
        "tools/failure_frequency": 0.0}  # after a resume the first beat is the baseline
    out = m.update({"g1": _beat(16, add=(10, 2, 1.0), echo=(2, 2, 0.5)),
                    "g2": _beat(3, add=(1, 0, 0.1))})
    assert out["tools/add/calls"] == 6 and out["tools/add/failures"] == 1
    assert out["tools/add/latency_s"] == pytest.approx(0.1)
    assert out["tools/echo/calls"] == 2 and out["tools/echo/latency_s"] == pytest.approx(0.25)
    assert out["tools/call_frequency"] == pytest.approx(8 / 8)
    assert out["tools/failure_frequency"] == pytest.approx(3 / 8)
    out = m.update({"g1": _beat(2, add=(1, 1, 0.3)), "g2": _beat(3, add=(1, 0, 0.1))})
    assert out["tools/add/calls"] == 1 and out["tools/add/failures"] == 1  # g1 restarted
    assert out["tools/echo/calls"] == 0 and "tools/echo/latency_s" not in out
    assert out["tools/call_frequency"] == pytest.approx(1 / 2)
    assert m.update({"g2": {"completions": 3, "tools": "garbage"}})["tools/add/calls"] == 0


def test_the_example_config_loads_and_its_tools_build(qwen_dir: Path) -> None:
    """examples/tools.toml (`sluice up`-level: the config validates, its tools and reward
    import, and the tools pass the template check on Qwen2.5's template, its model's)."""
    from pipeline.config import load_config
    from tests.helpers import ROOT
    from workers.tasks.rewards import load_reward

    cfg = load_config(ROOT / "examples" / "tools.toml", [])
    tools = load_tools(cfg.environment.tools)
    assert [t.name for t in tools] == ["add", "multiply"]
    check_template(load_tokenizer(qwen_dir), [t.schema for t in tools])
    rf = load_reward(cfg.scoring.rewards[0].fn)
    got = rf.fn(completions=["<tool_response>\n12\n</tool_response>assistant\n12", "7"],
                answer=["12", "8"])
    assert got == [1.0, 0.0]
