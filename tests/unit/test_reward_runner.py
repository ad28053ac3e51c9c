"""The scorer's reward process (`workers.reward_runner`), driven directly: a call that
blocks the child's loop is charged alone (the calls it starved run again in a fresh
child), a child that dies costs only the calls it had started, and every kill leaves
one child, reaped."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import numpy as np

from workers.reward_runner import RewardRunner
from workers.tasks.rewards import RewardError, load_reward, reward_kwargs

MOD = "tests.integration.misbehaving_rewards"


def _batch(answer: str) -> dict[str, Any]:
    return reward_kwargs([{"text": "q", "answer": answer}] * 2, ["ab", "a"], [[1], [2]],
                         ["stop", "stop"])


def test_a_blocked_loop_is_charged_to_its_call_only_and_a_dead_child_is_replaced() -> None:
    async def go() -> None:
        runner = RewardRunner([load_reward(f"{MOD}:blocking")], timeout_s=1.0)
        try:
            # "block" starts first and blocks the child's loop: "ok" never starts there
            block, ok = await runner.matrices([_batch("block"), _batch("ok")])
            assert isinstance(block, RewardError) and "timed out after 1s" in str(block)
            np.testing.assert_array_equal(ok, [[2.0], [1.0]])
            assert runner.restarts == 1 and runner.pid is not None  # the fresh child
        finally:
            await runner.close()
        runner = RewardRunner([load_reward(f"{MOD}:misbehaving")], timeout_s=30.0)
        try:
            (died,) = await runner.matrices([_batch("die")])
            assert isinstance(died, RewardError) and "died (exit code 7" in str(died)
            (ok,) = await runner.matrices([_batch("ok")])  # a fresh child
            np.testing.assert_array_equal(ok, [[2.0], [1.0]])
            assert runner.restarts == 1
        finally:
            pid = runner.pid
            await runner.close()
        assert pid is not None and not os.path.exists(f"/proc/{pid}")

    asyncio.run(go())
