"""The children of `sluice up`: starting each role as its own OS process, restarting
one that crashed, and stopping them all.

Each child is ``python -m sluice.cli ROLE CONFIG --name NAME`` (the trainer with
``up.trainer_ranks`` > 1: one torchrun job), logging to ``<output_dir>/logs/NAME.log``,
logged in to Redis as its own role only (`sluice.up_credentials`), with its own
``/metrics`` port chosen at each (re)start.

Crashes: a role that exits abnormally (an error, ``kill -9``) is reported at once with
the tail of its log and restarted after a backoff (`sluice.restarts`; the pipeline
survives the crash: leases, reclaim, the trainer's checkpoint); one that crashes more than
``up.max_restarts`` times within ``up.restart_window_s`` is handed back to the caller,
which ends the run naming it.

Stopping (`Supervisor.terminate`): every child gets SIGTERM (by PID; a torchrun job's
ranks get it, not torchrun), finishes or releases its work and exits; stragglers are
asked for their threads' stacks (SIGUSR1, into their logs), get a hang report appended
(`record_hang`) and get SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.bus.security import COMMAND_ROLES
from pipeline.config import Config
from pipeline.ports import free_port
from pipeline.runtime import FATAL_EXIT_CODE, STACKS_SIGNAL, log_tail, redis_options
from sluice.hang_report import hang_report
from sluice.restarts import RestartPolicy
from sluice.samples import ScorerSamples
from sluice.up_credentials import role_credentials_override, role_env
from sluice.vllm_placement import split_servers, urls_override

STACKS_WAIT_S = 2.0  # for a role to write its stacks before it is killed
TAIL_REACH_LINES = 800  # how far a failure report reaches back for a dump's start: its
# Python stacks and the hang report (native stacks capped at NATIVE_MAX_LINES) together


@dataclass
class Child:
    """One started role: its process (a torchrun job for a multi-rank trainer), its log,
    and what `Supervisor.respawn` needs to start it again the same way."""

    role: str
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    spawned: float = field(default_factory=time.time)
    threads: int = 1
    extra: list[str] = field(default_factory=list)
    restart_at: float | None = None  # crashed: restart at this time (time.time())

    def tail(self, n: int = 30) -> str:
        """The end of the role's log, from the start of its last stack dump or hang
        report (`record_hang`) when it ends inside one."""
        try:
            return log_tail(self.log.read_text(errors="replace"), n, most=TAIL_REACH_LINES)
        except OSError:
            return ""


@dataclass
class Supervisor:
    """The children of one `sluice up`. ``children[0]`` is always the trainer (it is
    started first, and a restart keeps it in its place), which `sluice.up` relies on
    to see the run finish."""

    cfg: Config
    config_path: str
    overrides: list[str]
    eval_every_s: float | None = None  # None: eval.every_s
    children: list[Child] = field(default_factory=list)
    t0: float = field(default_factory=time.time)
    samples: ScorerSamples = field(init=False)

    def __post_init__(self) -> None:
        self.samples = ScorerSamples(self.t0)

    def spawn(self, role: str, name: str, threads: int, extra: list[str] | None = None
              ) -> Child:
        out = self.cfg.output_path
        (out / "logs").mkdir(parents=True, exist_ok=True)
        log = out / "logs" / f"{name}.log"
        args = [sys.executable, "-m", "sluice.cli", role, self.config_path]
        if role == "train" and self.cfg.up.trainer_ranks > 1:  # one torchrun job
            args = [sys.executable, "-m", "torch.distributed.run",
                    "--nproc_per_node", str(self.cfg.up.trainer_ranks),
                    "--max-restarts", str(self.cfg.up.trainer_restarts),
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                    "-m", "sluice.cli", "train", self.config_path]
        # its own /metrics port (up.metrics), fresh on every start: a restarted role never
        # waits for its old port, and one taken since `free_port` fails only that start
        port = free_port() if self.cfg.up.metrics else 0
        # each child logs in as its own role (pipeline.bus.security): it is pointed at a file
        # of its own role's credentials only, and inherits no other role's password or the
        # every-role credentials file from the environment (sluice.up_credentials)
        own = role_credentials_override(self.cfg, COMMAND_ROLES[role])
        for o in [*self.overrides, f"bus.redis_url={self.cfg.redis_url}", f"metrics.port={port}",
                  *own]:
            args += ["--set", o]
        args += ["--name", name, *(extra or [])]
        env = {**role_env(os.environ, COMMAND_ROLES[role]),
               "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
               "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
               "PYTHONUNBUFFERED": "1"}
        spawned = time.time()
        with open(log, "ab") as f:
            proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        child = Child(role, name, proc, log, spawned, threads, list(extra or []))
        self.children.append(child)
        return child

    def respawn(self, old: Child) -> Child:
        """Start ``old``'s role again under its name (same arguments, same log file,
        appended), in its place in `children` (the trainer stays first)."""
        i = self.children.index(old)
        new = self.spawn(old.role, old.name, old.threads, old.extra)
        self.children[i] = self.children.pop()
        return new

    def handle_crashes(self, policy: RestartPolicy) -> Child | None:
        """Restart crashed roles (`sluice.restarts`): a crash is reported at once on
        stderr with the role's log tail, and the role is started again after its backoff.
        Returns the child to stop the run for (crashed once too often, or stopped on an
        error no restart can fix: exit status `FATAL_EXIT_CODE`, reported at once), else
        None."""
        now = time.time()
        for ch in list(self.children):
            rc = ch.proc.poll()
            if rc in (None, 0):
                continue
            if rc == FATAL_EXIT_CODE and ch.restart_at is None:
                print(f"\n{ch.name} stopped on an error no restart can fix (exit code {rc}); "
                      f"the run ends. Last lines of {ch.log}:\n{ch.tail(12)}\n",
                      file=sys.stderr, flush=True)
                return ch
            if ch.restart_at is None:
                delay = policy.on_crash(ch.name, now)
                if delay is None:
                    return ch
                ch.restart_at = now + delay
                print(f"\n{ch.name} exited with code {rc}; restarting it in {delay:g} s "
                      f"(crash {policy.count(ch.name)} of at most {policy.max_restarts + 1} "
                      f"in {policy.window_s:g} s). Last lines of {ch.log}:\n{ch.tail(12)}\n",
                      file=sys.stderr, flush=True)
            elif now >= ch.restart_at:
                self.respawn(ch)
        return None

    def start_roles(self, trainer_ready_s: float = 300.0, vllm_urls: list[str] | None = None,
                    eval_urls: list[str] | None = None) -> None:
        """Trainer first; the others once it heartbeats (it has then created the groups,
        announced its weights and cleared an old end-of-run marker)."""
        c = self.cfg
        self.spawn("train", "trainer-0", c.trainer.threads, urls_override(vllm_urls or []))
        self.wait_for_trainer(trainer_ready_s)
        if c.archive.enabled:  # the trainer created its group: nothing is trimmed unarchived
            self.spawn("archive", "archiver-0", 1)
        for i in range(c.up.scorers):
            self.spawn("score", f"scorer-{i}", 1)
        for i in range(c.up.generators):
            mine = split_servers(vllm_urls, c.up.generators)[i] if vllm_urls else []
            extra = urls_override(mine)
            self.spawn("generate", f"generator-{i}", c.generation.threads, extra)
        every = [] if self.eval_every_s is None else ["--every", str(self.eval_every_s)]
        if eval_urls:
            every += ["--set", f"eval.vllm_urls={json.dumps(eval_urls)}"]
        self.spawn("eval", "evaluator", 1, every)

    def wait_for_trainer(self, timeout_s: float) -> None:
        from pipeline.bus.connection import sync_client
        from pipeline.bus.keys import Keys

        client = sync_client(self.cfg.redis_url, cluster=self.cfg.bus.cluster,
                             **redis_options(self.cfg, "monitor"))
        key = Keys(self.cfg.run.name).heartbeats("trainer")
        deadline = time.time() + timeout_s
        trainer = self.children[0]
        spawned = trainer.spawned

        def ready() -> bool:  # a heartbeat from THIS trainer (its rank 0), not an old one
            raw = client.hget(key, "trainer/trainer-0")
            return raw is not None and json.loads(raw).get("started", 0) >= spawned

        try:
            while not ready():
                if trainer.proc.poll() is not None:
                    raise RuntimeError(f"the trainer exited with {trainer.proc.returncode} "
                                       f"before it was ready:\n{trainer.tail()}")
                if time.time() > deadline:
                    raise TimeoutError(f"the trainer was not ready within {timeout_s} s")
                time.sleep(0.2)
        finally:
            client.close()

    def terminate(self, grace_s: float = 20.0) -> None:
        """SIGTERM every running child; one still running ``grace_s`` later is asked for
        its threads' stacks (`pipeline.runtime.STACKS_SIGNAL`, into its log), gets what
        ``/proc`` and a native-stack tool say of its threads appended to its log
        (`record_hang`), and is then killed; the failure report's tail shows both."""
        for ch in self.children:
            if ch.proc.poll() is None:
                stop_gracefully(ch.proc)
        deadline = time.time() + grace_s
        for ch in self.children:
            try:
                ch.proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                print(f"{ch.name} did not stop within {grace_s:g} s of SIGTERM; its "
                      f"threads' stacks go to {ch.log}; killing it", file=sys.stderr)
                signal_role(ch.proc, STACKS_SIGNAL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    ch.proc.wait(STACKS_WAIT_S)  # the dump itself never exits the role
                if ch.proc.poll() is None:
                    record_hang(ch)
                ch.proc.kill()
                ch.proc.wait()


def record_hang(ch: Child) -> None:
    """Append `sluice.hang_report.hang_report` of a straggler (each rank of a
    torchrun job too) to its log, while it still hangs: thread names, states, kernel
    waits and system calls, and native stacks where a tool can attach (bounded). Best
    effort: a report that cannot be written is skipped, the kill goes on."""
    try:
        with open(ch.log, "a", errors="replace") as f:
            for pid in dict.fromkeys([ch.proc.pid, *role_pids(ch.proc)]):
                f.write("\n" + hang_report(pid) + "\n")
    except OSError as e:
        print(f"{ch.name}: could not write its hang report to {ch.log}: {e}",
              file=sys.stderr)


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux ``/proc``; empty elsewhere)."""
    out = []
    for d in Path("/proc").glob("[0-9]*"):
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(d.name))
    return sorted(out)


def stop_gracefully(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM a role. A torchrun job (the trainer with ``up.trainer_ranks`` > 1) gets it
    on its ranks, not on torchrun: rank 0 then stops every rank, writes the final
    checkpoint, and torchrun exits 0 with them (torchrun itself answers SIGTERM by
    exiting with an error although its ranks stopped cleanly)."""
    signal_role(proc, signal.SIGTERM)


def signal_role(proc: subprocess.Popen[bytes], sig: signal.Signals | None) -> None:
    """Send ``sig`` to a role's process, or to each rank of a torchrun job."""
    if sig is None:
        return
    for pid in role_pids(proc):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def role_pids(proc: subprocess.Popen[bytes]) -> list[int]:
    """The process a role runs in: its own, or each rank's of a torchrun job."""
    is_job = "torch.distributed.run" in " ".join(map(str, proc.args))  # type: ignore[arg-type]
    return (child_pids(proc.pid) if is_job else []) or [proc.pid]
