"""The scorer's side of its reward process (`workers.reward_child`): user reward
functions run where a hang can be killed, so none can take the scorer down.

WHY a process: in the scorer's own process a sync reward that never returns can only be
abandoned (its thread runs on: one leaked thread per timeout, one more per group of the
per-group retry), and an async reward that blocks (``time.sleep`` in ``async def``)
freezes the event loop, so ``asyncio.wait_for`` never fires and heartbeats, reads and
hand-offs all stop. A child process is the smallest unit the scorer can kill.

Invariants:
- one child per scorer, started at the first call (the start-up probe) and again after
  each kill; it is started with fork+exec (``python -m workers.reward_child``, not a bare
  ``fork`` of a process running uvloop and threads) in its own session, loads the
  functions by import path (nothing pickled; the child gets the scorer's ``sys.path``) and
  dies with the scorer (``PR_SET_PDEATHSIG``);
- one request at a time (an ``asyncio.Lock``), and a request is a whole round: every
  function over every batch (`matrices`), so the per-group retry of a failed read is one
  IPC round trip too, its groups running concurrently in the child;
- the scorer enforces ``timeout_s`` per request, from the moment it is sent (the child's
  start-up is not charged to it); when a request is not fully answered in time, or the
  child dies, every unanswered (batch, function) is a ``RewardError`` and the child's
  process group is SIGKILLed by id, reaped, and counted in `restarts`: after N hangs the
  scorer holds one child, no zombie, no extra thread;
- the scorer's event loop only awaits a socket: user code never runs on it.

Cost, measured on a shared 2-core machine (load ~5) with a trivial sync reward
(`workers.tasks.rewards:format_reward`, eight completions per group): a read of 8 groups
took 0.12 ms per group here against 0.04 ms in-process (a thread per call) under
asyncio's loop, 0.17 against 0.07 ms under uvloop; a read of one group 0.6-0.7 against
0.2 ms. So about 0.4-0.5 ms per read (one msgpack round trip and the child's thread),
well under a millisecond per group, small beside any real reward; one path, no
in-process switch. A restart after a kill costs the child's start (~1 s plus the reward
modules' imports), not charged to any call's timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pipeline.config import Config
from workers.reward_child import frame, read_frame
from workers.tasks.catalog import Task
from workers.tasks.rewards import RewardError, RewardFn, load_rewards, probe_kwargs, probe_rewards

log = logging.getLogger("sluice.scorer")
START_TIMEOUT_S = 300.0  # the child imports the reward modules (a reward model: minutes)
CLOSE_GRACE_S = 2.0  # a child that does not leave after EOF is killed
NOT_SENT = ("trainer_state", "log_extra", "log_metric")  # the child supplies its own


class RewardRunner:
    """Calls reward functions in a child process the scorer can kill (module docstring).
    ``rewards`` must have import paths (`workers.tasks.rewards.load_reward`)."""

    def __init__(self, rewards: Sequence[RewardFn], timeout_s: float, *,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        for rf in rewards:
            if not rf.path:
                raise ValueError(f"reward {rf.name!r} has no import path; the reward "
                                 "process loads functions by path")
        self.rewards = list(rewards)
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.restarts = 0  # children killed (timeout) or lost (died), each then replaced
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock = asyncio.Lock()
        self._req = 0

    @property
    def pid(self) -> int | None:
        """The running child's pid, if any."""
        return self._proc.pid if self._proc is not None else None

    async def _start(self) -> None:
        """Start a child and wait for its ``ready`` (``RuntimeError`` when it cannot)."""
        mine, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "workers.reward_child", str(theirs.fileno()),
                str(os.getpid()), stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                start_new_session=True, env=env)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self._reader, self._writer = await asyncio.open_connection(sock=mine)
        self._writer.write(frame({"paths": [rf.path for rf in self.rewards]}))
        try:
            hello = await asyncio.wait_for(read_frame(self._reader), self.start_timeout_s)
        except (TimeoutError, asyncio.IncompleteReadError, OSError) as e:
            await self._kill()
            raise RuntimeError(f"the reward process did not start ({e!r})") from e
        if "fatal" in hello:
            await self._kill()
            raise RuntimeError(f"the reward process could not load: {hello['fatal']}")

    async def _kill(self) -> None:
        """SIGKILL the child's process group by id (its helpers too) and reap it."""
        proc, writer = self._proc, self._writer
        self._proc = self._reader = self._writer = None
        if writer is not None:
            writer.close()
        if proc is None:
            return
        if proc.returncode is None:  # not reaped: the id is still the child's
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 10)

    async def run(self, batches: Sequence[Mapping[str, Any]]
                  ) -> list[list[list[float | None] | RewardError]]:
        """Per batch (`workers.tasks.rewards.reward_kwargs`), per function: its validated
        values or its ``RewardError``; never raises for a reward's doing.

        One request, unless a call blocked the child's loop before others started: those
        never started (the child says when each starts) are not charged, they are sent
        again to the fresh child, for as long as each round settles something."""
        if not self.rewards:  # pure distillation: no process at all
            return [[] for _ in batches]
        out: list[list[list[float | None] | RewardError | None]] = [
            [None] * len(self.rewards) for _ in batches]
        todo = {b: list(range(len(self.rewards))) for b in range(len(batches))}
        async with self._lock:
            while todo:
                started: set[tuple[int, int]] = set()
                try:
                    payload = frame({"req": self._req + 1, "batches": [
                        {"kw": {k: v for k, v in batches[b].items() if k not in NOT_SENT},
                         "n": len(batches[b]["completions"]), "fns": fns}
                        for b, fns in todo.items()]})
                except (TypeError, ValueError, OverflowError) as e:
                    why = f"its inputs cannot be sent to the reward process ({e})"
                else:
                    why = await self._round(payload, list(todo), out, started)
                starved = {b: [f for f in fns if out[b][f] is None and (b, f) not in started]
                           for b, fns in todo.items()}
                starved = {b: fns for b, fns in starved.items() if fns}
                settled = any(out[b][f] is not None or (b, f) in started
                              for b, fns in todo.items() for f in fns)
                for b, fns in todo.items():  # started and never answered: charged
                    for f in fns:
                        if out[b][f] is None and (b not in starved or f not in starved[b]
                                                  or not settled):
                            out[b][f] = RewardError(self.rewards[f].name, why)
                todo = starved if settled else {}
        return out  # type: ignore[return-value]

    async def _round(self, payload: bytes, order: list[int],
                     out: list[list[list[float | None] | RewardError | None]],
                     started: set[tuple[int, int]]) -> str:
        """Send one request (its batches are ``order``'s, in that order) and fill ``out``
        and ``started`` from the answers until all are in or ``timeout_s`` passes; then,
        if any is missing, kill the child. Returns why a missing answer is missing."""
        why = f"timed out after {self.timeout_s:g}s"
        if self._proc is None:
            try:
                await self._start()
            except (RuntimeError, OSError) as e:
                return str(e)
        assert self._reader is not None and self._writer is not None
        self._req += 1
        missing = {(b, f) for b in order for f, v in enumerate(out[b]) if v is None}
        try:
            async with asyncio.timeout(self.timeout_s):
                self._writer.write(payload)
                await self._writer.drain()
                while missing:
                    msg = await read_frame(self._reader)
                    if msg.get("req") != self._req:
                        continue
                    key = (order[msg["b"]], msg["f"])
                    if msg.get("started"):
                        started.add(key)
                    elif key in missing:
                        missing.discard(key)
                        b, f = key
                        out[b][f] = msg["ok"] if "ok" in msg else RewardError(
                            self.rewards[f].name, msg["problem"], msg.get("detail"))
        except TimeoutError:
            pass
        except (asyncio.IncompleteReadError, OSError) as e:
            code = None
            if self._proc is not None:  # its exit code, if it comes promptly
                with contextlib.suppress(TimeoutError):
                    code = await asyncio.wait_for(self._proc.wait(), 1.0)
            why = f"the reward process died (exit code {code}, {type(e).__name__})"
        if missing:
            pid = self.pid
            await self._kill()
            self.restarts += 1
            log.warning("reward process %s killed and replaced (%d so far): %s", pid,
                        self.restarts, why)
        return why

    async def matrices(self, batches: Sequence[Mapping[str, Any]]
                       ) -> list[np.ndarray | RewardError]:
        """Per batch, its ``[n, F]`` float64 reward matrix (NaN where a function returned
        None) or the first failing function's ``RewardError``."""
        out: list[np.ndarray | RewardError] = []
        for kw, cols in zip(batches, await self.run(batches), strict=True):
            err = next((c for c in cols if isinstance(c, RewardError)), None)
            if err is not None:
                out.append(err)
                continue
            m = np.full((len(kw["completions"]), len(self.rewards)), np.nan, dtype=np.float64)
            for j, col in enumerate(cols):
                m[:, j] = [np.nan if v is None else v for v in col]  # type: ignore[union-attr]
            out.append(m)
        return out

    async def probe(self, prompt: Mapping[str, Any]) -> list[str | None]:
        """`workers.tasks.rewards.probe_reward` for every function, in the child: per
        function None, or its problem (a raised exception as ``"TypeError: msg"``)."""
        (cols,) = await self.run([probe_kwargs(prompt)])
        return [(c.detail or c.problem) if isinstance(c, RewardError) else None for c in cols]

    async def close(self) -> None:
        """Close the socket (the child leaves); kill it if it has not after
        `CLOSE_GRACE_S` (a hung reward)."""
        proc, writer = self._proc, self._writer
        if proc is None:
            return
        if writer is not None:
            writer.close()
        try:
            await asyncio.wait_for(proc.wait(), CLOSE_GRACE_S)
        except TimeoutError:
            pass
        await self._kill()


async def probe_in_child(cfg: Config, rewards: list[RewardFn], task: Task | None = None,
                         key: str = "scoring.rewards") -> None:
    """`workers.tasks.rewards.probe_rewards` in a reward process of its own, closed
    after: a probe that hangs, even an async reward blocking its event loop, costs
    ``scoring.reward_timeout_s`` and a killed child, never the caller."""
    runner = RewardRunner(rewards, cfg.scoring.reward_timeout_s)
    try:
        await probe_rewards(cfg, rewards, task, key, probe=runner.probe)
    finally:
        await runner.close()


def check_rewards(cfg: Config, task: Task | None = None, key: str = "scoring.rewards"
                  ) -> None:
    """What `sluice up`, `sluice score` and `sluice eval` run before starting any role:
    load every reward function under ``key`` and probe it once in a reward process
    (`probe_in_child`; building the task unless given); ``ConfigError`` / ``ValueError``
    naming the key. WHY a process: the probe runs in the CLI's own event loop, which an
    async reward calling ``time.sleep`` would freeze for good (``asyncio.wait_for``
    cannot fire), so `sluice up` would hang in its preflight."""
    asyncio.run(probe_in_child(cfg, load_rewards(cfg, key), task, key))
