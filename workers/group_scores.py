"""Each group's scores for one read, apart from the scorer role's bookkeeping: the rewards
(in the reward process, `rewards_of`) and the teacher's logprobs of every group, the
whole read at once and, when that call fails, group by group (`whole_then_each`), and
the ``scoring.advantages`` hook's call. Every result is per group, in the read's order.
`workers.scorer` settles the results."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from pipeline.bus.schema import RolloutGroup
from pipeline.rl.advantages import check_hook_advantages
from workers.reward_runner import RewardRunner
from workers.rollout_loop import LoopGroup, RolloutLoop
from workers.tasks.rewards import RewardError, episode_inputs, reward_kwargs
from workers.teacher import Teacher, TeacherError

log = logging.getLogger("sluice.scorer")


def _reward_inputs(gs: list[RolloutGroup]) -> dict[str, Any]:
    """The keyword arguments of one reward call over every rollout of ``gs``."""
    prompts = [g.prompt for g in gs for _ in g.rollouts]
    rollouts = [r for g in gs for r in g.rollouts]
    comps, extra = episode_inputs(prompts, rollouts)
    return reward_kwargs(prompts, comps, [r.completion_ids.tolist() for r in rollouts],
                         [r.finish_reason for r in rollouts], extra)


async def rewards_of(runner: RewardRunner, groups: list[RolloutGroup]
                     ) -> list[np.ndarray | RewardError]:
    """Per group, its [n, F] reward matrix (NaN where a function returned None) or
    the error of its own call, computed in the reward process (`workers.reward_runner`).
    One call over all groups first; on failure, one call per group, all of them in one
    round trip and concurrently (so a hanging function costs one more timeout, not one
    per group). Whatever a reward raises, returns or however it hangs, the result is a
    ``RewardError`` in its group's place, never an exception out of here."""
    if not groups:
        return []
    (whole,) = await runner.matrices([_reward_inputs(groups)])
    if not isinstance(whole, RewardError):
        bounds = np.cumsum([0, *(len(g.rollouts) for g in groups)])
        return [whole[a:b] for a, b in itertools.pairwise(bounds)]
    if len(groups) == 1:
        return [whole]
    log.info("reward call over %d groups failed (%s); scoring them one by one",
             len(groups), whole)
    return await runner.matrices([_reward_inputs([g]) for g in groups])


async def teacher_of(teacher: Teacher | None, groups: list[RolloutGroup]
                     ) -> list[list[np.ndarray] | TeacherError | None]:
    """Per group, the teacher's logprobs of each rollout's tokens, or the error of its
    own call; None per group without a teacher. One call over all groups first."""
    if teacher is None:
        return [None] * len(groups)

    async def call(gs: list[RolloutGroup]) -> list[np.ndarray]:
        rollouts = [r for g in gs for r in g.rollouts]
        out = await teacher.logprobs([(g.prompt_ids, r.completion_ids, r.mask)
                                      for g in gs for r in g.rollouts])
        if len(out) != len(rollouts):
            raise TeacherError(f"{len(out)} teacher answers for {len(rollouts)} rollouts")
        for r, lp in zip(rollouts, out, strict=True):
            if len(lp) != len(r.mask) or not np.isfinite(lp[r.mask > 0]).all():
                raise TeacherError(f"{len(lp)} teacher logprobs for {len(r.mask)} "
                                   "tokens, or one not finite")
        return out

    return await whole_then_each(groups, call, TeacherError, "teacher")  # type: ignore[return-value]


async def hook_advantages(hook: Callable[..., Any], g: RolloutGroup, total: np.ndarray
                          ) -> tuple[np.ndarray, list[np.ndarray] | None]:
    """The ``scoring.advantages`` hook's advantages of group ``g`` (checked by
    `pipeline.rl.advantages.check_hook_advantages`); ``ValueError`` when it raises or
    returns something else."""
    columns = {k: v for k, v in g.prompt.items() if k != "text"}
    kwargs = {**columns, "rewards": [float(x) for x in total],
              "completion_ids": [r.completion_ids.tolist() for r in g.rollouts],
              "mask": [r.mask.tolist() for r in g.rollouts], "prompt": g.prompt}
    try:
        out = hook(**kwargs)
        if asyncio.iscoroutine(out):
            out = await out
    except Exception as err:
        raise ValueError(f"raised {err!r}") from err
    return check_hook_advantages(out, [len(r.completion_ids) for r in g.rollouts],
                                 "scoring.advantages")


async def loop_advantages(loop: RolloutLoop, g: RolloutGroup, total: np.ndarray,
                          parts: dict[str, np.ndarray], adv: np.ndarray
                          ) -> tuple[np.ndarray, list[np.ndarray] | None]:
    """The rollout loop's ``compute_advantages`` of group ``g`` (``adv``: sluice's
    group-relative advantages, what the default returns), checked like the
    ``scoring.advantages`` hook's; ``ValueError`` when it raises, returns something else
    or assigns state that is not JSON; its state writes are then dropped."""
    group = LoopGroup(
        row_index=g.prompt_index, epoch=g.epoch, group_id=g.group_id, row=g.prompt,
        rewards=np.array(total, dtype=np.float64),
        reward_parts={k: np.array(v, dtype=np.float64) for k, v in parts.items()},
        completions=[r.text for r in g.rollouts],
        completion_ids=[r.completion_ids.tolist() for r in g.rollouts],
        mask=[r.mask.tolist() for r in g.rollouts], advantages=np.array(adv, dtype=np.float64))
    mark = loop.state.mark()
    try:
        out = loop.compute_advantages(group)
        if asyncio.iscoroutine(out):
            out = await out
    except Exception as err:
        loop.state.restore(mark)
        raise ValueError(f"raised {err!r}") from err
    try:
        return check_hook_advantages(out, [len(r.completion_ids) for r in g.rollouts],
                                     "compute_advantages")
    except ValueError:
        loop.state.restore(mark)
        raise


E = TypeVar("E", bound=Exception)
R = TypeVar("R")


async def whole_then_each(groups: list[RolloutGroup],
                          call: Callable[[list[RolloutGroup]], Awaitable[Sequence[R]]],
                          error: type[E], what: str) -> list[Sequence[R] | E]:
    """Per group, its slice of ``call(groups)`` (one item per rollout), or when that call
    raises ``error``, of ``call([group])`` for each group alone, concurrently (so a
    timing-out function costs one more timeout, not one per group): the error of a group
    that fails on its own is returned in its place (module docstring)."""
    if not groups:
        return []
    try:
        whole = await call(groups)
    except error as err:
        if len(groups) == 1:
            return [err]
        log.info("%s call over %d groups failed (%s); scoring them one by one", what,
                 len(groups), err)
    else:
        bounds = np.cumsum([0, *(len(g.rollouts) for g in groups)])
        return [whole[a:b] for a, b in itertools.pairwise(bounds)]
    results = await asyncio.gather(*(call([g]) for g in groups), return_exceptions=True)
    out: list[Sequence[R] | E] = []
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, error):
            raise r
        out.append(r)  # type: ignore[arg-type]
    return out
