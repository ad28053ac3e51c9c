"""The verifiers and OpenEnv adapters with real environment classes of those libraries
(`tests.adapter_envs`): driven by hand with fixed turns, and by the environment runner
against the in-process engine with the tiny model (`tests/vllm/test_env_adapters_vllm.py`
runs the same episodes against a vLLM server)."""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verifiers", reason="pip install -e '.[environments]'")
pytest.importorskip("openenv.core", reason="pip install -e '.[environments]'")

from pipeline.config import ConfigError, load_config
from pipeline.model import load_model
from tests.adapter_envs import (
    GUESS,
    GUESS_ANSWER,
    check_echo_episode,
    check_episode,
    check_guess_episode,
    expected_guess_reward,
    generate_echo_env,
    guess_reply,
    make_runner,
    run_group,
)
from workers.engines.transformers import TransformersEngine
from workers.environments.base import Action, EpisodeFailure
from workers.environments.openenv_adapter import OpenEnvEnv, text_field
from workers.environments.runner import EnvironmentRunner
from workers.environments.verifiers_adapter import (
    VerifiersEnv,
    parse_hermes_tool_calls,
)

VF = "workers.environments.verifiers_adapter:VerifiersEnv"
OE = "workers.environments.openenv_adapter:OpenEnvEnv"
ECHO_OPENING = "Sluice Echo environment ready!"


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def echo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    root = tmp_path_factory.mktemp("openenv")
    paths = generate_echo_env(root)
    yield paths
    sys.path.remove(str(root))


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Any]:
    model, tok = load_model(tiny_model_dir)
    return TransformersEngine(model, tok, seed=0), tok


def episodes(runner: EnvironmentRunner, engine: Any, tok: Any, prompt: dict[str, Any],
             n: int = 4) -> list[Any]:
    return run(run_group(runner, engine, tok, prompt, n))


# --- verifiers, by hand ---------------------------------------------------------------


def test_hermes_tool_calls_parse_into_structured_calls() -> None:
    text = ('Adding. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
            '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call> then '
            '<tool_call>{"name": "g"}')
    content, calls = parse_hermes_tool_calls(text)
    assert content == "Adding.  then"
    assert calls == [{"name": "add", "arguments": json.dumps({"a": 2, "b": 3})},
                     {"name": "f", "arguments": '{"x": 1}'},  # string arguments kept as is
                     {"name": "g", "arguments": "{}"}]  # a last unclosed block counts
    bad = 'x <tool_call>{"name": 1}</tool_call> <tool_call>not json</tool_call>'
    assert parse_hermes_tool_calls(bad) == (bad.strip(), [])  # left as text, as vLLM does


def test_verifiers_guess_observations_and_reward_are_the_envs() -> None:
    async def go(turns: list[str], max_turns: int) -> list[Any]:
        env = VerifiersEnv("tests.adapter_envs:load_guess", {"max_turns": max_turns})
        assert await env.reset(GUESS) is None  # the prompt is sluice's, already rendered
        out = [await env.step(Action(t, [], i)) for i, t in enumerate(turns)]
        await env.close()
        return out

    # verifiers' max_turns ends it: the env's replies as user messages, then the rubric
    res = run(go(["abc", "4", "9"], 3))
    assert [r.observation for r in res[:2]] == [
        [{"role": "user", "content": guess_reply("abc", GUESS_ANSWER)}],
        [{"role": "user", "content": "Wrong, go higher."}]]
    assert [r.done for r in res] == [False, False, True] and res[2].observation is None
    assert res[2].reward == {"reward": expected_guess_reward(["abc", "4", "9"])}
    assert res[2].info["stop_condition"] == "max_turns_reached"
    assert res[2].info["metrics"] == {"correct": 0.0, "length": 0.05, "num_turns": 3.0}
    # the right guess: env_response's final_env_response ends it (not shown to the model)
    res = run(go(["4", "7"], 5))
    assert res[1].done and res[1].observation is None
    assert res[1].info["stop_condition"] == "has_final_env_response"
    assert res[1].reward == {"reward": 1.0 + 0.5 * 0.02}


def test_verifiers_tool_env_runs_a_hermes_tool_call() -> None:
    async def go(turns: list[str]) -> list[Any]:
        env = VerifiersEnv("tests.adapter_envs:load_tools")
        await env.reset({"text": "What is 2+3?", "answer": "5"})
        return [await env.step(Action(t, [], i)) for i, t in enumerate(turns)]

    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    first, last = run(go([f"Let me add. {call}", "It is 5."]))
    assert first.observation == [{"role": "tool", "content": "5", "tool_call_id": "call_0_0"}]
    assert not first.done
    assert last.done and last.reward == {"reward": 1.0}
    assert last.info["stop_condition"] == "no_tools_called"
    assert last.info["metrics"]["add_calls"] == 1 and last.info["metrics"]["num_turns"] == 2
    # a malformed call is no call: the episode ends there, scored
    (only,) = run(go(['<tool_call>{"name": "add", "arguments": </tool_call>']))
    assert only.done and only.reward == {"reward": 0.0}
    assert only.info["metrics"]["total_tool_calls"] == 0


def test_verifiers_errors_are_episode_failures() -> None:
    async def go() -> None:
        env = VerifiersEnv("tests.adapter_envs:load_broken")
        await env.reset(GUESS)
        await env.step(Action("4", [], 0))

    with pytest.raises(EpisodeFailure, match=r"BrokenEnv\.env_response raised "
                                             r"ValueError\('the board exploded'\)"):
        run(go())
    with pytest.raises(ValueError, match="group-level reward functions"):
        VerifiersEnv("tests.adapter_envs:load_grouped")
    with pytest.raises(ConfigError, match=r"built a int, not a vf\.MultiTurnEnv"):
        make_runner(VF, {"env": "tests.adapter_envs:add", "env_args": {"a": 1, "b": 2}})


# --- OpenEnv, by hand -------------------------------------------------------------------


def test_openenv_echo_by_hand(echo: tuple[str, str]) -> None:
    env_path, action_path = echo

    async def go() -> list[Any]:
        env = OpenEnvEnv(env_path, action_path, max_steps=2)
        out = [await env.reset({"text": "hi"})]
        out += [await env.step(Action(t, [], i)) for i, t in enumerate(["hello", "again"])]
        await env.close()
        return out

    opening, first, last = run(go())
    assert opening == ECHO_OPENING
    assert first.observation == "hello" and first.reward == {"reward": 0.5}
    assert first.info["metadata"] == {"original_message": "hello", "step": 1}
    assert last.done and last.observation is None and last.reward == {"reward": 0.5}
    from sluice_echo.models import SluiceEchoObservation
    assert text_field(SluiceEchoObservation) == "echoed_message"


def test_openenv_invalid_actions_fail_with_pydantics_message(echo: tuple[str, str]) -> None:
    env_path, action_path = echo

    async def step(text: str, **kw: Any) -> Any:
        env = OpenEnvEnv(env_path, action_path, **kw)
        await env.reset({})
        try:
            return await env.step(Action(text, [], 0))
        finally:
            await env.close()

    with pytest.raises(EpisodeFailure, match="not a valid SluiceEchoAction: not JSON"):
        run(step("say hi", action_field=""))
    with pytest.raises(EpisodeFailure, match=re.escape(
            "not a valid SluiceEchoAction: bogus: Extra inputs are not permitted")):
        run(step('{"message": "x", "bogus": 1}', action_field=""))
    assert run(step('{"message": "x"}', action_field="")).observation == "x"
    with pytest.raises(EpisodeFailure, match="has no field 'nope'; set observation_field"):
        run(step("x", observation_field="nope"))
    with pytest.raises(ValueError, match="has no field 'text'"):
        OpenEnvEnv(env_path, action_path, action_field="text")
    with pytest.raises(ConfigError, match="does not take env_args"):
        make_runner(OE, {"env": env_path, "action": action_path, "env_args": {"size": 3}})


# --- both, through the runner with the tiny model ----------------------------------------


def test_runner_verifiers_guess_episodes(tiny: tuple[Any, Any]) -> None:
    engine, tok = tiny
    runner = make_runner(VF, {"env": "tests.adapter_envs:load_guess",
                              "env_args": {"max_turns": 3}})
    eps = episodes(runner, engine, tok, GUESS)
    assert len(eps) == 4
    for e in eps:
        check_guess_episode(e, tok, max_turns=3)
    assert any(e.mask.min() == 0 for e in eps)  # observations were inserted


def test_runner_verifiers_tool_env_without_a_call_ends_scored(tiny: tuple[Any, Any]) -> None:
    engine, tok = tiny  # a random model writes no tool call: one turn, then final_ok
    runner = make_runner(VF, {"env": "tests.adapter_envs:load_tools"})
    for e in episodes(runner, engine, tok, {"text": "What is 2+3?", "answer": "5"}):
        (text,), obs = check_episode(e, tok)
        assert obs == [] and e.finish_reason == "stop"
        assert e.env_reward == {"reward": 1.0 if "5" in text else 0.0}


def test_runner_openenv_echo_episodes(tiny: tuple[Any, Any], echo: tuple[str, str]) -> None:
    engine, tok = tiny
    env_path, action_path = echo
    runner = make_runner(OE, {"env": env_path, "action": action_path, "max_steps": 3})
    for e in episodes(runner, engine, tok, {"text": "Echo this"}):
        check_echo_episode(e, tok, ECHO_OPENING, max_steps=3)


def test_runner_openenv_invalid_action_fails_the_group(tiny: tuple[Any, Any],
                                                       echo: tuple[str, str]) -> None:
    engine, tok = tiny  # the tiny model's text is never a JSON object of the action
    env_path, action_path = echo
    runner = make_runner(OE, {"env": env_path, "action": action_path, "action_field": ""})
    with pytest.raises(EpisodeFailure, match="not a valid SluiceEchoAction"):
        episodes(runner, engine, tok, {"text": "Echo this"})


def test_docs_adapter_configs_parse(tmp_path: Path) -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "environments.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", text.split("## Adapters", 1)[1], re.DOTALL)
    assert len(blocks) == 2
    for i, (block, name) in enumerate(zip(blocks, (VF, OE), strict=True)):
        (tmp_path / f"{i}.toml").write_text(block)
        cfg = load_config(tmp_path / f"{i}.toml", [])
        assert cfg.environment.name == name and cfg.environment.kwargs["env"]
