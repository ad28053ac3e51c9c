"""A short real pipeline for fault injection: its own redis-server (AOF on, loopback,
free port), every role a real `sluice` process, faults by PID, and the history checker.

Each fault test builds a `Pipeline`, starts roles, waits for progress, injects its fault,
waits for recovery, stops everything with SIGTERM and then asserts `Pipeline.audit()`:
the whole ledger history checked against where Redis says the unfinished groups are.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from pipeline.bus.audit import AuditReport, audit, live_view, pending_intents
from pipeline.bus.client import Bus
from pipeline.bus.keys import Keys
from pipeline.bus.lanes import Lanes, add_states
from pipeline.bus.ledger import read_ledgers
from pipeline.ports import free_port
from sluice.embedded import EmbeddedCluster, EmbeddedRedis
from tests.helpers import run_header, spawn_role, wait_for

NUM_GENERATIONS = 4
GROUPS_PER_STEP = 4
# worker id prefix of each `sluice` subcommand: `workers[<prefix>/<name>]` is its heartbeat
ROLE_PREFIX = {"train": "trainer", "generate": "generator", "score": "scorer",
               "archive": "archiver"}

BUS = {"block_ms": 200, "claim_idle_ms": 1500, "heartbeat_s": 0.5, "reconnect_max_s": 1.0}
CONFIG = """
[model]
path = "{model}"
init = ""
[task]
name = "copy"
[generation]
num_generations = {n}
max_new_tokens = 6
batch_groups = 2
lease_s = 3
threads = 1
[scoring]
rewards = [{{ fn = "workers.tasks.rewards:copy_reward" }}]
[trainer]
groups_per_step = {g}
max_staleness = 1
lr = 1e-3
beta = 0.0
max_steps = 100000
save_steps = 5
threads = 1
"""


class Pipeline:
    """One run under test. Use as a context manager: every process it started (and its
    Redis) is ended by PID on exit, whatever the test did."""

    def __init__(self, tmp: Path, model: Path, run: str = "fault",
                 cluster: EmbeddedCluster | None = None, partitions: int = 1,
                 archive: dict[str, Any] | None = None):
        """Its own redis-server, or with ``cluster`` a run on that (shared) Redis Cluster
        in ``partitions`` lanes (the cluster outlives the pipeline: it is the session's).
        ``archive``: the run's ``[archive]`` table (``enabled = true`` added): every role
        runs with the archive's consumer group, and the audit demands every group in it."""
        self.tmp = tmp
        self.out = tmp / "out"
        self.cluster = cluster
        self.redis = None if cluster else EmbeddedRedis(tmp / "redis", port=free_port(),
                                                         appendonly=True)
        self.url = cluster.url if cluster else self.redis.url  # type: ignore[union-attr]
        self.keys = Keys(run)
        self.lanes = Lanes(self.keys, partitions)
        bus = {**BUS, **({"cluster": "true", "partitions": partitions} if cluster else {})}
        self.config = tmp / "run.toml"
        self.archive = archive is not None
        table = "" if archive is None else "[archive]\nenabled = true\n" + "".join(
            f"{k} = {json.dumps(v)}\n" for k, v in archive.items())
        self.config.write_text(
            run_header(run, self.out, self.url, **bus)
            + CONFIG.format(model=model, n=NUM_GENERATIONS, g=GROUPS_PER_STEP) + table)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.roles: dict[str, str] = {}  # name -> sluice subcommand
        self.ended: set[str] = set()  # roles the test itself stopped or killed
        self.faults = 0

    def __enter__(self) -> Pipeline:
        if self.redis is not None:
            self.redis.start()
            self.r: Any = redis.Redis.from_url(self.url, socket_timeout=10)
        else:
            self.r = redis.RedisCluster.from_url(self.url, socket_timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        self.r.close()
        if self.redis is not None:
            self.redis.stop()

    # ------------------------------------------------------------------ processes

    def start(self, role: str, name: str, *overrides: str) -> subprocess.Popen[bytes]:
        """Start ``sluice ROLE`` as ``name`` (logs in tmp/logs/NAME.log)."""
        (self.tmp / "logs").mkdir(exist_ok=True)
        p = spawn_role(role, self.config, *overrides, name=name,
                       log=self.tmp / "logs" / f"{name}.log")
        self.procs[name], self.roles[name] = p, role
        self.ended.discard(name)
        return p

    def kill9(self, name: str) -> None:
        p = self.procs[name]
        self.ended.add(name)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        self.faults += 1

    def expect_exit(self, name: str) -> None:
        """``name`` is meant to exit on its own (e.g. a role refused at start): not a crash."""
        self.ended.add(name)

    def crashed(self) -> dict[str, int]:
        """Roles whose process ended although the test did not end it (`kill9`, `stop`,
        `expect_exit`): name -> exit code."""
        return {n: p.returncode for n, p in self.procs.items()
                if n not in self.ended and p.poll() is not None}

    def check_alive(self, during: str) -> None:
        """Fail naming every role that crashed, with its exit code and the tail of its
        log (its traceback), so a crash reads as a crash, not as a condition that never
        came."""
        crashed = self.crashed()
        if crashed:
            raise AssertionError(
                f"{', '.join(f'{n} exited with code {c}' for n, c in crashed.items())} "
                f"{during}:\n" + "\n".join(self.log(n) for n in crashed))

    def wait(self, pred: Callable[[], Any], timeout_s: float, what: str | Callable[[], str],
             interval_s: float = 0.1) -> Any:
        """`tests.helpers.wait_for`, checking at every poll that no role crashed."""
        def alive_and(pred: Callable[[], Any] = pred) -> Any:
            self.check_alive("while the test waited for "
                             + (what if isinstance(what, str) else "its condition"))
            return pred()

        return wait_for(alive_and, timeout_s, what, interval_s)

    def stop(self, name: str, timeout_s: float = 60) -> int:
        """SIGTERM and wait; returns the exit code (0 = a clean stop)."""
        p = self.procs[name]
        self.ended.add(name)
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            return p.wait(timeout_s)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"{name} did not stop in {timeout_s} s:\n{self.log(name)}") from e

    def stop_all(self) -> dict[str, int]:
        """Generators first (they finish and append what they hold), then scorers, then
        the trainer, then the archiver (it writes what it holds); every exit code must be
        0 (or already dead by our hand)."""
        codes = {}
        for role in ("generate", "score", "train", "archive"):
            for name in [n for n, r in self.roles.items() if r == role]:
                if self.procs[name].poll() is None:
                    codes[name] = self.stop(name)
        bad = {n: c for n, c in codes.items() if c != 0}
        assert not bad, f"roles exited badly {bad}:\n" + "\n".join(self.log(n) for n in bad)
        running = [n for n, p in self.procs.items() if p.poll() is None]
        assert not running, f"still running after stop_all: {running}"
        return codes

    def stop_redis(self) -> None:
        """SHUTDOWN the run's Redis (every node of its cluster): AOF flushed, nothing
        acknowledged lost. A cluster must be the pipeline's own, with AOF."""
        if self.redis is not None:
            self.redis.stop()
        else:
            assert self.cluster is not None
            self.cluster.stop()

    def start_redis(self) -> None:
        """Start it again (a cluster's nodes rejoin from nodes.conf) and reconnect."""
        if self.redis is not None:
            self.redis.start()
            return
        assert self.cluster is not None
        self.cluster.start()
        self.r.close()
        self.r = redis.RedisCluster.from_url(self.url, socket_timeout=10)

    def group_names(self, stream: str) -> set[bytes]:
        """Consumer groups of ``stream`` (short name) in any lane."""
        return {g["name"] for key in self.lanes.streams(stream) if self.r.exists(key)
                for g in self.r.xinfo_groups(key)}

    def log(self, name: str) -> str:
        """The tail of ``name``'s log, for failure messages."""
        return f"--- {name}\n" + (self.text(name)[-3000:] or "(no log)")

    def text(self, name: str) -> str:
        """``name``'s whole log, for assertions on what it says (a tail can lose an early
        line under a burst of later ones)."""
        path = self.tmp / "logs" / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def logs(self) -> str:
        return "\n".join(self.log(n) for n in self.procs)

    # ------------------------------------------------------------------ observing

    def state(self) -> dict[str, int]:
        """The run's state, its lanes' counters added up."""
        def read(key: str) -> dict[str, int]:
            return {k.decode(): int(v) for k, v in self.r.hgetall(key).items()}

        return add_states(read(self.keys.state), [read(k.state) for k in self.lanes.keys])

    def lease_deadlines(self) -> dict[int, int]:
        """Every lane's leases: global cursor -> deadline (ms, Redis time)."""
        out = {}
        for lane, k in enumerate(self.lanes.keys):
            for c, v in self.r.hgetall(k.leases).items():
                out[self.lanes.join(lane, int(c))] = int(v.rsplit(b"|", 1)[1])
        return out

    def worker(self, prefix: str) -> dict[str, Any]:
        for wid, raw in self.r.hgetall(self.keys.heartbeat_key(prefix)).items():
            if wid.decode().startswith(prefix):
                return dict(json.loads(raw))
        return {}

    def trained(self) -> int:
        return self.state().get("retired:trained", 0)

    def wait_trained(self, at_least: int, timeout_s: float = 120) -> None:
        self.wait(lambda: self.trained() >= at_least, timeout_s,
                  lambda: f"{at_least} trained groups (have {self.trained()})\n{self.logs()}",
                  0.2)

    def pending_ids(self, stream: str, group: str, consumer: str | None = None) -> set[bytes]:
        """Ids of the entries pending in ``group`` of stream ``stream`` (a short name:
        ``rollouts``, ``scored``) in every lane, as ``lane-index:id`` (on ``consumer``
        only, if given)."""
        by = {"consumername": consumer} if consumer else {}
        return {f"{i}:{e['message_id'].decode()}".encode()
                for i, key in enumerate(self.lanes.streams(stream))
                for e in self.r.xpending_range(key, group, min="-", max="+", count=100_000,
                                               **by)}

    def pending_on(self, stream: str, group: str, consumer: str) -> int:
        """How many entries of ``stream`` (short name, every lane) ``consumer`` holds."""
        n = 0
        for key in self.lanes.streams(stream):
            if not self.r.exists(key):
                continue
            for c in self.r.xinfo_consumers(key, group):
                if c["name"].decode() == consumer:
                    n += int(c["pending"])
        return n

    def lease_owners(self) -> dict[int, str]:
        """Every lane's leases: global cursor -> owner."""
        out = {}
        for lane, k in enumerate(self.lanes.keys):
            for c, v in self.r.hgetall(k.leases).items():
                out[self.lanes.join(lane, int(c))] = v.decode().rsplit("|", 1)[0]
        return out

    def control_length(self) -> int:
        return int(self.r.xlen(self.keys.control))

    def length(self, stream: str) -> int:
        """XLEN of ``stream`` (short name) summed over the lanes."""
        return sum(int(self.r.xlen(k)) for k in self.lanes.streams(stream))

    def group(self, stream: str, group: str) -> dict[str, Any]:
        """``group`` of ``stream`` over every lane: pending summed, and whether any lane
        has entries never delivered to it."""
        pending, undelivered = 0, False
        for key in self.lanes.streams(stream):
            if not self.r.exists(key):
                continue
            g = next(g for g in self.r.xinfo_groups(key) if g["name"].decode() == group)
            pending += int(g["pending"])
            undelivered |= g["last-delivered-id"] != \
                self.r.xinfo_stream(key)["last-generated-id"]
        return {"pending": pending, "undelivered": undelivered}

    def consumers(self, stream: str, group: str) -> set[str]:
        """Names of ``group``'s consumers in any lane of ``stream``."""
        return {c["name"].decode() for key in self.lanes.streams(stream)
                if self.r.exists(key) for c in self.r.xinfo_consumers(key, group)}

    def memory_bytes(self) -> int:
        """Redis memory in use (every master's, on a cluster)."""
        if self.redis is not None:
            return int(self.r.info("memory")["used_memory"])
        return sum(int(self.r.info("memory", target_nodes=node)["used_memory"])
                   for node in self.r.get_primaries())

    def wait_up(self, names: dict[str, float], timeout_s: float = 120) -> None:
        """Wait until each role ``name`` started at ``names[name]`` (``time.time()``) has
        written a heartbeat of that incarnation: it is past its imports and handles
        SIGTERM (a role stopped while still importing dies by the signal, not cleanly)."""
        wids = {n: f"{ROLE_PREFIX[self.roles[n]]}/{n}" for n in names}

        def started(n: str) -> float:
            raw = self.r.hget(self.keys.heartbeat_key(wids[n]), wids[n])
            return float(json.loads(raw).get("started", 0)) if raw else 0.0

        self.wait(lambda: all(started(n) >= t for n, t in names.items()), timeout_s,
                  lambda: (f"{sorted(n for n, t in names.items() if started(n) < t)} to "
                           f"start (a heartbeat of the restarted process)\n{self.logs()}"),
                  0.2)

    def audit(self, **kw: Any) -> AuditReport:
        async def view() -> Any:
            bus = Bus.connect(self.url, self.keys.run, cluster=self.cluster is not None,
                              partitions=self.lanes.partitions)
            try:
                return await live_view(bus, pending_intents(rows))
            finally:
                await bus.close()

        rows = read_ledgers(self.out)
        report = audit(self.out, live=asyncio.run(view()), num_generations=NUM_GENERATIONS,
                       rows=rows, **{"archive": self.archive, **kw})
        print(f"[fault check] {self.faults} faults injected: {report.summary()}")
        return report

    def assert_clean(self, min_trained: int) -> AuditReport:
        """The audit passes, enough was trained, and (every role stopped) no admitted
        group is left leased: each one was appended, or abandoned as dead."""
        report = self.audit()
        assert report.ok, f"{report.summary()}\n{self.logs()}"
        assert not self.lease_deadlines(), "groups stuck in stopped generators"
        assert report.trained >= min_trained, report.summary()
        return report

