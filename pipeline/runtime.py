"""What every role process shares: logging, the event loop, shutdown, heartbeats.

A role is an ``async def main(cfg, stop)``; `run_role` runs it under uvloop (when
installed) with SIGINT/SIGTERM setting ``stop`` — the role finishes or releases the work
it holds and returns, so nothing acknowledged is lost and nothing unacknowledged is
stranded (its pending entries are read again by the same consumer name, or reclaimed).
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from redis.exceptions import NoPermissionError

from pipeline.bus.client import Bus
from pipeline.bus.connection import (
    ClusterModeError,
    PartitionsError,
    check_cluster,
    check_partitions,
    sync_client,
)
from pipeline.bus.keys import Keys
from pipeline.bus.schema import Limits
from pipeline.bus.security import TLSFiles, client_options
from pipeline.bus.transient import TRANSIENT
from pipeline.config import Config, ConfigError
from pipeline.metrics import RoleMetrics

log = logging.getLogger("sluice")

FATAL_EXIT_CODE = 78
"""A role's exit status when it stopped on `RoleFatal` (sysexits' EX_CONFIG): `sluice up`
reports it at once and ends the run instead of restarting the role (`sluice.supervisor`)."""


class RoleFatal(RuntimeError):
    """A role found the run in a state no restart can fix (a prompt filter that rejects a
    whole epoch: every restart would find the same). The role stops, the CLI prints the
    message and exits `FATAL_EXIT_CODE`, and `sluice up` ends the run naming it."""


def setup_logging(role: str, level: str | None = None) -> None:
    logging.basicConfig(
        level=(level or os.environ.get("SLUICE_LOG_LEVEL", "INFO")).upper(),
        format=f"%(asctime)s {role}[%(process)d] %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def set_threads(n: int) -> None:
    """Pin torch's intra-op threads: roles share a few cores and oversubscription is the
    main way a CPU pipeline gets slow."""
    import torch

    torch.set_num_threads(n)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)


_process_role: str | None = None  # set by `run_role`; None in tests and tools


def run_role(main: Callable[[asyncio.Event], Awaitable[Any]], role: str) -> Any:
    """Run a role process. ``role`` is also its Redis identity: `connect` uses that
    role's credentials unless told otherwise.

    The event loop is uvloop when it is installed (a core dependency except on Windows),
    else asyncio's own; ``SLUICE_EVENT_LOOP=asyncio`` forces asyncio's (to rule the loop
    out when debugging; the fault tests run under both, `pipeline.bus.transient`)."""
    global _process_role
    _process_role = role
    setup_logging(role)
    dump_stacks_on(STACKS_SIGNAL)

    async def runner() -> Any:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop.set)
        try:
            return await main(stop)
        finally:
            bound_exit()

    before = {sig: signal.getsignal(sig) for sig in (*STOP_SIGNALS, END_SIGNAL) if sig}
    try:
        return event_loop_runner()(runner())
    finally:
        restore_signals(before)
        freeze_for_exit()


def freeze_for_exit() -> None:
    """Call once only this process's exit is left (a role once its loop has closed; `sluice
    up` once everything it started is stopped): collects what is garbage now (finalizers
    of unreachable objects run, their files close), then moves every survivor, all still
    reachable, into the permanent generation (`gc.freeze`). WHY: the interpreter's
    teardown runs full collections that walk every object the process holds; with torch
    and transformers loaded that took 1.4-2.2 s of CPU per process on a loaded 2-core
    machine (0.3-0.5 s frozen), at the end of every run, in every role at once. Objects
    still alive at exit get no finalizer guarantee from Python either way. Never in a
    process that goes on working (tests): frozen objects are never collected."""
    gc.collect()
    gc.freeze()


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""What asks a role to stop (`run_role`): while its loop runs, they set ``stop``."""


def restore_signals(before: dict[signal.Signals, Any]) -> None:
    """Put back the handlers `run_role` found, once the role's loop has closed, and detach
    the loop's wakeup fd. WHY: uvloop's ``remove_signal_handler`` does nothing after
    ``close()``, so its handler stayed installed and a role stalled in teardown (a
    thread that never ends, a slow atexit hook) ignored SIGTERM and could only be
    SIGKILLed; asyncio's loop restores them itself, so this is a no-op there."""
    for sig, handler in before.items():
        with contextlib.suppress(ValueError, OSError, TypeError):  # not the main thread
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)


END_SIGNAL = signal.SIGUSR2 if hasattr(signal, "SIGUSR2") else None
"""``kill -USR2 TRAINER_PID`` asks the trainer to end the run in order: finish the step in
hand, write its final checkpoint, announce `RunFinished` as at ``max_steps`` (so the
evaluator evaluates the final version and every role exits by itself). `sluice up` sends
it on ``run.max_time_s`` and on the first Ctrl-C. Other roles ignore it."""


def end_requests(stop: asyncio.Event) -> asyncio.Event:
    """An event set, with ``stop``, when this process gets `END_SIGNAL` (the caller tells
    an orderly end from a plain stop by it). Call from the role's running loop."""
    end = asyncio.Event()

    def ended() -> None:
        end.set()
        stop.set()

    if END_SIGNAL is not None:
        asyncio.get_running_loop().add_signal_handler(END_SIGNAL, ended)
    return end


STACKS_SIGNAL = signal.SIGUSR1 if hasattr(signal, "SIGUSR1") else None
"""``kill -USR1 PID`` makes a role write every thread's Python stack to its stderr (its
log under `sluice up`) and go on: how a role that hangs is diagnosed where it runs.
`sluice up` sends it to a role that outlives its stop grace period before killing it."""


STACK_DUMP_MARK = "(most recent call first):"
"""How every thread's section of a `faulthandler` dump begins (its first line ends so)."""

HANG_REPORT_MARK = "=== hang report"
"""How the first line of `sluice.hang_report.hang_report` begins (`sluice up` writes
it into a straggler's log before killing it)."""


def log_tail(text: str, lines: int = 30, most: int = 300) -> str:
    """The last ``lines`` lines of a role's log, reaching back (up to ``most`` lines) to
    the start of a stack dump or hang report when the tail is inside one
    (`STACKS_SIGNAL`, `bound_exit`, `HANG_REPORT_MARK`), so a report of a hung role shows
    where every thread was."""
    rows = text.splitlines()
    start = len(rows) - lines
    for i in range(max(0, len(rows) - most), len(rows)):
        if rows[i].endswith(STACK_DUMP_MARK) or rows[i].startswith(HANG_REPORT_MARK):
            start = min(start, i)
            break
    return "\n".join(rows[max(0, start):])


def dump_stacks_on(sig: signal.Signals | None) -> None:
    """Register `faulthandler`'s all-threads dump for ``sig`` (it runs in C, so it works
    while the main thread is blocked in a lock, a join or a C call). Not on Windows."""
    if sig is not None:
        with contextlib.suppress(ValueError, OSError, RuntimeError):  # no usable stderr
            faulthandler.register(sig, all_threads=True, chain=False)


EXIT_BOUND_S = 120.0
"""Once a role's work is over (its ``main`` returned or raised; the trainer from its
final checkpoint on), its process must be gone within this long: closing connections,
the event loop and the interpreter takes well under a second, a tracker's final upload
seconds. A process still alive then is hung (a thread that never ends, a lock never
released); it writes every thread's stack to its stderr and exits with status 1, so a
finished role never holds a node, a GPU or a job slot forever, and the log says where
it hung."""


def bound_exit(seconds: float | None = None) -> None:
    """In a role process (`run_role`): from now on, exit within ``seconds`` (default
    `EXIT_BOUND_S`) or dump the stacks and exit 1 (`faulthandler.dump_traceback_later`,
    whose timer thread needs neither the GIL-holding main thread nor the event loop).
    Nothing in tests or tools that run a role's code in their own process."""
    if _process_role is not None:
        faulthandler.dump_traceback_later(EXIT_BOUND_S if seconds is None else seconds,
                                          exit=True)


def event_loop_runner() -> Callable[[Awaitable[Any]], Any]:
    """``uvloop.run`` or ``asyncio.run``, as `run_role` documents (an ImportError raised
    by a role itself is the role's error, never a reason to run it again)."""
    choice = os.environ.get("SLUICE_EVENT_LOOP", "uvloop")
    if choice not in ("uvloop", "asyncio"):
        raise ConfigError(f"SLUICE_EVENT_LOOP={choice!r}: expected 'uvloop' or 'asyncio'")
    if choice == "uvloop":
        try:
            import uvloop
        except ImportError:
            return asyncio.run
        return uvloop.run
    return asyncio.run


def tls_files(cfg: Config) -> TLSFiles:
    return TLSFiles(cfg.bus.tls_ca_file, cfg.bus.tls_cert_file, cfg.bus.tls_key_file)


_checked: set[tuple[str, str, int]] = set()


def connect(cfg: Config, role: str | None = None) -> Bus:
    """The run's bus, logged in as ``role`` (default: this process's role, `run_role`):
    each role gets its own ACL user when credentials are configured (docs/security.md).
    Checked once per process, so a mistake is an error at start rather than a role
    retrying forever: with `bus.cluster` that every slot is served; and that
    `bus.partitions` is the run's (`check_partitions`; the trainer and generators record
    it before they write anything, so no admission precedes it)."""
    role = role or _process_role
    # the evaluator reads only `control`: it neither uses lanes nor may read `state`
    if role != "evaluator" and (cfg.redis_url, cfg.run.name, cfg.bus.partitions) not in _checked:
        opts = redis_options(cfg, role)
        try:
            if cfg.bus.cluster:
                check_cluster(cfg.redis_url, **opts)
            client = sync_client(cfg.redis_url, cluster=cfg.bus.cluster, **opts)
            try:
                check_partitions(client, Keys(cfg.run.name).state, cfg.bus.partitions,
                                 record=role in ("trainer", "generator"))
            finally:
                client.close()
            _checked.add((cfg.redis_url, cfg.run.name, cfg.bus.partitions))
        except TRANSIENT:
            pass  # Redis not up yet: the role's own retries wait for it; checked next call
        except NoPermissionError:
            pass  # an ACL user without `state` (a custom role): its own commands will tell
        except (ClusterModeError, PartitionsError) as e:
            raise ConfigError(str(e)) from e
    return Bus.connect(cfg.redis_url, cfg.run.name, reconnect_max_s=cfg.bus.reconnect_max_s,
                       role=role, credentials_file=cfg.bus.credentials_file,
                       tls=tls_files(cfg), cluster=cfg.bus.cluster,
                       partitions=cfg.bus.partitions)


@contextlib.asynccontextmanager
async def connected(cfg: Config, role: str | None = None) -> AsyncIterator[Bus]:
    """`connect` for the length of an ``async with`` block: the bus is closed however the
    block is left (a short-lived reader such as `sluice status` or an audit must not
    leave its connections open on an error)."""
    bus = connect(cfg, role)
    try:
        yield bus
    finally:
        await bus.close()


def redis_options(cfg: Config, role: str | None = None) -> dict[str, Any]:
    """``from_url`` keyword arguments for a plain (sync) redis-py client of ``role``,
    with the same credentials and TLS files as `connect`."""
    return client_options(cfg.redis_url, role=role or _process_role,
                          credentials_file=cfg.bus.credentials_file, tls=tls_files(cfg))


def model_vocab_size(model_path: str) -> int | None:
    """The model's vocabulary size from its config.json, without loading weights."""
    import json
    from pathlib import Path

    try:
        return int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def limits(cfg: Config) -> Limits:
    """Decode limits of this run: token ids must be < the model's vocabulary size."""
    vocab = model_vocab_size(cfg.model.path) or (1 << 31)
    return Limits(vocab_size=vocab, max_message_bytes=cfg.bus.max_message_bytes)


async def join(task: asyncio.Task[Any], timeout_s: float) -> None:
    """Wait for a task that was asked to stop (its ``stop`` event set); cancel it only if it
    overruns. Cancelling a Redis command half-way can leave its connection unusable, so
    loops are stopped by their events, not by cancellation."""
    try:
        await asyncio.wait_for(asyncio.shield(task), timeout_s)
    except TimeoutError:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    except Exception as e:
        log.debug("task ended with %s", e)


LEAVE_TIMEOUT_S = 10.0
"""The most a role waits on Redis while leaving (the final heartbeat, releasing a lock):
during an outage an unbounded call would keep a stopped or crashed role alive and
unseen by its supervisor's restart policy (`sluice up`, torchrun, Slurm, Kubernetes)."""


class Heartbeat:
    """Refreshes ``workers[role/id]`` every ``period_s`` with the role's counters; a
    failed write marks the role unhealthy but never stops it.

    With ``metrics`` (the role's `pipeline.metrics.RoleMetrics`), each beat also mirrors
    the counters into it and refreshes its bus gauges, the heartbeat carries the
    ``/metrics`` URL (``metrics``: `sluice status` lists it) and the p50 / p99 of the
    role's waits at each hop (``waits``: `RoleMetrics.wait_summary`), and `stop` closes the
    endpoint after the final beat: the heartbeat's life is the role's.

    `stop` never cancels a write in flight (a command cancelled half-way can leave a
    connection unusable): it signals the loop, which finishes its current beat and
    returns; then the final "exited" beat is written.
    """

    def __init__(self, bus: Bus, wid: str, period_s: float, info: Callable[[], dict[str, Any]],
                 metrics: RoleMetrics | None = None):
        self.bus, self.wid, self.period_s, self.info = bus, wid, period_s, info
        self.metrics = metrics
        self.started = time.time()
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    async def beat(self, **extra: Any) -> None:
        m = self.metrics
        waits = m.wait_summary() if m is not None else {}
        info = {"healthy": self.bus.healthy, "reconnects": self.bus.reconnects,
                "started": self.started, **({"metrics": m.url} if m and m.url else {}),
                **({"waits": waits} if waits else {}), **self.info(), **extra}
        try:
            await self.bus.heartbeat(self.wid, info)
        except Exception as e:
            self.bus.unavailable("heartbeat", e, "the next beat tries again")
        if m is not None:
            m.sync({**info, "healthy": self.bus.healthy})
            await m.refresh(self.bus)

    async def _loop(self) -> None:
        while not self._stopping.is_set():
            await self.beat()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.period_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self, forget: bool = False) -> None:
        self._stopping.set()
        if self._task:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, self.period_s + 10)
        with contextlib.suppress(Exception):  # bounded: see LEAVE_TIMEOUT_S
            if forget:
                await asyncio.wait_for(self.bus.forget_worker(self.wid), LEAVE_TIMEOUT_S)
            else:
                await asyncio.wait_for(self.beat(exited=True, healthy=False), LEAVE_TIMEOUT_S)
        if self.metrics is not None:  # shutdown() waits for the server's poll loop
            await asyncio.to_thread(self.metrics.close)
