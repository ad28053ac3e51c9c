"""Reward functions that misbehave never take the scorer down (real Redis, real scorer).

Every exception a reward raises and every value it returns that is not a finite float
fails that group's reward, like any reward error: counted, dead-lettered on its last
delivery, the other groups of the read scored. A reward that never returns (a sync one
sleeping, an async one blocking its event loop) is killed with the process it runs in
(`workers.reward_runner`): the scorer, a real ``sluice score`` process here, keeps
heartbeating and scoring, and after every hang holds no more threads or processes."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from pipeline.bus.client import Bus
from pipeline.bus.codec import encode, peek_group_id
from pipeline.bus.keys import SCORERS_GROUP, Keys
from pipeline.config import load_config
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun
from tests.helpers import make_group, run_header, spawn_role, wait_for, write_config
from workers.scorer import Scorer

pytestmark = pytest.mark.integration
REWARDS = "tests.integration.misbehaving_rewards"


def _group(gid: str, answer: str | None = None) -> Any:
    """A copy-task group of four varied completions; ``answer`` replaces the prompt's
    answer (the misbehaving rewards key on it)."""
    g = make_group(gid)
    if answer is not None:
        g.prompt = {"text": f"{answer}=", "answer": answer}
    return g


async def _emit(url: str, run_name: str, groups: list[Any]) -> None:
    bus = Bus.connect(url, run_name)
    try:
        await bus.ensure_group(bus.keys.rollouts, SCORERS_GROUP)
        for g in groups:
            assert await bus.emit(encode(g), cursor=await bus.admit(100, "g"), owner="g")
    finally:
        await bus.close()


BAD = {"huge": "reward 0 is not a finite float", "nan": "reward 0 is not finite (nan)",
       "inf": "reward 0 is not finite (inf)", "str": "reward 0 is str, not a number",
       "none": "returned NoneType, expected a list",
       "short": "returned 3 rewards for 4 completions",
       "raise": "raised ValueError('misbehaving reward')", "exit": "raised SystemExit(3)"}


def test_every_bad_value_or_exception_of_a_reward_costs_only_its_group(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.name={run_name}", f"run.output_dir={tmp_path}",
                             f"bus.redis_url={redis_server.url}", "bus.block_ms=50",
                             "bus.max_deliveries=1", "scoring.read_count=16",
                             f"scoring.rewards=[{{fn='{REWARDS}:misbehaving'}}]"])
    bad = {f"1:{i}": kind for i, kind in enumerate(BAD)}
    groups = [_group("0:1"), *(_group(gid, kind) for gid, kind in bad.items()), _group("0:2")]

    async def go() -> tuple[Scorer, list[Any], list[Any]]:
        await _emit(redis_server.url, run_name, groups)
        bus = Bus.connect(redis_server.url, run_name)
        scorer = Scorer(cfg, "s1")
        stop = asyncio.Event()
        task = asyncio.create_task(scorer.run(stop))

        async def settled() -> bool:
            if task.done():  # the scorer crashed: its exception fails the test here
                task.result()
                raise AssertionError("the scorer stopped on its own")
            return (await bus.r.xinfo_groups(bus.keys.rollouts))[0]["lag"] == 0 and \
                (await bus.r.xpending(bus.keys.rollouts, SCORERS_GROUP))["pending"] == 0

        try:
            deadline = time.monotonic() + 90
            while not await settled():
                assert time.monotonic() < deadline, f"every entry settled: {scorer.counts}"
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
        out = (await bus.r.xrange(bus.keys.scored), await bus.r.xrange(bus.keys.dlq))
        await bus.close()
        return scorer, *out

    scorer, scored, dlq = arun(go())
    assert len(scored) == 2
    reasons = {peek_group_id({k[5:]: v for k, v in f.items() if k.startswith(b"orig:")}):
               f[b"reason"].decode() for _, f in dlq}
    assert sorted(reasons) == sorted(bad)
    for gid, kind in bad.items():
        assert BAD[kind] in reasons[gid], (kind, reasons[gid])
    assert scorer.counts["reward_errors"] == len(bad) and scorer.counts["dead"] == len(bad)


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``, with their state (``Z``: a zombie)."""
    out: dict[int, str] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid:
            out[int(d)] = state
    return out


@pytest.mark.parametrize(("reward", "answer"), [("misbehaving", "hang"), ("blocking", "block")])
def test_a_hung_reward_is_killed_and_the_scorer_keeps_beating_and_scoring(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path, reward: str,
        answer: str) -> None:
    """``hang``: a sync reward sleeping forever; ``block``: an async one calling
    ``time.sleep`` on its event loop. The hung group fails on each of its 4 deliveries (at
    least one hang, so one kill, each; two when it shares a read); the good groups are
    scored (the calls its blocked loop starved are run again), each exactly once,
    heartbeats never pause, and afterwards the scorer holds as many threads as before and
    one reward process, no zombie."""
    cfg = write_config(tmp_path / "run.toml", run_header(
        run_name, tmp_path / "out", redis_server.url, claim_idle_ms=300, block_ms=100,
        max_deliveries=4, heartbeat_s=0.2) + (
        f'[scoring]\nrewards = [{{fn = "{REWARDS}:{reward}"}}]\nreward_timeout_s = 1.0\n'))
    keys = Keys(run_name)
    r = redis.Redis.from_url(redis_server.url)
    log = tmp_path / "scorer.log"
    proc = spawn_role("score", cfg, name="s1", log=log)

    def beat() -> dict[str, Any] | None:
        raw = r.hget(keys.heartbeats("scorer"), "scorer/s1")
        return None if raw is None else __import__("json").loads(raw)

    try:
        wait_for(lambda: proc.poll() is not None or beat(), 120,
                 lambda: f"the scorer's first heartbeat: {log.read_text()[-2000:]}")
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(1.0)  # let start-up threads settle before the baseline
        threads0 = _threads(proc.pid)
        arun(_emit(redis_server.url, run_name,
                   [_group("0:1"), _group("0:2", answer), _group("0:3")]))
        max_gap_s = 0.0

        def settled() -> bool:
            nonlocal max_gap_s
            assert proc.poll() is None, f"scorer exited: {log.read_text()[-3000:]}"
            b = beat()
            gap_s = time.time() - b["t"] if b else 0.0
            max_gap_s = max(max_gap_s, gap_s)
            assert gap_s < 10, f"no heartbeat for {gap_s:.1f} s: the scorer's loop is blocked"
            return r.xlen(keys.scored) == 2 and r.xlen(keys.dlq) == 1

        wait_for(settled, 90, lambda: f"2 groups scored and 1 dead-lettered: {beat()} "
                                      f"{log.read_text()[-2000:]}")
        (_, dead), = r.xrange(keys.dlq)
        assert b"timed out after 1s" in dead[b"reason"], dead[b"reason"]
        time.sleep(0.5)  # the last kill's restart, if any, is under way
        threads1, children = _threads(proc.pid), _children(proc.pid)
        info0 = (beat() or {}).get("reward_restarts")
        assert threads1 <= threads0 + 2, f"threads {threads0} -> {threads1} after {info0} hangs"
        assert len(children) <= 1 and "Z" not in children.values(), children
        info = beat()
        assert info is not None and info["reward_errors"] == 4 and info["dead"] == 1
        assert info["reward_restarts"] >= 4, info
        assert max_gap_s < 5, f"a heartbeat gap of {max_gap_s:.1f} s"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        r.close()
    assert rc == 0, log.read_text()[-3000:]
    time.sleep(0.2)
    assert not [p for p in children if Path(f"/proc/{p}").exists()], "reward process left"
