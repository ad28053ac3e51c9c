"""Rewards: hand-computed match scores, loading by import path, validated keyword calls
(TRL's convention), the reward matrix and the start-up probe."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from workers.tasks.rewards import (
    RewardError,
    RewardFn,
    call_reward,
    copy_reward,
    exact_match,
    first_number_reward,
    format_reward,
    load_reward,
    match_reward,
    probe_reward,
    reward_kwargs,
    reward_matrix,
)


def _score(fn: Any, answer: str, completion: str, finish: str) -> float | None:
    return fn(completions=[completion], answer=[answer], finish_reason=[finish])[0]


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
    got = match_reward(completions=["21", "8", "1"], answer=["21", "7", None],
                       finish_reason=["stop"] * 3)
    assert got == [1.0, 0.5, None]  # no answer -> None


def test_builtin_rewards_read_conversational_completions() -> None:
    conv = [[{"role": "assistant", "content": "21"}], [{"role": "assistant", "content": "8"}]]
    assert match_reward(completions=conv, answer=["21", "7"], finish_reason=["stop"] * 2) == \
        [1.0, 0.5]
    assert exact_match(completions=conv, answer=["21", "8"], finish_reason=["stop"] * 2) == \
        [1.0, 1.0]


def test_match_reward_needs_finish_reason() -> None:
    with pytest.raises(ValueError, match="finish_reason"):
        match_reward(completions=["1"], answer=["1"])


def test_exact_match_and_format() -> None:
    assert _score(exact_match, "123", "123", "stop") == 1.0
    assert _score(exact_match, "123", "123", "length") == 0.0
    assert _score(exact_match, "123", "1234", "stop") == 0.0
    assert format_reward(completions=["123", "", "12a", "١٢"]) == [1.0, 0.0, 0.0, 0.0]


def test_first_number_reward_reads_the_first_integer() -> None:
    completions = ["896", "896 is larger than 473.", "473 is smaller, so 896.",
                   "To compare them: 896", "The answer is -12.", "no number", "8960",
                   [{"role": "assistant", "content": "Answer: 896"}]]
    answers = ["896", "896", "896", "896", "-12", "896", "896", "896"]
    assert first_number_reward(completions=completions, answer=answers) == \
        [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert first_number_reward(completions=["1", "2"], answer=[None, "2"]) == [None, 1.0]
    with pytest.raises(ValueError, match="2 values for 1 completions"):
        first_number_reward(completions=["1"], answer=["1", "2"])


def test_load_reward_ok() -> None:
    rf = load_reward("workers.tasks.rewards:copy_reward", weight=0.5)
    assert rf == RewardFn(name="copy_reward", fn=match_reward, weight=0.5)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("workers.tasks.rewards", "expected 'package.module:function'"),
        (":copy_reward", "expected 'package.module:function'"),
        ("workers.tasks.rewards:", "expected 'package.module:function'"),
        ("a:b:c", "expected 'package.module:function'"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("workers.tasks.rewards:no_such_fn", "has no attribute 'no_such_fn'"),
        ("math:pi", "'pi' is float, not callable"),
    ],
)
def test_load_reward_errors_name_the_path(path: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        load_reward(path)
    assert repr(path) in str(info.value)


def test_reward_fn_rejects_bad_weight() -> None:
    with pytest.raises(ValueError, match="finite"):
        load_reward("workers.tasks.rewards:exact_match", weight=float("nan"))


def _call(fn: Any, timeout_s: float = 5.0, n: int = 2) -> list[float | None]:
    rf = RewardFn(name=getattr(fn, "__name__", "fn"), fn=fn)
    kwargs = reward_kwargs([{"text": "1=", "answer": "1"}] * n, ["1", "2"][:n], [[1], [2]][:n],
                           ["stop"] * n)
    return asyncio.run(call_reward(rf, kwargs, n, timeout_s))


def test_call_reward_sync_runs_in_a_thread() -> None:
    import threading

    main = threading.get_ident()
    threads: list[int] = []

    def sync_fn(**kwargs):  # type: ignore[no-untyped-def]
        threads.append(threading.get_ident())
        return match_reward(**kwargs)

    assert _call(sync_fn) == [1.0, 0.5]
    assert threads and threads[0] != main


def test_call_reward_async_and_numpy_results() -> None:
    async def async_fn(*, prompts, completions, completion_ids, **fields):  # type: ignore[no-untyped-def]
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
        ([10**400, 1.0], "reward 0 is not a finite float"),  # float() raises OverflowError
        (None, "returned NoneType, expected a list"),
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


def test_reward_kwargs_are_trls_keywords_with_columns_under_their_own_names() -> None:
    prompts = [{"text": "q1", "solution": "4", "answer": "4"}, {"text": "q2", "extra": 1}]
    kw = reward_kwargs(prompts, ["a", "b"], [[5, 1], [6]], ["stop", "length"])
    assert kw["prompts"] == ["q1", "q2"] and kw["completions"] == ["a", "b"]
    assert kw["completion_ids"] == [[5, 1], [6]]
    assert kw["solution"] == ["4", None] and kw["extra"] == [None, 1]  # union, None if absent
    assert kw["finish_reason"] == ["stop", "length"] and kw["trainer_state"] is None
    assert kw["log_extra"]("col", [1]) is None and kw["log_metric"]("m", 1.0) is None
    assert "text" not in kw
    conv = [{"role": "user", "content": "2+2?"}]
    kw = reward_kwargs([{"text": conv}], ["4"], [[]], ["stop"])
    assert kw["prompts"] == [conv]
    assert kw["completions"] == [[{"role": "assistant", "content": "4"}]]  # as TRL


def _keyword_only(*, completions: list[Any], target: list[str], **kwargs: Any) -> list[float]:
    return [float(c == t) for c, t in zip(completions, target, strict=True)]


def test_reward_matrix_calls_each_function_once_over_the_batch() -> None:
    calls: list[int] = []

    def counting(*, completions: list[Any], **kwargs: Any) -> list[float | None]:
        calls.append(len(completions))
        return [None if c == "" else 0.5 for c in completions]

    rewards = [RewardFn("counting", counting), RewardFn("kw", _keyword_only, weight=2.0)]
    prompts = [{"text": "p", "target": "x"}] * 3
    m = asyncio.run(reward_matrix(rewards, prompts, ["x", "", "y"], [[1], [2], [3]],
                                  ["stop"] * 3, timeout_s=5))
    assert calls == [3]
    np.testing.assert_array_equal(m, [[0.5, 1.0], [np.nan, 0.0], [0.5, 0.0]])


def test_reward_matrix_raises_the_failing_functions_error() -> None:
    rewards = [RewardFn("ok", format_reward), RewardFn("kw", _keyword_only)]
    with pytest.raises(RewardError, match=r"'kw': raised TypeError.*'target'"):
        asyncio.run(reward_matrix(rewards, [{"text": "p"}], ["1"], [[1]], ["stop"], timeout_s=5))


def test_trl_reward_functions_run_unchanged() -> None:
    from trl.rewards import accuracy_reward, think_format_reward

    conv = [{"role": "user", "content": "What is 1/3 as a fraction?"}]
    prompts = [{"text": conv, "solution": r"\frac{1}{3}"}] * 3
    texts = [r"<think>easy</think> \boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}}", "no idea"]
    rewards = [load_reward("trl.rewards:accuracy_reward"),
               load_reward("trl.rewards:think_format_reward")]
    m = asyncio.run(reward_matrix(rewards, prompts, texts, [[1]] * 3, ["stop"] * 3,
                                  timeout_s=60))
    np.testing.assert_array_equal(m, [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    assert rewards[0].fn is accuracy_reward and rewards[1].fn is think_format_reward


def test_probe_reports_the_functions_own_error_and_accepts_a_working_one() -> None:
    prompt = {"text": "12=", "answer": "12"}
    assert asyncio.run(probe_reward(load_reward("workers.tasks.rewards:exact_match"), prompt, 5)) \
        is None
    problem = asyncio.run(probe_reward(RewardFn("kw", _keyword_only), prompt, 5))
    assert problem == ("TypeError: _keyword_only() missing 1 required keyword-only argument: "
                       "'target'")
    assert asyncio.run(probe_reward(RewardFn("kw", _keyword_only), {**prompt, "target": "1"},
                                    5)) is None

    def one_value(**kwargs: Any) -> list[float]:
        return [1.0]

    assert asyncio.run(probe_reward(RewardFn("one", one_value), prompt, 5)) == \
        "returned 1 rewards for 2 completions"


def test_a_hung_sync_reward_times_out_without_keeping_the_process() -> None:
    """The probe (and every call) runs a sync function in a daemon thread: a function that
    never returns times out, and ``asyncio.run`` returns instead of joining its thread."""
    import threading

    release = threading.Event()

    def hung(**kwargs: Any) -> list[float]:
        release.wait(60)
        return [0.0, 0.0]

    t0 = time.monotonic()
    problem = asyncio.run(probe_reward(RewardFn("hung", hung), {"text": "p"}, 0.2))
    assert problem == "timed out after 0.2s" and time.monotonic() - t0 < 5
    release.set()


def test_boxed_format_reward_wants_exactly_one_boxed_answer() -> None:
    from workers.tasks.rewards import boxed_format_reward

    got = boxed_format_reward(completions=["so \\boxed{72}", "72", "\\boxed{1} \\boxed{2}",
                                           [{"role": "assistant", "content": "\\boxed{x}"}]])
    assert got == [1.0, 0.0, 0.0, 1.0]
