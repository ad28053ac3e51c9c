"""User rewards outside the scorer run where a hang can be killed too: the evaluator's
reward calls and the start-up probe (`check_rewards`, run by `sluice up`, `sluice score`
and `sluice eval` before any role starts) go through a reward process
(`workers.reward_runner`), so an async reward that blocks its event loop
(``time.sleep`` inside ``async def``) costs a timeout, not the process.

Lean top-level imports: the reward process imports this module to load its rewards."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

BLOCK_S = 3600.0
PROBE_BLOCK_S = 90.0


async def blocks_on_samples(*, completions: list[Any], completion_ids: list[list[int]],
                            **kwargs: Any) -> list[float]:
    """Blocks its event loop on real completions (an ``async def`` calling
    ``time.sleep``: `asyncio.wait_for` cannot interrupt it); answers the start-up probe
    (two dummy completions without token ids) at once."""
    if any(completion_ids):
        time.sleep(BLOCK_S)
    return [0.0] * len(completions)


async def always_blocks(*, completions: list[Any], **kwargs: Any) -> list[float]:
    """Blocks its event loop on every call, the start-up probe's included (for
    `PROBE_BLOCK_S`: long enough to tell a timeout from waiting it out)."""
    time.sleep(PROBE_BLOCK_S)
    return [0.0] * len(completions)


def _children(pid: int, marker: str) -> list[int]:
    """Live processes whose parent is ``pid`` and whose command line holds ``marker``."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and marker in cmd and stat.rsplit(")", 1)[1].split()[0] != "Z":
            out.append(int(p.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_evaluator_survives_an_async_reward_that_blocks_its_event_loop(
        redis_server: Any, run_name: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """A real `sluice eval` whose eval reward blocks its event loop on every sampled
    completion: the reward process is killed after ``scoring.reward_timeout_s`` and
    replaced, the evaluation is skipped (counted), heartbeats keep coming, and SIGTERM
    ends the evaluator at once, its reward process with it. Before, the evaluator called
    its rewards in its own event loop, which froze for good."""
    import redis

    from pipeline.bus.keys import Keys
    from tests.helpers import run_header, spawn_role, wait_for, write_config

    cfg = write_config(tmp_path / "e.toml", run_header(
        run_name, tmp_path / "run", redis_server.url, heartbeat_s=0.3) + f"""
[model]
path = "{tiny_model_dir}"
[task]
heldout = 2
[generation]
max_new_tokens = 4
[scoring]
reward_timeout_s = 2.0
[eval]
rewards = [{{ fn = "{__name__}:blocks_on_samples" }}]
""")
    r = redis.Redis.from_url(redis_server.url)
    key = Keys(run_name).heartbeats("evaluator")
    log = tmp_path / "eval.log"
    ev = spawn_role("eval", cfg, log=log)

    def beat() -> dict[str, Any]:
        raws = list(r.hgetall(key).values())
        return json.loads(raws[0]) if raws else {}

    def tail() -> str:
        return f"heartbeat {beat()}\n{log.read_text()[-3000:] if log.exists() else ''}"

    try:
        wait_for(lambda: beat().get("reward_restarts", 0) >= 1, 120,
                 lambda: f"the hung reward process killed and replaced\n{tail()}")
        assert beat()["reward_errors"] >= 1, tail()
        # the evaluator's loop is free: its heartbeat keeps moving after the kill
        first = r.hgetall(key)
        wait_for(lambda: r.hgetall(key) != first, 30, lambda: f"a later heartbeat\n{tail()}")
        children = _children(ev.pid, "workers.reward_child")
        assert len(children) <= 1, children  # one reward process, never one per hang
        ev.send_signal(signal.SIGTERM)
        assert ev.wait(60) == 0, tail()
    finally:
        if ev.poll() is None:
            ev.kill()
            ev.wait(10)
    wait_for(lambda: not any(_alive(c) for c in children), 30,
             f"the reward processes {children} gone with the evaluator")
    lines = tmp_path / "run" / "eval.jsonl"
    assert not lines.exists() or not lines.read_text(), "a line from a failed evaluation"


def test_start_up_probe_of_a_blocking_async_reward_times_out(
        tmp_path: Path, run_name: str) -> None:
    """The probe `sluice up` / `sluice eval` run before any role (`check_rewards`, here
    through the evaluator's preflight) of an async reward that blocks its event loop
    fails after ``scoring.reward_timeout_s`` with the key named, instead of hanging the
    CLI (before: `asyncio.wait_for` in the CLI's own loop could not fire)."""
    from pipeline.config import ConfigError, load_config
    from workers import evaluator

    cfg = load_config(None, [f"run.name={run_name}", f"run.output_dir={tmp_path}",
                             "scoring.reward_timeout_s=1",
                             f"eval.rewards=[{{fn='{__name__}:always_blocks'}}]"])
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"eval.rewards.0.fn .*timed out after 1s"):
        evaluator.preflight(cfg, None, lambda: None, alone=False)
    assert time.monotonic() - t0 < PROBE_BLOCK_S / 2  # the timeout + a process's start
