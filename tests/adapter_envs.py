"""Environments of other libraries for the adapter tests (`workers.environments.
verifiers_adapter`, `openenv_adapter`): real library classes, no network.

- `load_guess`: a ``vf.MultiTurnEnv`` subclass, guess the number with higher/lower
  hints; its rubric weighs two reward functions (1.0 and 0.5) so a test can recompute
  the reward from the episode's conversation (`expected_guess_reward`).
- `load_tools`: a ``vf.ToolEnv`` with a python function tool ``add``.
- `generate_echo_env`: the echo environment OpenEnv's own ``openenv init`` generates.

Texts use only characters of the tiny model's character tokenizer (no newlines), so an
observation decoded from its tokens is the observation's text exactly.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np

GUESS_ANSWER = "7"
GUESS = {"text": "Guess a number", "answer": GUESS_ANSWER, "task": "jsonl"}


def guess_reply(text: str, answer: str) -> str:
    """What `GuessEnv` answers to a model turn."""
    digits = re.sub(r"\D", "", text)[:4]
    if not digits:
        return "Reply with a number."
    if int(digits) == int(answer):
        return "Correct!"
    return "Wrong, go higher." if int(digits) < int(answer) else "Wrong, go lower."


def correct(completion: Any, answer: str, **kw: Any) -> float:
    asst = [m for m in completion if m.role == "assistant"]
    return 1.0 if asst and re.sub(r"\D", "", asst[-1].content or "") == answer else 0.0


def length(completion: Any, **kw: Any) -> float:
    return sum(len(m.content or "") for m in completion if m.role == "assistant") / 100


def expected_guess_reward(assistant_texts: list[str], answer: str = GUESS_ANSWER) -> float:
    """The guess rubric's total (``correct`` * 1.0 + ``length`` * 0.5), from the texts."""
    right = 1.0 if re.sub(r"\D", "", assistant_texts[-1]) == answer else 0.0
    return right + 0.5 * sum(len(t) for t in assistant_texts) / 100


def _dataset(answer: str) -> Any:
    from datasets import Dataset

    return Dataset.from_list([{"question": "Guess a number", "answer": answer}])


def load_guess(max_turns: int = 3) -> Any:
    import verifiers as vf

    class GuessEnv(vf.MultiTurnEnv):
        async def setup_state(self, state: Any) -> Any:
            state["guesses"] = 0
            return state

        async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
            state["guesses"] += 1
            reply = guess_reply(messages[-1].content or "", state["answer"])
            if reply == "Correct!":
                state["final_env_response"] = [vf.UserMessage(content=reply)]
                return state["final_env_response"]
            return [vf.UserMessage(content=reply)]

    return GuessEnv(dataset=_dataset(GUESS_ANSWER), max_turns=max_turns,
                    rubric=vf.Rubric(funcs=[correct, length], weights=[1.0, 0.5]))


def load_broken() -> Any:
    """A ``MultiTurnEnv`` whose ``env_response`` raises."""
    import verifiers as vf

    class BrokenEnv(vf.MultiTurnEnv):
        async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
            raise ValueError("the board exploded")

    return BrokenEnv(dataset=_dataset(GUESS_ANSWER), max_turns=3,
                     rubric=vf.Rubric(funcs=[correct]))


def load_grouped() -> Any:
    """A guess environment whose rubric has a group-level reward function."""
    import verifiers as vf

    env = load_guess()

    def diversity(completions: Any, **kw: Any) -> list[float]:
        return [0.0] * len(completions)

    env.rubric = vf.Rubric(funcs=[diversity])
    return env


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first integer
        b: second integer
    """
    return a + b


def final_ok(completion: Any, answer: str, **kw: Any) -> float:
    return 1.0 if answer in (completion[-1].content or "") else 0.0


def load_tools(max_turns: int = 3) -> Any:
    import verifiers as vf

    return vf.ToolEnv(tools=[add], dataset=_dataset("5"), max_turns=max_turns,
                      rubric=vf.Rubric(funcs=[final_ok]))


def generate_echo_env(root: Path, name: str = "sluice_echo") -> tuple[str, str]:
    """Generate OpenEnv's echo environment package ``name`` under ``root`` with the
    library's own ``openenv init`` (its python entry point; the ``uv lock`` it would run
    afterwards needs the network and is skipped), put ``root`` on ``sys.path``, and give
    the import paths of its environment class and action class."""
    from openenv.cli.commands import init as oe_init

    with mock.patch.object(oe_init, "_generate_uv_lock", lambda env_dir: False):
        oe_init.init(name, output_dir=str(root))
    sys.path.insert(0, str(root))
    pascal = "".join(p.capitalize() for p in name.split("_"))
    return (f"{name}.server.{name}_environment:{pascal}Environment",
            f"{name}.models:{pascal}Action")


def make_runner(name: str, kwargs: dict[str, Any], max_turns: int = 6) -> Any:
    """An `EnvironmentRunner` from a config naming environment ``name`` with ``kwargs``
    (through `load_config` and `EnvironmentRunner.from_config`, as a generator builds
    it: the probe instance included)."""
    from pipeline.config import load_config
    from workers.environments.runner import EnvironmentRunner

    cfg = load_config(None, [f"environment.name={json.dumps(name)}",
                             f"environment.kwargs={_toml(kwargs)}",
                             f"environment.max_turns={max_turns}",
                             "environment.max_episode_tokens=200"])
    return EnvironmentRunner.from_config(cfg)


def _toml(v: Any) -> str:
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + "}"
    return json.dumps(v)


async def run_group(runner: Any, engine: Any, tok: Any, prompt: dict[str, Any], n: int = 4,
                    max_new_tokens: int = 8) -> list[Any]:
    """``n`` episodes of ``prompt`` run by ``runner`` against ``engine``, as the generator
    runs a group (`RolloutContext`, `TurnBatcher`) without the bus."""
    from workers.engines.base import SamplingParams
    from workers.episodes import RolloutContext, TurnBatcher
    from workers.tasks.prompts import render_prompt

    ctx = RolloutContext(prompt, render_prompt(tok, prompt["text"]), n,
                         SamplingParams(max_new_tokens), tok, TurnBatcher(engine))
    return list(await runner.group(ctx))


def mask_runs(mask: np.ndarray) -> list[tuple[int, int, int]]:
    """``(value, start, end)`` of each run of equal mask values."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((int(mask[start]), start, i))
            start = i
    return out


def check_episode(e: Any, tok: Any) -> tuple[list[str], list[str]]:
    """Assert an episode's arrays against its conversation; give (the model's texts, the
    observations' texts). Mask 0 exactly at observation tokens: each run of mask-0 tokens
    decodes to one observation the environment returned, in order, and the mask-1 tokens
    decode to the model's turns; inserted tokens have logprob 0."""
    model = [m["content"] for m in e.messages if m["role"] == "assistant"]
    obs = [m["content"] for m in e.messages if m["role"] != "assistant"]
    assert len(e.token_ids) == len(e.logprobs) == len(e.versions) == len(e.mask)
    ids = e.token_ids.tolist()
    zero = [tok.decode(ids[s:t]) for v, s, t in mask_runs(e.mask) if v == 0]
    assert zero == obs
    assert tok.decode([i for i, m in zip(ids, e.mask, strict=True) if m == 1],
                      skip_special_tokens=True) == "".join(model)
    assert (e.logprobs[e.mask == 0] == 0).all()
    assert e.turns == len(model)
    return model, obs


def check_guess_episode(e: Any, tok: Any, max_turns: int) -> None:
    """A verifiers guess episode: every observation is `GuessEnv`'s reply to the turn
    before it, the episode ends by verifiers' own stop (``stop``: max_turns or the right
    guess, whose final response the model does not see) and the reward is the rubric's
    total recomputed from the model's texts."""
    model, obs = check_episode(e, tok)
    assert e.finish_reason == "stop"
    assert obs == [guess_reply(t, GUESS_ANSWER) for t in model[:-1]]
    assert len(model) == max_turns or guess_reply(model[-1], GUESS_ANSWER) == "Correct!"
    assert e.env_reward is not None and set(e.env_reward) == {"reward"}
    assert abs(e.env_reward["reward"] - expected_guess_reward(model)) < 1e-9


def check_echo_episode(e: Any, tok: Any, opening: str, max_steps: int) -> None:
    """An OpenEnv echo episode: the reset observation opens it, each later observation is
    the model's previous turn echoed (an empty turn echoes nothing, so nothing is
    inserted), it ends after ``max_steps`` steps, and the reward is the sum of the echo
    environment's 0.1 * len(message) per step."""
    model, obs = check_episode(e, tok)
    assert e.finish_reason == "stop" and len(model) == max_steps
    assert obs == [opening, *[t for t in model[:-1] if t]]
    assert e.mask[:len(tok(opening, add_special_tokens=False).input_ids)].max() == 0
    assert e.env_reward is not None
    assert abs(e.env_reward["reward"] - sum(0.1 * len(t) for t in model)) < 1e-9
