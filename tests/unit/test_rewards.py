"""Rewards: hand-computed match scores, loading by import path, validated calls."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from workers.rewards import (
    RewardError,
    RewardFn,
    call_reward,
    copy_reward,
    exact_match,
    format_reward,
    load_reward,
    match_reward,
)


def _score(fn: Any, answer: str, completion: str, finish: str) -> float | None:
    prompts = [{"text": answer + "=", "answer": answer}]
    return fn(prompts, [completion], [[]], answer=[answer], finish_reason=[finish])[0]


@pytest.mark.parametrize(
    ("completion", "finish", "expected"),
    [
        ("48213", "stop", 1.0),  # exact, then EOS: 6/6
        ("48213", "length", 5 / 6),  # never stopped: EOS position missing
        ("48203", "stop", 5 / 6),  # one wrong digit
        ("482130", "stop", 5 / 7),  # one digit too many: 5 matches over 7 positions
        ("4821", "stop", 4 / 6),  # one too few: EOS lands on the '3' position
        ("", "stop", 0.0),  # immediate EOS
        ("", "length", 0.0),  # empty and never stopped
        ("99999999", "length", 0.0),
    ],
)
def test_match_reward_hand_computed(completion: str, finish: str, expected: float) -> None:
    assert _score(match_reward, "48213", completion, finish) == pytest.approx(expected)


def test_copy_reward_is_match_reward_and_batches() -> None:
    assert copy_reward is match_reward
    prompts = [{"text": "12:", "answer": "21"}, {"text": "7=", "answer": "7"}, {"text": "x"}]
    got = match_reward(prompts, ["21", "8", "1"], [[], [], []], finish_reason=["stop"] * 3)
    assert got == [1.0, 0.5, None]  # answer read from prompts; no answer -> None


def test_match_reward_needs_finish_reason() -> None:
    with pytest.raises(ValueError, match="finish_reason"):
        match_reward([{"answer": "1"}], ["1"], [[]], answer=["1"])


def test_exact_match_and_format() -> None:
    assert _score(exact_match, "123", "123", "stop") == 1.0
    assert _score(exact_match, "123", "123", "length") == 0.0
    assert _score(exact_match, "123", "1234", "stop") == 0.0
    assert format_reward([{}] * 4, ["123", "", "12a", "١٢"], [[]] * 4) == [1.0, 0.0, 0.0, 0.0]


def test_load_reward_ok() -> None:
    rf = load_reward("workers.rewards:copy_reward", weight=0.5)
    assert rf == RewardFn(name="copy_reward", fn=match_reward, weight=0.5)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("workers.rewards", "expected 'package.module:function'"),
        (":copy_reward", "expected 'package.module:function'"),
        ("workers.rewards:", "expected 'package.module:function'"),
        ("a:b:c", "expected 'package.module:function'"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("workers.rewards:no_such_fn", "has no attribute 'no_such_fn'"),
        ("math:pi", "'pi' is float, not callable"),
    ],
)
def test_load_reward_errors_name_the_path(path: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        load_reward(path)
    assert repr(path) in str(info.value)


def test_reward_fn_rejects_bad_weight() -> None:
    with pytest.raises(ValueError, match="finite"):
        load_reward("workers.rewards:exact_match", weight=float("nan"))


def _call(fn: Any, timeout_s: float = 5.0, n: int = 2) -> list[float | None]:
    rf = RewardFn(name=getattr(fn, "__name__", "fn"), fn=fn)
    prompts = [{"text": "1=", "answer": "1"}] * n
    fields = {"answer": ["1"] * n, "finish_reason": ["stop"] * n}
    return asyncio.run(call_reward(rf, prompts, ["1", "2"][:n], [[1], [2]][:n], fields, timeout_s))


def test_call_reward_sync_runs_in_a_thread() -> None:
    import threading

    main = threading.get_ident()
    threads: list[int] = []

    def sync_fn(prompts, completions, completion_ids, **fields):  # type: ignore[no-untyped-def]
        threads.append(threading.get_ident())
        return match_reward(prompts, completions, completion_ids, **fields)

    assert _call(sync_fn) == [1.0, 0.5]
    assert threads and threads[0] != main


def test_call_reward_async_and_numpy_results() -> None:
    async def async_fn(prompts, completions, completion_ids, **fields):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0)
        return [1, None]

    class AsyncCallable:
        __name__ = "async_callable"

        async def __call__(self, *args: Any, **kwargs: Any) -> list[float]:
            return [0.0, 1.0]

    assert _call(async_fn) == [1.0, None]
    assert _call(AsyncCallable()) == [0.0, 1.0]
    assert _call(lambda *a, **k: np.array([0.25, 0.5], dtype=np.float32)) == [0.25, 0.5]


def test_call_reward_timeout_names_the_function() -> None:
    async def slow_async(*args: Any, **kwargs: Any) -> list[float]:
        await asyncio.sleep(10)
        return [0.0, 0.0]

    def slow_sync(*args: Any, **kwargs: Any) -> list[float]:
        time.sleep(0.5)
        return [0.0, 0.0]

    for fn in (slow_async, slow_sync):
        with pytest.raises(RewardError, match=f"'{fn.__name__}': timed out after 0.05s"):
            _call(fn, timeout_s=0.05)


@pytest.mark.parametrize(
    ("result", "message"),
    [
        ([1.0], "returned 1 rewards for 2 completions"),
        ([1.0, 2.0, 3.0], "returned 3 rewards for 2 completions"),
        ([1.0, float("nan")], "reward 1 is not finite"),
        ([float("inf"), 1.0], "reward 0 is not finite"),
        ([1.0, "1"], "reward 1 is str, not a number"),
        ({"a": 1}, "returned dict, expected a list"),
    ],
)
def test_call_reward_validates_results(result: Any, message: str) -> None:
    def bad(*args: Any, **kwargs: Any) -> Any:
        return result

    with pytest.raises(RewardError, match=message) as info:
        _call(bad)
    assert info.value.name == "bad" and "'bad'" in str(info.value)


def test_call_reward_wraps_exceptions() -> None:
    def broken(*args: Any, **kwargs: Any) -> list[float]:
        raise KeyError("answer")

    with pytest.raises(RewardError, match="'broken': raised KeyError") as info:
        _call(broken)
    assert isinstance(info.value.__cause__, KeyError)
