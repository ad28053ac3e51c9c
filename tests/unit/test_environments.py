"""workers.environments: the episode runner against small environments defined here (model
turns exact, observations mask 0 and exactly their text, failures -> EpisodeFailure, turn
and token budgets), observation rendering with a ChatML template, and the built-ins."""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.config import ConfigError, load_config
from pipeline.model import load_model, load_tokenizer
from tests.helpers import build_bpe_model, wait_for_async
from workers.engines.base import Completion, SamplingParams
from workers.engines.transformers import TransformersEngine
from workers.environments import Action, EpisodeFailure, StepResult
from workers.environments.builtin import (
    GuessNumber,
    ToolArithmetic,
    char_match,
    evaluate_expression,
)
from workers.environments.runner import (
    EnvironmentRunner,
    episode_prompt,
    observation_ids,
    observation_text,
)
from workers.episodes import Episode, RolloutContext, TurnBatcher
from workers.tasks.catalog import GuessTask
from workers.tasks.prompts import render_prompt

torch.set_num_threads(1)

GREEDY = SamplingParams(4, greedy=True)
PROMPT = {"text": "12+3=", "answer": "15"}


@pytest.fixture(scope="module")
def char(tiny_model_dir: Path) -> tuple[TransformersEngine, Any]:
    model, tok = load_model(tiny_model_dir)
    return TransformersEngine(model, tok, seed=0), tok


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bpe_model(tmp_path_factory.mktemp("bpe") / "m")


class Spy:
    """Records the context of every sequence the engine is asked to continue."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.contexts: list[list[int]] = []

    async def generate(self, prompts: list[list[int]], n: int,
                       params: SamplingParams) -> list[list[Completion]]:
        self.contexts += [list(p) for p in prompts]
        return await self.engine.generate(prompts, n, params)


class ScriptedEngine:
    """Answers request k with ``turns[k]`` (cut at the params' cap): ``stop`` when it ends
    with ``eos``; logprob -0.5 and version 3 per token. Records the contexts."""

    def __init__(self, turns: list[list[int]], eos: int | None = None) -> None:
        self.turns = [list(t) for t in turns]
        self.eos = eos
        self.contexts: list[list[int]] = []

    async def generate(self, prompts: list[list[int]], n: int,
                       params: SamplingParams) -> list[list[Completion]]:
        out = []
        for p in prompts:
            self.contexts.append(list(p))
            ids = self.turns.pop(0)[:params.max_new_tokens]
            stop = bool(ids) and ids[-1] == self.eos
            out.append([Completion(np.array(ids, np.int32), np.full(len(ids), -0.5, np.float32),
                                   np.full(len(ids), 3, np.int32),
                                   "stop" if stop else "length")])
        return out


def context(engine: Any, tok: Any, n: int = 1, params: SamplingParams = GREEDY,
            prompt: dict[str, Any] | None = None) -> RolloutContext:
    p = dict(prompt or PROMPT)
    ids, conv = episode_prompt(tok, p["text"])  # as the generator renders a group's prompt
    return RolloutContext(p, ids, n, params, tok, TurnBatcher(engine), conversation=conv)


def runner(factory: Callable[[], Any], **kw: Any) -> EnvironmentRunner:
    args: dict[str, Any] = {"max_turns": 4, "max_episode_tokens": 64, "step_timeout_s": 5.0}
    return EnvironmentRunner(factory, **{**args, **kw})


def runs(mask: np.ndarray, value: int) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of ``value`` in ``mask``."""
    out, start = [], None
    for i, m in enumerate([*mask.tolist(), -1]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            out.append((start, i))
            start = None
    return out


class Scripted:
    """``reset`` returns ``first``; ``step`` at turn k returns ``steps[k]``. Keeps what it
    saw; counts ``close`` calls."""

    def __init__(self, first: Any, steps: list[Any]) -> None:
        self.first, self.steps = first, steps
        self.prompt: dict[str, Any] | None = None
        self.actions: list[Action] = []
        self.closed = 0

    async def reset(self, prompt: dict[str, Any]) -> Any:
        self.prompt = prompt
        return self.first

    async def step(self, action: Action) -> Any:
        self.actions.append(action)
        return self.steps[action.turn]

    async def close(self) -> None:
        self.closed += 1


class PlainScripted:
    """`Scripted` with plain methods (run in worker threads); records the step's thread."""

    def __init__(self, first: Any, steps: list[Any]) -> None:
        self.first, self.steps = first, steps
        self.actions: list[Action] = []
        self.threads: list[threading.Thread] = []

    def reset(self, prompt: dict[str, Any]) -> Any:
        return self.first

    def step(self, action: Action) -> Any:
        self.threads.append(threading.current_thread())
        self.actions.append(action)
        return self.steps[action.turn]


SCRIPT: list[Any] = [
    StepResult("xy", {"a": 1.0, "b": 0.5}),
    ("q", 2.0, False, {}),  # the 4-tuple form; a bare number is the part "env"
    StepResult(None, {"a": 0.25}, True, {"k": 1}),
]


def factory_of(cls: type, *args: Any) -> tuple[Callable[[], Any], list[Any]]:
    built: list[Any] = []

    def make() -> Any:
        built.append(cls(*args))
        return built[-1]
    return make, built


# ---------------------------------------------------------------- (a) a scripted episode


def check_scripted_episode(e: Episode, tok: Any, prompt_ids: list[int],
                           engine: TransformersEngine, actions: list[Action]) -> None:
    """Mask 0 exactly at the observations ("ab", "xy", "q"), model turns exactly what a lone
    greedy call on the same context samples, turns/messages/rewards as scripted."""
    assert e.finish_reason == "stop" and e.turns == 3
    obs = runs(e.mask, 0)
    model = runs(e.mask, 1)
    assert len(obs) == 3 and len(model) == 3 and obs[0][0] == 0  # ab | m | xy | m | q | m
    assert [tok.decode(e.token_ids[s:t].tolist()) for s, t in obs] == ["ab", "xy", "q"]
    assert tok.decode(e.token_ids[e.mask == 0].tolist()) == "abxyq"  # char tokenizer: exact
    assert (e.logprobs[e.mask == 0] == 0).all()
    texts = []
    for k, (s, t) in enumerate(model):
        ctx = prompt_ids + e.token_ids[:s].tolist()
        lone = asyncio.run(engine.generate([ctx], 1, GREEDY))[0][0]
        assert e.token_ids[s:t].tolist() == lone.token_ids.tolist()
        np.testing.assert_allclose(e.logprobs[s:t], lone.logprobs, atol=1e-5)
        assert e.versions[s:t].tolist() == lone.versions.tolist()
        text = tok.decode(lone.token_ids.tolist(), skip_special_tokens=True)
        texts.append(text)
        assert actions[k] == Action(text, lone.token_ids.tolist(), k)
    assert e.messages == [
        {"role": "user", "content": "ab"}, {"role": "assistant", "content": texts[0]},
        {"role": "user", "content": "xy"}, {"role": "assistant", "content": texts[1]},
        {"role": "user", "content": "q"}, {"role": "assistant", "content": texts[2]},
    ]
    assert e.env_reward == {"a": 1.25, "b": 0.5, "env": 2.0}


def test_scripted_episode_is_exact(char: tuple[TransformersEngine, Any]) -> None:
    engine, tok = char
    spy = Spy(engine)
    make, built = factory_of(Scripted, "ab", SCRIPT)

    async def amake() -> Scripted:  # async: a plain factory runs in a thread, whose timing
        return make()  # would let the episodes drift apart and split their batches

    r = runner(amake)
    ctx = context(spy, tok, n=3)
    group = asyncio.run(r.group(ctx))
    assert len(group) == 3 and len(built) == 3  # one fresh environment per episode
    for e, env in zip(group, built, strict=True):
        check_scripted_episode(e, tok, ctx.prompt_ids, engine, env.actions)
        assert env.prompt == PROMPT and env.closed == 1
        assert e.token_ids.tolist() == group[0].token_ids.tolist()  # greedy: all alike
    # every turn continued exactly the prompt plus the episode so far
    e = group[0]
    starts = [s for s, _ in runs(e.mask, 1)]
    want = [ctx.prompt_ids + e.token_ids[:s].tolist() for s in starts]
    assert spy.contexts == [c for c in want for _ in range(3)]
    assert ctx.batcher.calls == 3  # the three episodes' turns shared one call per turn
    assert r.counts == {"episodes": 3, "turns": 9, "truncated": 0}


def test_plain_environment_runs_in_worker_threads(char: tuple[TransformersEngine, Any]) -> None:
    engine, tok = char
    make, built = factory_of(PlainScripted, "ab", SCRIPT)
    ctx = context(engine, tok)
    (e,) = asyncio.run(runner(make).group(ctx))
    check_scripted_episode(e, tok, ctx.prompt_ids, engine, built[0].actions)
    assert len(built[0].threads) == 3
    assert all(t is not threading.main_thread() for t in built[0].threads)


def test_factory_may_be_a_plain_function_and_reset_may_open_with_nothing(
        char: tuple[TransformersEngine, Any]) -> None:
    engine, tok = char
    env = Scripted(None, [StepResult(None, 1.0, True)])
    (e,) = asyncio.run(runner(lambda: env).group(context(engine, tok)))
    assert e.mask.all() and e.turns == 1 and e.finish_reason == "stop"
    assert e.env_reward == {"env": 1.0}
    assert e.messages == [{"role": "assistant", "content": env.actions[0].text}]


# ---------------------------------------------------------------- (b) failures


class Env:
    """Configurable misbehaviour: ``reset_value``, ``step_value``; ``hang`` blocks a step
    until ``release`` is set."""

    def __init__(self, reset_value: Any = None, step_value: Any = None,
                 raises: BaseException | None = None, hang: bool = False) -> None:
        self.reset_value, self.step_value, self.raises, self.hang = (
            reset_value, step_value, raises, hang)
        self.closed = 0

    async def reset(self, prompt: dict[str, Any]) -> Any:
        if isinstance(self.reset_value, BaseException):
            raise self.reset_value
        return self.reset_value

    async def step(self, action: Action) -> Any:
        if self.hang:
            await asyncio.Event().wait()
        if self.raises is not None:
            raise self.raises
        return self.step_value

    async def close(self) -> None:
        self.closed += 1


FAILURES = [
    (Env(raises=ValueError("boom")), r"step \(turn 0\) raised ValueError\('boom'\)"),
    (Env(reset_value=KeyError("answer")), r"reset raised KeyError\('answer'\)"),
    (Env(reset_value=5), "reset returned a int: an observation must be text, a list of chat "
                         "messages, or None"),
    (Env(reset_value={"text": "x"}), "reset returned a dict"),
    (Env(reset_value=[]), "reset: reset: expected a non-empty list of messages"),
    (Env(reset_value=[{"content": "x"}]), r"reset\[0\]: message has no string 'role'"),
    (Env(step_value="ok"), r"step \(turn 0\) returned a str: expected a StepResult or "
                           r"\(observation, reward, done, info\)"),
    (Env(step_value=StepResult(None, "high", True)),
     "reward must be a number or a map of named numbers, got str"),
    (Env(step_value=StepResult(None, math.nan, True)), "reward part 'env' is nan"),
    (Env(step_value=StepResult(None, {"a": math.inf}, True)), "reward part 'a' is inf"),
    (Env(step_value=StepResult(None, True, True)), "got bool"),
    (Env(step_value=StepResult(None, {"a": "1"}, True)),
     "reward parts must map names to numbers, got 'a': str"),
    (Env(step_value=StepResult(None, {1: 1.0}, True)), "reward parts must map names"),
    (Env(step_value=StepResult(None, 1.0, "yes")), "done must be a bool, got str"),
    (Env(step_value=StepResult(None, 1.0, True, [])), "info must be a map, got list"),
    (Env(step_value=StepResult(42, 1.0, False)), r"step \(turn 0\) returned a int"),
]


@pytest.mark.parametrize(("env", "match"), FAILURES,
                         ids=[m[:30] for _, m in FAILURES])
def test_environment_failures_are_episode_failures(
        char: tuple[TransformersEngine, Any], env: Env, match: str) -> None:
    engine, tok = char
    with pytest.raises(EpisodeFailure, match=match):
        asyncio.run(runner(lambda: env).group(context(engine, tok)))
    assert env.closed == 1  # closed even when it failed


def test_step_over_the_timeout_fails(char: tuple[TransformersEngine, Any]) -> None:
    engine, tok = char
    env = Env(hang=True)
    with pytest.raises(EpisodeFailure, match=r"step \(turn 0\) timed out after 0.2s "
                                             r"\(environment.step_timeout_s\)"):
        asyncio.run(runner(lambda: env, step_timeout_s=0.2).group(context(engine, tok)))
    assert env.closed == 1


def test_plain_step_over_the_timeout_fails(char: tuple[TransformersEngine, Any]) -> None:
    """A plain step cannot be cancelled in its thread: the episode fails anyway."""
    engine, tok = char
    release = threading.Event()

    class Hangs:
        def reset(self, prompt: dict[str, Any]) -> None:
            return None

        def step(self, action: Action) -> StepResult:
            release.wait(60)
            return StepResult(None, 0.0, True)

    async def main() -> None:
        try:
            with pytest.raises(EpisodeFailure, match=r"step \(turn 0\) timed out after 0.2s"):
                await runner(Hangs, step_timeout_s=0.2).group(context(engine, tok))
        finally:  # before asyncio.run joins its worker threads
            release.set()

    asyncio.run(main())


def test_construction_and_missing_methods_fail(char: tuple[TransformersEngine, Any]) -> None:
    engine, tok = char

    def broken() -> Any:
        raise TypeError("bad kwarg")

    with pytest.raises(EpisodeFailure, match=r"building the environment raised "
                                             r"TypeError\('bad kwarg'\)"):
        asyncio.run(runner(broken).group(context(engine, tok)))

    class NoStep:
        async def reset(self, prompt: dict[str, Any]) -> None:
            return None

    with pytest.raises(EpisodeFailure, match=r"the environment has no step\(\) method "
                                             r"\(a NoStep\)"):
        asyncio.run(runner(NoStep).group(context(engine, tok)))


def test_a_failing_close_does_not_fail_the_episode(char: tuple[TransformersEngine, Any],
                                                   caplog: pytest.LogCaptureFixture) -> None:
    engine, tok = char

    class BadClose(Scripted):
        async def close(self) -> None:
            raise OSError("socket gone")

    (e,) = asyncio.run(runner(lambda: BadClose(None, [StepResult(None, 1.0, True)]))
                       .group(context(engine, tok)))
    assert e.finish_reason == "stop"
    assert "close failed: close raised OSError('socket gone')" in caplog.text


def test_one_failing_episode_fails_the_group_and_cancels_the_others(
        char: tuple[TransformersEngine, Any]) -> None:
    """The first failure ends the group at once (the others' steps hang, far below the
    timeout) and every environment built is closed."""
    engine, tok = char
    built: list[Env] = []

    def make() -> Env:
        built.append(Env(raises=RuntimeError("env 1 broke")) if len(built) == 1
                     else Env(hang=True))
        return built[-1]

    async def main() -> None:
        with pytest.raises(EpisodeFailure, match="env 1 broke"):
            await runner(make, step_timeout_s=300).group(context(engine, tok, n=3))
        await wait_for_async(lambda: _true(all(e.closed == 1 for e in built)), 10,
                             lambda: f"closed: {[e.closed for e in built]}")

    asyncio.run(main())
    assert len(built) == 3


async def _true(v: bool) -> bool:
    return v


def test_from_config_checks_the_environment_at_start(tmp_path: Path) -> None:
    def cfg(*sets: str) -> Any:
        return load_config(None, list(sets))

    r = EnvironmentRunner.from_config(cfg(
        "environment.name=workers.environments.builtin:ToolArithmetic",
        "environment.kwargs={max_calls = 3}", "environment.max_turns=5",
        "environment.observation_role=tool", "environment.overflow=dead"))
    assert isinstance(r.factory(), ToolArithmetic) and r.factory().max_calls == 3
    assert (r.max_turns, r.role, r.overflow) == (5, "tool", "dead")
    with pytest.raises(ConfigError, match=r"environment\.name: .*workers\.nothere"):
        EnvironmentRunner.from_config(cfg("environment.name=workers.nothere:Env"))
    with pytest.raises(ConfigError, match=r"environment.kwargs: .*ToolArithmetic"
                                          r"\(\*\*\{'max_calls': 0\}\) raised"):
        EnvironmentRunner.from_config(cfg(
            "environment.name=workers.environments.builtin:ToolArithmetic",
            "environment.kwargs={max_calls = 0}"))
    with pytest.raises(ConfigError, match=r"builds a Action, which has no reset\(\) method"):
        EnvironmentRunner.from_config(cfg(
            "environment.name=workers.environments.base:Action",
            'environment.kwargs={text = "", token_ids = [], turn = 0}'))


# ---------------------------------------------------------------- (c) budgets


def test_max_turns_ends_length_without_an_unanswered_observation(
        char: tuple[TransformersEngine, Any]) -> None:
    engine, tok = char
    env = Scripted(None, [StepResult("o", 0.5)] * 10)  # never done
    r = runner(lambda: env, max_turns=2)
    (e,) = asyncio.run(r.group(context(engine, tok)))
    assert e.finish_reason == "length" and e.turns == 2 and len(env.actions) == 2
    assert len(runs(e.mask, 1)) == 2 and tok.decode(e.token_ids[e.mask == 0].tolist()) == "o"
    assert e.mask[-1] == 1  # the second turn's observation is not inserted: nothing answers it
    assert [m["role"] for m in e.messages or []] == ["assistant", "user", "assistant"]
    assert e.env_reward == {"env": 1.0}
    assert r.counts == {"episodes": 1, "turns": 2, "truncated": 1}


def _budget(tok: Any, max_episode_tokens: int, overflow: str = "truncate"
            ) -> tuple[Episode, ScriptedEngine, Scripted]:
    eng = ScriptedEngine([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]])
    env = Scripted(None, [StepResult("xy", 0.0)] * 3)
    r = runner(lambda: env, max_episode_tokens=max_episode_tokens, overflow=overflow)
    (e,) = asyncio.run(r.group(context(eng, tok)))
    return e, eng, env


def test_model_turn_is_cut_to_fit_the_episode(char: tuple[TransformersEngine, Any]) -> None:
    """Budget 7: a 4-token turn, "xy" (6 used), then a turn cut to the 1 token left; the
    next observation does not fit, so the episode ends there ``length``."""
    _, tok = char
    e, eng, env = _budget(tok, 7)
    assert e.token_ids.tolist()[:4] == [10, 11, 12, 13] and e.token_ids.tolist()[6:] == [20]
    assert e.mask.tolist() == [1, 1, 1, 1, 0, 0, 1] and len(e) == 7
    assert e.finish_reason == "length" and e.turns == 2
    assert env.actions[1].token_ids == [20]  # the environment saw the cut turn
    assert [m["role"] for m in e.messages or []] == ["assistant", "user", "assistant"]
    assert len(eng.contexts) == 2


def test_observation_that_does_not_fit_ends_the_episode_or_the_group(
        char: tuple[TransformersEngine, Any]) -> None:
    """Budget 6: after a 4-token turn "xy" would leave no room for a model token."""
    _, tok = char
    e, _, env = _budget(tok, 6)
    assert e.token_ids.tolist() == [10, 11, 12, 13] and e.mask.all()
    assert e.finish_reason == "length" and len(env.actions) == 1
    assert e.messages == [{"role": "assistant", "content": env.actions[0].text}]
    with pytest.raises(EpisodeFailure, match=r"an observation of 2 tokens takes the episode "
                                             r"past environment.max_episode_tokens \(6; 4 "
                                             r"used\)"):
        _budget(tok, 6, overflow="dead")


@pytest.mark.parametrize("overflow", ["truncate", "dead"])
def test_a_reset_observation_that_does_not_fit(char: tuple[TransformersEngine, Any],
                                               overflow: str) -> None:
    """No room for the first turn: nothing to train on, so the group fails with a reason
    naming the cause, whatever ``overflow`` says (it is about later observations)."""
    _, tok = char
    eng = ScriptedEngine([[10]])
    env = Scripted("abcdefgh", [StepResult(None, 1.0, True)])
    with pytest.raises(EpisodeFailure, match="reset observation does not fit"):
        asyncio.run(runner(lambda: env, max_episode_tokens=8, overflow=overflow)
                    .group(context(eng, tok)))
    assert not env.actions


# ---------------------------------------------------------------- (d) chat template


CHAT = [{"role": "user", "content": "Copy 12="}]


def _render(tok: Any, messages: list[dict[str, Any]], gen: bool) -> str:
    return str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen))


@pytest.mark.parametrize("obs", ["Copy 3", [{"role": "tool", "content": "=5"}],
                                 [{"role": "tool", "content": "=5"},
                                  {"role": "user", "content": "and 7"}]])
@pytest.mark.parametrize("after_eos", [True, False])
def test_observation_is_the_templates_delta(bpe_dir: Path, obs: Any, after_eos: bool) -> None:
    """prompt + a model turn (ending in eos, or cut by length) + the observation's ids is
    the template's rendering of the conversation with that turn and the observation, plus
    the generation prompt."""
    tok = load_tokenizer(bpe_dir)
    eos = tok.eos_token_id
    prompt_ids = render_prompt(tok, CHAT[0]["content"])
    turn = tok("Copy 12", add_special_tokens=False).input_ids + ([eos] if after_eos else [])
    obs_ids = observation_ids(tok, obs, role="user", after_eos=after_eos)
    obs_msgs = [{"role": "user", "content": obs}] if isinstance(obs, str) else obs
    want = _render(tok, [*CHAT, {"role": "assistant", "content": "Copy 12"}, *obs_msgs], True)
    assert tok.decode(prompt_ids + turn + obs_ids) == want
    assert prompt_ids + turn + obs_ids == tok(want, add_special_tokens=False).input_ids
    text = observation_text(tok, obs, role="user", after_eos=after_eos)
    assert text.startswith("\n<|im_start|>" if after_eos else "<|im_end|>\n<|im_start|>")
    assert text.endswith("<|im_start|>assistant\n")


def test_observation_role_and_no_template(bpe_dir: Path, char: tuple[Any, Any]) -> None:
    tok = load_tokenizer(bpe_dir)
    assert observation_text(tok, "=5", role="tool", after_eos=True) == (
        "\n<|im_start|>tool\n=5<|im_end|>\n<|im_start|>assistant\n")
    _, chars = char  # no chat template: the observation's text as is
    assert observation_text(chars, "xy", role="user", after_eos=True) == "xy"
    assert observation_text(chars, [{"role": "tool", "content": "=5"},
                                    {"role": "user", "content": "7"}],
                            role="user", after_eos=False) == "=57"
    assert observation_ids(chars, "", role="user", after_eos=True) == []


def test_a_template_that_cannot_be_extended_turn_by_turn_fails(bpe_dir: Path) -> None:
    tok = load_tokenizer(bpe_dir)
    tok.chat_template = ("{% for m in messages %}{% if loop.last %}LAST {% endif %}"
                         "{{ m['content'] }}\n{% endfor %}")
    with pytest.raises(EpisodeFailure, match="cannot be extended turn by turn"):
        observation_text(tok, "obs", role="user", after_eos=True)


def test_runner_episode_renders_as_the_template_renders_its_messages(bpe_dir: Path) -> None:
    """A scripted model on the ChatML tokenizer: turn 0 ends with eos, turn 1 is cut by
    length, turn 2 ends with eos; a user and a tool observation between them. Prompt +
    episode is the template's rendering of the prompt and the episode's messages."""
    tok = load_tokenizer(bpe_dir)
    eos = tok.eos_token_id

    def ids(s: str) -> list[int]:
        return list(tok(s, add_special_tokens=False).input_ids)

    eng = ScriptedEngine([[*ids("Copy 1"), eos], ids("2"), [*ids("3"), eos]], eos=eos)
    env = Scripted(None, [StepResult("Copy 3", 0.0),
                          StepResult([{"role": "tool", "content": "=5"}], 0.0),
                          StepResult(None, 1.0, True)])
    ctx = context(eng, tok, params=SamplingParams(8), prompt={"text": "Copy 12=", "answer": ""})
    (e,) = asyncio.run(runner(lambda: env).group(ctx))
    assert e.messages == [
        {"role": "assistant", "content": "Copy 1"}, {"role": "user", "content": "Copy 3"},
        {"role": "assistant", "content": "2"}, {"role": "tool", "content": "=5"},
        {"role": "assistant", "content": "3"}]
    want = _render(tok, [*CHAT, *e.messages], False)
    got = tok.decode(ctx.prompt_ids + e.token_ids.tolist())
    assert got + "\n" == want  # the template closes the last turn with eos + "\n"
    assert ctx.prompt_ids + e.token_ids.tolist() == ids(want[:-1])
    # each turn continued the exact token sequence so far
    starts = [s for s, _ in runs(e.mask, 1)]
    assert eng.contexts == [ctx.prompt_ids + e.token_ids[:s].tolist() for s in starts]


def test_reset_observation_renders_as_the_template_renders_its_messages(bpe_dir: Path) -> None:
    tok = load_tokenizer(bpe_dir)
    eos = tok.eos_token_id
    eng = ScriptedEngine([[*tok("Copy 1", add_special_tokens=False).input_ids, eos]], eos=eos)
    env = Scripted("Copy 3", [StepResult(None, 1.0, True)])
    ctx = context(eng, tok, prompt={"text": "Copy 12=", "answer": ""})
    (e,) = asyncio.run(runner(lambda: env).group(ctx))
    assert e.messages == [{"role": "user", "content": "Copy 3"},
                          {"role": "assistant", "content": "Copy 1"}]
    got = tok.decode(ctx.prompt_ids + e.token_ids.tolist())
    assert got + "\n" == _render(tok, [*CHAT, *e.messages], False)


def test_runner_with_the_bpe_model_matches_the_template(bpe_dir: Path) -> None:
    """The real (random) BPE model's turns, whatever they are: the observation tokens
    between them are exactly the template's delta for the turns as sampled."""
    model, tok = load_model(bpe_dir)
    engine = TransformersEngine(model, tok, seed=0)
    env = Scripted(None, [StepResult("Copy 3", 0.0), StepResult("Copy 4", 0.0),
                          StepResult(None, 0.0, True)])
    ctx = context(engine, tok, params=SamplingParams(3, greedy=True),
                  prompt={"text": "Copy 12=", "answer": ""})
    (e,) = asyncio.run(runner(lambda: env).group(ctx))
    eos = tok.eos_token_id
    conv = list(CHAT)
    obs = iter(["Copy 3", "Copy 4"])
    model_runs = runs(e.mask, 1)
    assert len(model_runs) == 3
    for k, (s, t) in enumerate(model_runs):
        turn = e.token_ids[s:t].tolist()
        body = turn[:-1] if turn[-1] == eos else turn
        conv.append({"role": "assistant", "content": tok.decode(body)})
        if k < 2:
            conv.append({"role": "user", "content": next(obs)})
    want = _render(tok, conv, False)
    got = tok.decode(ctx.prompt_ids + e.token_ids.tolist())
    last = e.token_ids[-1] == eos
    assert got + ("\n" if last else "<|im_end|>\n") == want


# ---------------------------------------------------------------- (e) built-ins


@pytest.mark.parametrize(("text", "value"), [
    ("2+3", 5), ("2+3*4", 14), ("2*3+4", 10), ("10-2-3", 5), ("1-2*3", -5),
    ("2*3*4-1", 23), ("999999999*2", 1999999998),
])
def test_evaluate_expression(text: str, value: int) -> None:
    assert evaluate_expression(text) == value


@pytest.mark.parametrize("text", ["2", "2+", "+2", "a+b", "2/3", "1+2+3+4+5", "1234567890+1",
                                  "2 + 3", "__import__('os')"])
def test_evaluate_expression_refuses_what_is_not_an_expression(text: str) -> None:
    with pytest.raises(ValueError, match="not an expression"):
        evaluate_expression(text)


def _step(env: Any, text: str, turn: int) -> StepResult:
    return asyncio.run(env.step(Action(text, [], turn)))


def test_tool_arithmetic_call_then_answer() -> None:
    """A right call earns ``call`` (0.2); turn 0 earns ``format`` (0.1 x the share of digit
    and operator characters); the final answer earns ``answer``. Every step has all three."""
    env = ToolArithmetic()
    assert asyncio.run(env.reset({"answer": 168})) is None
    r = _step(env, "123+45", 0)
    assert r.observation == [{"role": "tool", "content": "=168"}] and not r.done
    assert r.reward == {"answer": 0.0, "call": 0.2, "format": 0.1}
    r = _step(env, " 168\n", 1)  # stripped; no format credit after turn 0
    assert (r.observation, r.reward, r.done, r.info) == (
        None, {"answer": 1.0, "call": 0.0, "format": 0.0}, True, {"calls": 1})


def test_tool_arithmetic_call_credit_once_and_only_for_a_right_result() -> None:
    env = ToolArithmetic(max_calls=4, call_weight=0.5, format_weight=0.4)
    asyncio.run(env.reset({"answer": "12"}))
    r = _step(env, "2+3", 0)  # a wrong result: no call credit; turn 0: full format credit
    assert r.observation == [{"role": "tool", "content": "=5"}]
    assert r.reward == {"answer": 0.0, "call": 0.0, "format": 0.4}
    r = _step(env, "3*4", 1)  # the right result: call_weight, once
    assert r.observation == [{"role": "tool", "content": "=12"}]
    assert r.reward == {"answer": 0.0, "call": 0.5, "format": 0.0}
    r = _step(env, "20-8", 2)  # right again: already paid
    assert r.observation == [{"role": "tool", "content": "=12"}] and not r.done
    assert r.reward == {"answer": 0.0, "call": 0.0, "format": 0.0}
    r = _step(env, "13", 3)  # a wrong final answer: half its characters match
    assert r.done and r.info == {"calls": 3}
    assert r.reward == {"answer": 0.5, "call": 0.0, "format": 0.0}
    asyncio.run(env.reset({"answer": "12"}))  # a new episode may earn it again
    assert _step(env, "6+6", 0).reward == {"answer": 0.0, "call": 0.5, "format": 0.4}


@pytest.mark.parametrize(("answer", "got", "reward"), [
    ("168", "160", 2 / 3), ("168", "1680", 3 / 4), ("168", "861", 1 / 3), ("-5", "-5", 1.0),
])
def test_tool_arithmetic_wrong_answer_is_a_partial_char_match(answer: str, got: str,
                                                              reward: float) -> None:
    env = ToolArithmetic()
    asyncio.run(env.reset({"answer": answer}))
    r = _step(env, got, 0)  # digits and "-" only: the full format credit on turn 0
    assert r.done and r.info == {"calls": 0}
    assert r.reward == {"answer": pytest.approx(reward), "call": 0.0, "format": 0.1}
    assert char_match(got, answer) == pytest.approx(reward) and char_match("", "") == 1.0
    asyncio.run(env.reset({"answer": answer}))
    assert _step(env, got, 1).reward == {"answer": pytest.approx(reward), "call": 0.0,
                                         "format": 0.0}


def test_tool_arithmetic_invalid_turn_and_too_many_calls_end_with_nothing() -> None:
    """An invalid turn ends the episode with no answer or call credit; on turn 0 it keeps
    the format credit of its digit/operator share."""
    env = ToolArithmetic()
    asyncio.run(env.reset({"answer": "5"}))
    r = _step(env, "the answer is 5", 0)  # 1 digit of 15 characters
    assert r.done and r.observation is None
    assert r.reward == {"answer": 0.0, "call": 0.0, "format": pytest.approx(0.1 / 15)}
    assert r.info == {"calls": 0, "invalid": "the answer is 5"}
    asyncio.run(env.reset({"answer": "5"}))
    r = _step(env, "2+3=5", 0)  # not an expression; 4 of its 5 characters count
    assert r.done and r.reward == {"answer": 0.0, "call": 0.0, "format": pytest.approx(0.08)}
    asyncio.run(env.reset({"answer": "5"}))
    r = _step(env, "x" * 50, 0)
    assert r.done and r.reward == {"answer": 0.0, "call": 0.0, "format": 0.0}
    assert r.info["invalid"] == "x" * 40
    env = ToolArithmetic(max_calls=1)
    asyncio.run(env.reset({"answer": "5"}))
    r = _step(env, "2+2", 0)
    assert not r.done and r.reward == {"answer": 0.0, "call": 0.0, "format": 0.1}
    r = _step(env, "1+4", 1)  # a second call: over max_calls, so its right result earns 0
    assert r.done and r.observation is None
    assert r.reward == {"answer": 0.0, "call": 0.0, "format": 0.0}
    assert r.info == {"calls": 1, "invalid": "1+4"}
    asyncio.run(env.reset({"answer": "5"}))
    # an invalid turn after turn 0 has no format credit either
    assert _step(env, "hello", 1).reward == {"answer": 0.0, "call": 0.0, "format": 0.0}
    with pytest.raises(ValueError, match="max_calls must be >= 1"):
        ToolArithmetic(max_calls=0)


def test_tool_arithmetic_through_the_runner(char: tuple[TransformersEngine, Any]) -> None:
    """A scripted model makes a wrong call, a right call, then answers: the parts summed
    over the episode (format 0.1 from turn 0, call 0.2 once, answer 1.0); the tool turns
    mask 0."""
    _, tok = char

    def ids(s: str) -> list[int]:
        return list(tok(s, add_special_tokens=False).input_ids)

    eng = ScriptedEngine([ids("1+1"), ids("2+3"), ids("5")])
    ctx = context(eng, tok, prompt={"text": "2+3=", "answer": "5"})
    (e,) = asyncio.run(runner(ToolArithmetic, observation_role="tool").group(ctx))
    assert e.finish_reason == "stop" and e.turns == 3
    assert e.env_reward == {"answer": 1.0, "call": pytest.approx(0.2),
                            "format": pytest.approx(0.1)}
    assert tok.decode(e.token_ids.tolist()) == "1+1=22+3=55"
    assert e.mask.tolist() == [1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1]
    assert e.messages == [{"role": "assistant", "content": "1+1"},
                          {"role": "tool", "content": "=2"},
                          {"role": "assistant", "content": "2+3"},
                          {"role": "tool", "content": "=5"},
                          {"role": "assistant", "content": "5"}]
    # the model's first turn is prose: the episode ends at once with its format share
    eng = ScriptedEngine([ids("a5")])
    (e,) = asyncio.run(runner(ToolArithmetic, observation_role="tool")
                       .group(context(eng, tok, prompt={"text": "2+3=", "answer": "5"})))
    assert e.finish_reason == "stop" and e.turns == 1 and e.mask.tolist() == [1, 1]
    assert e.env_reward == {"answer": 0.0, "call": 0.0, "format": pytest.approx(0.05)}


def test_guess_number_hints_and_rewards() -> None:
    """Secret 7: "2" (distance 5: near 0.3 x 0.5 = 0.15, and format 0.1 on turn 0), "9"
    (distance 2: near 0.24, paid as +0.09), "7" at turn 2: found 1 - 2 x 0.15 = 0.7."""
    env = GuessNumber()
    assert asyncio.run(env.reset({"answer": "7"})) is None
    r = _step(env, "2", 0)
    assert (r.observation, r.done) == ("+", False)
    assert r.reward == {"found": 0.0, "format": 0.1, "near": pytest.approx(0.15)}
    r = _step(env, "9", 1)
    assert (r.observation, r.done) == ("-", False)
    assert r.reward == {"found": 0.0, "format": 0.0, "near": pytest.approx(0.09)}
    r = _step(env, "7", 2)  # found at turn 2; format only on turn 0; no near when found
    assert r.done and r.observation is None and r.info == {"guesses": 3}
    assert r.reward == {"found": pytest.approx(0.7), "format": 0.0, "near": 0.0}
    asyncio.run(env.reset({"answer": "7"}))
    assert _step(env, "7", 0).reward == {"found": 1.0, "format": 0.1, "near": 0.0}
    assert _step(env, "07", 4).reward == {"found": pytest.approx(0.4), "format": 0.0,
                                          "near": 0.0}
    assert _step(env, "7", 20).reward == {"found": 0.25, "format": 0.0, "near": 0.0}  # floor
    env = GuessNumber(penalty=0.5, format_weight=0.2, near_weight=1.0)  # the weights are used
    asyncio.run(env.reset({"answer": "3"}))
    assert _step(env, "4", 0).reward == {"found": 0.0, "format": 0.2, "near": pytest.approx(0.9)}
    assert _step(env, "3", 1).reward == {"found": 0.5, "format": 0.0, "near": 0.0}
    assert _step(env, "3", 9).reward["found"] == 0.25
    assert asyncio.run(env.close()) is None


def test_guess_number_near_increments_sum_to_the_closest_guess_credit() -> None:
    """near is paid only when a guess comes closer, so an episode's near parts sum to
    0.3 x max(0, 1 - d / 10) for its closest wrong guess's distance d."""
    env = GuessNumber()
    asyncio.run(env.reset({"answer": "7"}))
    got = [_step(env, g, k) for k, g in enumerate(["2", "4", "1", "9", "12", "9999", "8"])]
    assert [r.observation for r in got] == ["+", "+", "+", "-", "-", "-", "-"]
    assert not any(r.done for r in got)
    want = [0.15, 0.06, 0.0, 0.03, 0.0, 0.0, 0.03]  # distances 5, 3, 6, 2, 5, 9992, 1
    assert [r.reward["near"] for r in got] == pytest.approx(want)
    assert sum(r.reward["near"] for r in got) == pytest.approx(0.3 * (1 - 1 / 10))
    assert [r.reward["found"] for r in got] == [0.0] * 7
    assert [r.reward["format"] for r in got] == [0.1] + [0.0] * 6
    # guesses 10 or more away earn nothing until one comes within 10
    asyncio.run(env.reset({"answer": "0"}))  # reset forgets the last game's closest guess
    got = [_step(env, g, k) for k, g in enumerate(["15", "12", "10", "3"])]
    assert [r.reward["near"] for r in got] == pytest.approx([0.0, 0.0, 0.0, 0.21])
    asyncio.run(env.reset({"answer": "0"}))
    assert _step(env, "5", 0).reward["near"] == pytest.approx(0.15)  # not net of last game
    # an invalid turn ends the game with no near; what was paid stays paid
    r = _step(env, "five", 1)
    assert r.done and r.reward == {"found": 0.0, "format": 0.0, "near": 0.0}


def test_guess_number_invalid_turns_end_with_partial_format_credit_on_turn_0() -> None:
    """Turn 0: a valid guess (1-4 digits) earns the full format weight, anything else half
    the weight times its digit share; a later invalid turn earns nothing."""
    env = GuessNumber(format_weight=0.2)
    asyncio.run(env.reset({"answer": "5"}))
    r = _step(env, "3a", 0)  # half its characters are digits
    assert r.done and r.observation is None and r.info == {"invalid": "3a"}
    assert r.reward == {"found": 0.0, "format": pytest.approx(0.2 * 0.5 * 0.5), "near": 0.0}
    r = _step(env, "abc", 1)
    assert r.done and r.reward == {"found": 0.0, "format": 0.0, "near": 0.0}
    r = _step(env, "12345", 0)  # more than four digits is not a guess: half credit
    assert r.done and r.reward == {"found": 0.0, "format": pytest.approx(0.1), "near": 0.0}
    r = _step(env, "-3", 0)
    assert r.done and r.reward == {"found": 0.0, "format": pytest.approx(0.05), "near": 0.0}
    assert _step(env, "", 0).reward == {"found": 0.0, "format": 0.0, "near": 0.0}
    assert _step(env, "x" * 50, 0).info == {"invalid": "x" * 40}
    r = _step(env, " 1234\n", 0)  # stripped: a valid (far) guess, full format credit
    assert not r.done and r.reward == {"found": 0.0, "format": 0.2, "near": 0.0}


def _guess_prompt(answer: str) -> dict[str, Any]:
    """The first training prompt of GuessTask(seed=0) whose hidden number is ``answer``."""
    task = GuessTask(num_prompts=200, seed=0)
    return next(p for p in map(task.prompt, range(len(task))) if p["answer"] == answer)


def test_guess_number_through_the_runner(char: tuple[TransformersEngine, Any]) -> None:
    """A GuessTask prompt with secret 7, a scripted model guessing 2, 9, 7: the hints mask
    0 and the parts summed over the episode are format 0.1 + near 0.24 + found 0.7. Cut by
    max_turns after 2, 9 it keeps the near credit (0.24)."""
    _, tok = char

    def ids(s: str) -> list[int]:
        return list(tok(s, add_special_tokens=False).input_ids)

    prompt = _guess_prompt("7")
    assert len(prompt["text"]) == 5 and prompt["text"].endswith("?")
    eng = ScriptedEngine([ids("2"), ids("9"), ids("7")])
    (e,) = asyncio.run(runner(GuessNumber).group(context(eng, tok, prompt=prompt)))
    assert e.finish_reason == "stop" and e.turns == 3
    assert tok.decode(e.token_ids.tolist()) == "2+9-7"
    assert e.mask.tolist() == [1, 0, 1, 0, 1]
    assert e.env_reward == {"found": pytest.approx(0.7), "format": pytest.approx(0.1),
                            "near": pytest.approx(0.24)}
    eng = ScriptedEngine([ids("2"), ids("9")])
    (e,) = asyncio.run(runner(GuessNumber, max_turns=2).group(context(eng, tok, prompt=prompt)))
    assert e.finish_reason == "length" and e.turns == 2
    assert tok.decode(e.token_ids.tolist()) == "2+9"  # no hint after the last turn
    assert e.env_reward == {"found": 0.0, "format": pytest.approx(0.1),
                            "near": pytest.approx(0.24)}


def test_guess_task_invariants() -> None:
    a, b = GuessTask(num_prompts=500, seed=3), GuessTask(num_prompts=500, seed=3)
    train = [a.prompt(i) for i in range(len(a))]
    assert len(a) == 500 and train == [b.prompt(i) for i in range(len(b))]  # deterministic
    held = a.heldout(10_000)  # 2,000 games at most
    assert len(held) == 2000
    assert {p["text"] for p in held} == {f"{5 * k:04d}?" for k in range(2000)}
    assert [p["text"] for p in held] != sorted(p["text"] for p in held)  # a permutation
    assert a.heldout(5) == held[:5] and a.heldout(0) == []
    for p in train + held:
        assert set(p) == {"text", "answer", "lo", "hi", "task"} and p["task"] == "guess"
        assert (p["lo"], p["hi"]) == (0, 9)
        assert len(p["text"]) == 5 and p["text"][:4].isdigit() and p["text"][4] == "?"
        assert p["answer"] in set("0123456789")
    games = [int(p["text"][:4]) for p in train]
    assert all(g % 5 and 1 <= g <= 9999 for g in games)
    assert len(set(games)) > 450  # drawn from 8,000 ids
    assert {p["answer"] for p in train} == set("0123456789")  # the secret varies
    assert [GuessTask(50, seed=4).prompt(i) for i in range(50)] != train[:50]
    assert GuessTask(50, seed=4).heldout(50) != a.heldout(50)
    with pytest.raises(IndexError):
        a.prompt(500)
    with pytest.raises(IndexError):
        a.prompt(-1)


def test_guess_task_heldout_is_disjoint_from_training_deterministic_with_digit_answers(
        ) -> None:
    """Held-out texts never occur among the training texts (of any seed: the split is by
    game id); the held-out games and their hidden digits are the same on every build."""
    for seed in (0, 1):
        task = GuessTask(seed=seed)  # 20,000 draws of 8,000 ids: about 92% of them
        train = {task.prompt(i)["text"] for i in range(len(task))}
        assert len(train) > 7000
        held = task.heldout(2000)
        assert train.isdisjoint(p["text"] for p in held)
        assert held == GuessTask(num_prompts=7, seed=seed).heldout(2000)  # not on num_prompts
        assert all(len(p["answer"]) == 1 and p["answer"].isdigit() for p in held)
        assert {p["answer"] for p in held} == set("0123456789")
        other = GuessTask(seed=1 - seed).heldout(2000)
        assert train.isdisjoint(p["text"] for p in other)
