"""`sluice up`: every role as its own OS process on one machine, plus a live view.

Order: embedded Redis (unless ``bus.redis_url`` is set) → local vLLM servers (engine
``vllm`` with ``generation.vllm.launch`` > 0; each generator gets its share of their
URLs) → trainer (publishes v0 and creates the consumer groups) → the archiver (with
``archive.enabled``) → scorers → generators → evaluator. The servers are stopped by PID
after every role has exited, all at once (`stop_all`), while the summary and the audit
run. Roles talk only through Redis; this supervisor only starts
them, reads heartbeats and state, and stops them.
With ``up.metrics`` (the default) each role serves Prometheus ``/metrics`` on a free
loopback port chosen at each (re)start (`pipeline.metrics`; `sluice status` lists them).

Crashes: a role that exits abnormally (an error, ``kill -9``) is reported at once with
the tail of its log and restarted after a backoff (`sluice.restarts`; the pipeline
survives the crash: leases, reclaim, the trainer's checkpoint); one that crashes more than
``up.max_restarts`` times within ``up.restart_window_s`` ends the run, named.

Shutdown: the trainer ends the run at ``max_steps`` with a `RunFinished` announcement,
on which every other role exits by itself. On Ctrl-C, ``max_time_s``, or a role given up
on, every child gets SIGTERM (by PID), finishes or releases its work and exits;
stragglers are asked for their threads' stacks (SIGUSR1, into their logs) and get SIGKILL
after a grace period; a trainer still running `EXIT_AFTER_FINISH_S` after it announced
the end is such a straggler. A failed role is reported with the tail of its log (a whole
stack dump when there is one), never hidden behind a pipeline that looks healthy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.bus import control
from pipeline.bus.security import COMMAND_ROLES
from pipeline.config import Config, ConfigError
from pipeline.evaluation import parse_target
from pipeline.ports import free_port
from pipeline.runtime import STACKS_SIGNAL, connect, freeze_for_exit, log_tail, redis_options
from sluice.embedded import EmbeddedRedis
from sluice.hang_report import hang_report
from sluice.monitor import snapshot
from sluice.restarts import RestartPolicy
from sluice.samples import ScorerSamples
from sluice.up_credentials import role_credentials_override, role_env
from sluice.up_servers import launches_eval_server, split_servers, urls_override, vllm_specs
from sluice.vllm_server import LocalServer, ServerSpec, launch, stop_all

STACKS_WAIT_S = 2.0  # for a role to write its stacks before it is killed
TAIL_REACH_LINES = 800  # how far a failure report reaches back for a dump's start: its
# Python stacks and the hang report (native stacks capped at NATIVE_MAX_LINES) together
EXIT_AFTER_FINISH_S = 60.0
"""How long the supervisor waits for the trainer to exit once it has announced the end
of the run (after its final checkpoint: only closing connections, the ledger and the
trackers is left). A trainer still running then is stopped like any straggler (SIGTERM,
its stacks, SIGKILL) and reported as failed: a hang at exit is a bug to see in seconds,
not a run that sits at its last step until ``max_time_s``."""


@dataclass
class Child:
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
        Returns the child to stop the run for (crashed once too often), else None."""
        now = time.time()
        for ch in list(self.children):
            rc = ch.proc.poll()
            if rc in (None, 0):
                continue
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


def status_line(sup: Supervisor, snap: dict[str, Any]) -> dict[str, Any]:
    tr = next((w for wid, w in snap["workers"].items() if wid.startswith("trainer/")), {})
    ev = next((w for wid, w in snap["workers"].items() if wid.startswith("evaluator/")), {})
    last = tr.get("last", {})
    reward, exact = sup.samples.recent()
    c = snap["conservation"]
    window = sup.cfg.trainer.window
    elapsed = max(time.time() - sup.t0, 1e-9)
    groups = c["cursor"] - c["generating"]
    scorers = [w for wid, w in snap["workers"].items() if wid.startswith("scorer/")]
    return {
        "reward_errors": sum(int(w.get("reward_errors", 0)) for w in scorers),
        "dlq": int(snap["lengths"].get("dlq") or 0),
        "step": tr.get("step", 0), "max_steps": sup.cfg.trainer.max_steps,
        "reward": reward,
        "exact": exact if any("exact_match" in w.get("part_sums", {}) for w in scorers)
        else None,  # sampled exact match, when the run records an exact_match reward
        "eval": ev.get("last", {}),
        "staleness": last.get("staleness_mean"), "groups_per_s": groups / elapsed,
        "gate": "open" if c["cursor"] - c["retired"] < window else "closed",
        "balanced": c["balanced"], "version": snap["state"].get("version", 0),
    }


async def finished_announced(bus: Any) -> bool:
    """Whether the control stream's newest entries carry the trainer's `RunFinished` (it
    is the trainer's last word; False when Redis does not answer: the next poll asks)."""
    try:
        return await control.finished(bus, scan=20) is not None
    except Exception:
        return False


def fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


async def supervise(sup: Supervisor, stop: asyncio.Event) -> str:
    """Watch the run until it ends; returns why it ended."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    cfg = sup.cfg
    bus = connect(cfg, role="monitor")
    console = Console(stderr=True)
    live = console.is_terminal
    progress = Progress(TextColumn("[bold]sluice[/]"), BarColumn(), TextColumn("{task.fields[s]}"),
                        TimeElapsedColumn(), console=console, disable=not live)
    task = progress.add_task("train", total=cfg.trainer.max_steps, s="starting")
    last_print = 0.0
    reason = "finished"
    u = cfg.up
    policy = RestartPolicy(max_restarts=u.max_restarts, window_s=u.restart_window_s)
    target = parse_target(cfg.up.stop_at)
    shown = target.metric if target else "pass@1"  # the eval metric on the progress line
    finished_at: float | None = None  # when the trainer's RunFinished was first seen
    with progress:
        while True:
            if stop.is_set():
                reason = "interrupted"
                break
            if cfg.run.max_time_s and time.time() - sup.t0 > cfg.run.max_time_s:
                reason = "max_time_s"
                break
            bad = sup.handle_crashes(policy)
            if bad is not None:
                reason = (f"{bad.name} exited with code {bad.proc.returncode}"
                          + (f" ({policy.count(bad.name)} crashes in "
                             f"{policy.window_s:g} s)" if policy.max_restarts else ""))
                break
            if sup.children[0].proc.poll() == 0:  # the trainer finished the run
                break
            if finished_at is not None and time.time() - finished_at > EXIT_AFTER_FINISH_S:
                print(f"sluice: the trainer announced the end of the run but has not exited "
                      f"{EXIT_AFTER_FINISH_S:g} s later; stopping it", file=sys.stderr)
                break
            try:
                snap = await snapshot(bus)
            except Exception:
                await asyncio.sleep(0.5)
                continue
            sup.samples.record(snap)
            if finished_at is None and await finished_announced(bus):
                finished_at = time.time()
            s = status_line(sup, snap)
            if target is not None and target.met(s["eval"]):
                reason = f"stop_at {target} reached"
                break
            text = (f"step {s['step']}/{s['max_steps']}  reward {fmt(s['reward'])}  "
                    + (f"exact {fmt(s['exact'])}  " if s["exact"] is not None else "")
                    + f"eval {shown} {fmt(s['eval'].get(shown))}  "
                    f"stale {fmt(s['staleness'], '.2f')}  {s['groups_per_s']:.1f} groups/s  "
                    f"gate {s['gate']}"
                    + (f"  reward errors {s['reward_errors']}" if s["reward_errors"] else "")
                    + (f"  dlq {s['dlq']}" if s["dlq"] else ""))
            progress.update(task, completed=s["step"], s=text)
            if not live and time.time() - last_print > 10:
                last_print = time.time()
                print(f"[{time.time() - sup.t0:6.0f}s] {text}", file=sys.stderr, flush=True)
            await asyncio.sleep(0.5)
    await bus.close()
    return reason


def ensure_model(cfg: Config) -> None:
    """Build the tiny model in the folder ``model.path`` when it is missing and
    ``model.init`` names one; a hub id is never built (`pipeline.hub` fetches it), and a
    missing folder without ``model.init`` is left to `pipeline.hub.resolve_model`, whose
    error names ``model.path``."""
    from pipeline.hub import is_hub_id

    path = Path(cfg.model.path)
    if is_hub_id(cfg.model.path) or (path / "config.json").exists() or not cfg.model.init:
        return
    from pipeline.model import init_tiny_model

    print(f"building the tiny model {cfg.model.init} in {path}", file=sys.stderr)
    init_tiny_model(path, seed=cfg.run.seed)


def prepare(cfg: Config, *, fresh: bool = False, allow_config_change: bool = False
            ) -> Config:
    """Before any role starts: ``--fresh`` (only on a sluice run directory or an empty
    one, `pipeline.rundir.check_fresh`), the tiny model if asked for, and the run's pin.
    Returns the config the supervisor runs with (``model.path`` = the pinned folder); the
    roles it starts read the same pin from run.json, which exists from here on, and
    `sluice up` records changed allowed keys there (the whole run moves to them)."""
    from pipeline.rundir import check_fresh, pinned_config

    out = cfg.output_path
    if fresh:
        check_fresh(out)
        if out.exists():
            shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    ensure_model(cfg)
    return pinned_config(cfg, allow_config_change=allow_config_change, record_allowed=True)


def run_up(cfg: Config, config_path: str, overrides: list[str], *,
           eval_every_s: float | None = None) -> int:
    """Run every role until the run ends; ``cfg`` is the one `prepare` returned."""
    out = cfg.output_path
    redis = None
    servers: list[LocalServer] = []
    specs: list[ServerSpec] = []
    if cfg.generation.engine == "vllm" and cfg.generation.vllm.launch:
        try:  # where each server runs: a machine that cannot host them fails before any start
            specs = vllm_specs(cfg)
            os.environ["VLLM_API_KEY"] = specs[0].api_key or ""  # the roles reach them
        except ConfigError as e:
            print(f"sluice: {e}", file=sys.stderr)
            return 2
    if not cfg.bus.redis_url:
        redis = EmbeddedRedis(out / "redis").start()
    try:  # the bus as every role will find it: a cluster's slots, the run's partitions
        asyncio.run(connect(cfg, role="monitor").close())
    except ConfigError as e:
        if redis is not None:
            redis.stop()
        print(f"sluice: {e}", file=sys.stderr)
        return 2
    sup = Supervisor(cfg, config_path, overrides, eval_every_s=eval_every_s)
    stop = asyncio.Event()
    loop = asyncio.new_event_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        urls: list[str] = []
        if specs:
            extra = " and 1 for the evaluator" if launches_eval_server(cfg) else ""
            print(f"starting {cfg.generation.vllm.launch} vLLM server(s){extra}; logs in "
                  f"{out}/vllm", file=sys.stderr)
            servers = launch(specs, out / "vllm", cfg.generation.vllm.start_timeout_s)
            urls = [s.url for s in servers]
        n = cfg.generation.vllm.launch
        sup.start_roles(vllm_urls=urls[:n], eval_urls=urls[n:])
        reason = loop.run_until_complete(supervise(sup, stop))
        if reason == "finished":
            # every role exits on RunFinished; give them time to flush, then insist
            deadline = time.time() + 60
            while time.time() < deadline and any(c.proc.poll() is None for c in sup.children):
                time.sleep(0.2)
        sup.terminate()
        for server in servers:  # they serve only the roles, all gone now: their shutdown
            server.terminate()  # (seconds each) overlaps the summary and the audit
        snap = loop.run_until_complete(_final_snapshot(cfg))
        from sluice.report import summarize

        ok = summarize(cfg, sup.samples, snap, reason)
        ok = loop.run_until_complete(audit_run(cfg)) and ok
        archive_dispositions(cfg)
        # a crash already reported and awaiting its restart when the run ended is not
        # a failure of the run (it survived it)
        failed = [c for c in sup.children if c.proc.returncode not in (0, -signal.SIGTERM)
                  and c.restart_at is None]
        for c in failed:
            print(f"\n{c.name} exited with {c.proc.returncode}; last lines of {c.log}:\n"
                  f"{c.tail()}", file=sys.stderr)
        if reason == "interrupted":
            return 130
        done = reason in ("finished", "max_time_s") or reason.startswith("stop_at")
        return 0 if ok and not failed and done else 1
    finally:
        sup.terminate(grace_s=5)
        stop_all(servers)  # together: SIGTERM to each, then one grace period for all
        if redis is not None:
            redis.stop()
        loop.close()
        freeze_for_exit()  # `sluice up` owns its process: only the exit is left


def archive_dispositions(cfg: Config) -> None:
    """With ``archive.enabled``: what became of every group, as the archive's
    ``dispositions.parquet``, written once every role has stopped (the archiver writes it
    itself only when the run ends at ``max_steps``). A failure is reported, not fatal:
    ``sluice archive RUN.toml --dispositions`` writes it later."""
    if not (cfg.archive.enabled and cfg.run.ledger):
        return
    from pipeline.archive.store import write_dispositions

    try:
        n = write_dispositions(cfg)
    except Exception as e:
        print(f"archive: dispositions.parquet not written ({e!r}); `sluice archive "
              "RUN.toml --dispositions` writes it", file=sys.stderr)
        return
    print(f"archive: dispositions of {n} groups written", file=sys.stderr)


async def audit_run(cfg: Config) -> bool:
    """Save the final counters next to the ledgers (for a later `sluice audit`) and check
    the run's whole history, with where its unfinished groups are; prints one line, and
    returns False on any violation."""
    if not cfg.run.ledger:
        return True
    from pipeline.bus.audit import audit, live_view, pending_intents
    from pipeline.bus.ledger import read_ledgers

    rows = read_ledgers(cfg.output_path)
    bus = connect(cfg, role="monitor")
    try:
        live = await live_view(bus, pending_intents(rows))
    finally:
        await bus.close()
    out = cfg.output_path
    (out / "state.json").write_text(json.dumps(
        {"state": live.state, "num_generations": cfg.generation.num_generations,
         "archive": cfg.archive.enabled}))
    report = audit(out, live=live, num_generations=cfg.generation.num_generations, rows=rows,
                   archive=cfg.archive.enabled)
    print(f"ledger audit ({out}/ledger): {report.summary()}", file=sys.stderr)
    return report.ok


async def _final_snapshot(cfg: Config) -> dict[str, Any]:
    bus = connect(cfg, role="monitor")
    try:
        return await snapshot(bus)
    finally:
        await bus.close()
