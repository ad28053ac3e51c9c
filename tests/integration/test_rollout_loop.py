"""A stateful rollout loop (``generation.rollout_loop``) through the real parts: TRL's
curriculum example as a `RolloutLoop`, its ``compute_advantages`` in a real `Scorer`
deciding what its ``filter_prompt`` admits in a real `Generator` (each with its own
instance: the only channel between them is the run's Redis); a filter that rejects a
whole epoch stops the generator with a clear error, the CLI exits `FATAL_EXIT_CODE` and
`sluice up`'s supervisor ends the run on it instead of restarting the role.

Real redis-server (the session fixture), real tiny model and tokenizer, real reward
process."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.bus.client import Bus
from pipeline.bus.codec import decode_entry
from pipeline.bus.keys import SCORERS_GROUP
from pipeline.bus.schema import RolloutGroup, ScoredGroup
from pipeline.config import load_config
from pipeline.rl.advantages import group_advantages
from pipeline.runtime import FATAL_EXIT_CODE
from sluice.embedded import EmbeddedRedis
from sluice.restarts import RestartPolicy
from sluice.supervisor import Child, Supervisor
from tests.conftest import arun
from tests.helpers import run_header, spawn_role, write_config
from tests.integration.loop_hooks import even
from workers.generator import Generator
from workers.prompt_filter import FilterRejectedEpoch
from workers.rollout_loop import LoopGroup, RolloutLoop
from workers.scorer import Scorer

pytestmark = pytest.mark.integration
HERE = "tests.integration.test_rollout_loop"
HOOKS = "tests.integration.loop_hooks"  # imported by the reward process and a CLI child
N = 6  # prompts per epoch (task.num_prompts)


class Curriculum(RolloutLoop):
    """TRL's curriculum example: ``compute_advantages`` records each prompt's pass rate,
    ``filter_prompt`` skips the prompts the policy already solves every time."""

    def setup(self) -> None:
        self.solved_at = 1.0

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        rate = self.state.get(row_index)
        return rate is None or rate < self.solved_at

    def compute_advantages(self, group: LoopGroup) -> Any:
        self.state[group.row_index] = float(np.mean(group.rewards >= 1.0))
        return super().compute_advantages(group)


class KeepOneRow(RolloutLoop):
    """Keeps one dataset row only, in every epoch."""

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        return row_index == 3


class BadState(RolloutLoop):
    def compute_advantages(self, group: LoopGroup) -> Any:
        self.state[group.row_index] = {"rate": float("nan")}  # JSON has no NaN
        return super().compute_advantages(group)


class RejectAll(RolloutLoop):
    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        return False


def _cfg(redis: EmbeddedRedis, run: str, model: Path, out: Path, *sets: str) -> Any:
    return load_config(None, [f"run.name={run}", f"run.output_dir={out}",
                              f"bus.redis_url={redis.url}", f"model.path={model}",
                              "model.init=''", "generation.num_generations=3",
                              "generation.max_new_tokens=3", f"task.num_prompts={N}",
                              "scoring.zero_variance=train", *sets])


def _generate(cfg: Any, gen: Generator, n: int) -> tuple[dict[str, int], list[RolloutGroup]]:
    """Admit ``n`` cursors and generate them as one batch; the run's state and every
    group on ``rollouts`` so far."""
    async def go() -> tuple[dict[str, int], list[RolloutGroup]]:
        bus = Bus.connect(cfg.redis_url, cfg.run.name)
        try:
            cursors = [await bus.admit(64, gen.wid) for _ in range(n)]
            await gen.generate_batch(bus, [c for c in cursors if c is not None])
            return await bus.state(), [decode_entry(f) for _i, f in
                                       await bus.r.xrange(bus.keys.rollouts)]
        finally:
            await bus.close()

    return arun(go())


def _score_all(cfg: Any, scorer: Scorer) -> list[ScoredGroup]:
    """One scorer read of everything new on ``rollouts``, handed on; all `scored`. The
    scorer's reward process is closed after (in this event loop, which started it)."""
    async def go() -> list[ScoredGroup]:
        bus = Bus.connect(cfg.redis_url, cfg.run.name)
        try:
            await bus.ensure_group(bus.keys.rollouts, SCORERS_GROUP)
            await bus.ensure_group(bus.keys.scored, "trainers")
            entries = await bus.read_lanes("rollouts", SCORERS_GROUP, "s0", count=64,
                                           block_ms=100)
            await scorer.process(bus, entries)
            return [decode_entry(f) for _i, f in await bus.r.xrange(bus.keys.scored)]
        finally:
            await bus.close()
            await scorer.runner.close()

    return arun(go())


def _loop_state(cfg: Any) -> dict[int, Any]:
    async def go() -> dict[int, Any]:
        bus = Bus.connect(cfg.redis_url, cfg.run.name)
        try:
            return await bus.loop_read(list(range(N)))
        finally:
            await bus.close()

    return arun(go())


def test_trl_curriculum_state_from_the_scorer_decides_what_the_generator_admits(
        redis_server: EmbeddedRedis, run_name: str, tiny_model_dir: Path,
        tmp_path: Path) -> None:
    cfg = _cfg(redis_server, run_name, tiny_model_dir, tmp_path,
               f"generation.rollout_loop={HERE}:Curriculum",
               f"scoring.rewards=[{{fn='{HOOKS}:solved_if_even'}}]")
    gen, scorer = Generator(cfg, "g0"), Scorer(cfg, "s0")
    assert gen.filter.loop is not scorer.loop  # one instance per role, like processes
    assert gen.filter.loop.role == "generator" and scorer.loop.role == "scorer"

    # epoch 0: no statistics yet, every prompt is admitted and generated
    state, groups = _generate(cfg, gen, N)
    assert len(groups) == N and state.get("retired:filtered", 0) == 0
    assert sorted(g.prompt_index for g in groups) == list(range(N))
    evens = {g.prompt_index for g in groups if even(g.prompt["text"])}
    assert 0 < len(evens) < N  # both kinds among the prompts (fixed seed)

    # the scorer's compute_advantages records each row's pass rate in Redis and
    # trains on the default group advantages (super())
    scored = _score_all(cfg, scorer)
    assert len(scored) == N
    assert _loop_state(cfg) == {i: (1.0 if i in evens else 0.0) for i in range(N)}
    for sg in scored:
        want = group_advantages(sg.rewards.astype(np.float64))
        assert np.allclose(sg.advantages, want, atol=1e-5)
    assert any(sg.advantages.any() for sg in scored)

    # epoch 1: the generator's filter_prompt reads those rates and skips the solved
    state, groups = _generate(cfg, gen, N)
    new = [g for g in groups if g.epoch == 1]
    assert sorted(g.prompt_index for g in new) == sorted(set(range(N)) - evens)
    assert state["retired:filtered"] == len(evens) == gen.info()["skipped_prompts"]
    assert state["cursor"] == 2 * N and state["generating"] == 0


def test_compute_advantages_writing_state_that_is_not_json_dead_letters_its_group(
        redis_server: EmbeddedRedis, run_name: str, tiny_model_dir: Path,
        tmp_path: Path) -> None:
    cfg = _cfg(redis_server, run_name, tiny_model_dir, tmp_path,
               f"generation.rollout_loop={HERE}:BadState",
               f"scoring.rewards=[{{fn='{HOOKS}:solved_if_even'}}]")
    gen, scorer = Generator(cfg, "g0"), Scorer(cfg, "s0")
    _generate(cfg, gen, 2)
    assert _score_all(cfg, scorer) == []
    assert _loop_state(cfg) == {i: None for i in range(N)}  # nothing half-written

    async def dlq() -> list[str]:
        bus = Bus.connect(cfg.redis_url, cfg.run.name)
        try:
            return [f[b"reason"].decode() for _i, f in await bus.r.xrange(bus.keys.dlq)]
        finally:
            await bus.close()

    reasons = arun(dlq())
    assert len(reasons) == 2, reasons
    assert all(r.startswith("generation.rollout_loop: raised ValueError('rollout loop "
                            "state of row") and "not JSON" in r for r in reasons), reasons


@pytest.mark.parametrize("how", ["hook", "loop"])
def test_a_filter_that_rejects_a_whole_epoch_stops_the_generator(
        redis_server: EmbeddedRedis, run_name: str, tiny_model_dir: Path,
        tmp_path: Path, how: str) -> None:
    what = (f"generation.filter_prompt={HOOKS}:reject_all" if how == "hook"
            else f"generation.rollout_loop={HERE}:RejectAll")
    cfg = _cfg(redis_server, run_name, tiny_model_dir, tmp_path, what)
    gen = Generator(cfg, "g0")
    _generate(cfg, gen, N - 1)  # all but one prompt of epoch 0 rejected: not yet
    with pytest.raises(FilterRejectedEpoch, match=f"rejected all {N} prompts of epoch 0"):
        _generate(cfg, gen, 1)
    state, groups = _state_after(cfg)
    assert state["retired:filtered"] == N and state["generating"] == 0 and not groups


def test_a_filter_that_keeps_one_prompt_per_epoch_goes_on(
        redis_server: EmbeddedRedis, run_name: str, tiny_model_dir: Path,
        tmp_path: Path) -> None:
    cfg = _cfg(redis_server, run_name, tiny_model_dir, tmp_path,
               f"generation.rollout_loop={HERE}:KeepOneRow")
    gen = Generator(cfg, "g0")
    state, groups = _generate(cfg, gen, 2 * N)  # two whole epochs, no error
    assert [(g.epoch, g.prompt_index) for g in groups] == [(0, 3), (1, 3)]
    assert state["retired:filtered"] == 2 * (N - 1)


def _state_after(cfg: Any) -> tuple[dict[str, int], list[Any]]:
    async def go() -> tuple[dict[str, int], list[Any]]:
        bus = Bus.connect(cfg.redis_url, cfg.run.name)
        try:
            return await bus.state(), await bus.r.xrange(bus.keys.rollouts)
        finally:
            await bus.close()

    return arun(go())


def test_the_cli_exits_fatal_and_sluice_up_ends_the_run_instead_of_restarting(
        redis_server: EmbeddedRedis, run_name: str, tiny_model_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    cfg_path = write_config(tmp_path / "g.toml", run_header(
        run_name, tmp_path / "run", redis_server.url, heartbeat_s=0.3) + f"""
[model]
path = "{tiny_model_dir}"
init = ""
[task]
num_prompts = {N}
[generation]
num_generations = 2
max_new_tokens = 2
filter_prompt = "{HOOKS}:reject_all"
""")
    log = tmp_path / "gen.log"
    proc = spawn_role("generate", cfg_path, name="generator-0", log=log)
    try:
        rc = proc.wait(180)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the generator did not stop:\n{log.read_text()[-3000:]}") from None
    text = log.read_text()
    assert rc == FATAL_EXIT_CODE, text[-3000:]
    assert (f"sluice: generate stopped: generation.filter_prompt rejected all {N} prompts "
            "of epoch 0") in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]

    # `sluice up`'s supervisor: reported at once with the log's tail, no restart, and
    # the run's end names the role
    from sluice.up import stop_reason

    sup = Supervisor(load_config(cfg_path), str(cfg_path), [])
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        sup.children += [Child("train", "trainer-0", trainer, tmp_path / "t.log"),
                         Child("generate", "generator-0", proc, log)]
        policy = RestartPolicy(max_restarts=3)
        reason = stop_reason(sup, asyncio.Event(), policy, None)
    finally:
        trainer.kill()
        trainer.wait()
    assert reason == "generator-0 stopped on an error no restart can fix"
    assert sup.children[1].restart_at is None and policy.count("generator-0") == 0
    err = capsys.readouterr().err
    assert "generator-0 stopped on an error no restart can fix (exit code 78)" in err
    assert f"rejected all {N} prompts of epoch 0" in err


def test_skips_count_once_per_cursor_and_epoch_summed_over_lanes(
        redis_server: EmbeddedRedis, run_name: str) -> None:
    """The SKIP script counts a cursor's skip in its lane's ``skipped`` with the
    retirement: a retried call (same op) counts nothing more, and `skipped_in_epoch` sums
    the lanes, so the whole-epoch check is exact with partitions too."""
    async def go() -> tuple[int, int, dict[str, int]]:
        bus = Bus.connect(redis_server.url, run_name, partitions=2)
        try:
            cursors = [await bus.admit(64, "g") for _ in range(5)]
            assert sorted(cursors) == list(range(5))  # type: ignore[type-var]
            for c in cursors:
                assert await bus.skip(c, owner="g", op=f"skip:{c}", epoch=c // 3)
                assert await bus.skip(c, owner="g", op=f"skip:{c}", epoch=c // 3)  # retry
            assert not await bus.skip(0, owner="g", op="skip:0:again", epoch=0)  # no lease
            lanes = {k.skipped: await bus.r.hgetall(k.skipped) for k in bus.lanes.keys}
            assert len(lanes) == 2 and all(lanes.values())  # both lanes hold counts
            return (await bus.skipped_in_epoch(0), await bus.skipped_in_epoch(1),
                    await bus.state())
        finally:
            await bus.close()

    e0, e1, state = arun(go())
    assert (e0, e1) == (3, 2) and state["retired:filtered"] == 5
