"""`sluice up`: every role as its own OS process on one machine, plus a live view.

Order: embedded Redis (unless ``bus.redis_url`` is set) → local vLLM servers (engine
``vllm`` with ``generation.vllm.launch`` > 0; each generator gets its share of their
URLs) → trainer (publishes v0 and creates the consumer groups) → the archiver (with
``archive.enabled``) → scorers → generators → evaluator. The servers are stopped by PID
after every role has exited, all at once (`stop_all`), while the summary and the audit
run. Roles talk only through Redis; this supervisor only starts
them, reads heartbeats and state, and stops them (the children themselves:
`sluice.supervisor`; the end-of-run audit: `sluice.audit_run`).
With ``up.metrics`` (the default) each role serves Prometheus ``/metrics`` on a free
loopback port chosen at each (re)start (`pipeline.metrics`; `sluice status` lists them).

Crashes: a role that exits abnormally (an error, ``kill -9``) is reported at once with
the tail of its log and restarted after a backoff (`sluice.restarts`; the pipeline
survives the crash: leases, reclaim, the trainer's checkpoint); one that crashes more than
``up.max_restarts`` times within ``up.restart_window_s`` ends the run, named. One that
exits `pipeline.runtime.FATAL_EXIT_CODE` (it found an error no restart can fix, e.g. a
prompt filter that rejected a whole epoch) ends the run at once, reported the same way.

Shutdown: the trainer ends the run at ``max_steps`` with a `RunFinished` announcement,
on which every other role exits by itself (the evaluator after evaluating the final
version). On ``max_time_s``, ``up.stop_at`` met, or a first Ctrl-C the supervisor asks the
trainer for the same end (`begin_end`: it finishes its step first), bounded by
``up.end_timeout_s``. On a second Ctrl-C, a SIGTERM to `sluice up`, that bound passed, or
a role given up on, every child gets SIGTERM (by PID), finishes or releases its work and exits;
stragglers are asked for their threads' stacks (SIGUSR1, into their logs) and get SIGKILL
after a grace period; a trainer still running `EXIT_AFTER_FINISH_S` after it announced
the end is such a straggler. A failed role is reported with the tail of its log (a whole
stack dump when there is one), never hidden behind a pipeline that looks healthy.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.bus import control
from pipeline.config import Config, ConfigError
from pipeline.evaluation import parse_target
from pipeline.runtime import FATAL_EXIT_CODE, connect, connected, freeze_for_exit
from sluice.audit_run import audit_at_end
from sluice.embedded import EmbeddedRedis
from sluice.monitor import snapshot
from sluice.restarts import RestartPolicy
from sluice.server_watch import ServerWatch
from sluice.supervisor import Supervisor
from sluice.vllm_launch import LocalServer, ServerSpec, launch, stop_all
from sluice.vllm_placement import launches_eval_server, vllm_specs

EXIT_AFTER_FINISH_S = 60.0
"""How long the supervisor waits for the trainer to exit once it has announced the end
of the run (after its final checkpoint: only closing connections, the ledger and the
trackers is left). A trainer still running then is stopped like any straggler (SIGTERM,
its stacks, SIGKILL) and reported as failed: a hang at exit is a bug to see in seconds,
not a run that sits at its last step until ``max_time_s``."""


def status_line(sup: Supervisor, snap: dict[str, Any]) -> dict[str, Any]:
    """What the progress line shows (`progress_text`), from a `snapshot` and the
    supervisor's samples of the scorers' counters; ``groups_per_s`` is over the whole
    run so far."""
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
    """``x`` formatted by ``spec``, or "-" when it is not known yet."""
    return "-" if x is None else format(x, spec)


def progress_text(s: dict[str, Any], shown: str) -> str:
    """The progress line of `status_line` ``s``; ``shown`` is the eval metric it shows."""
    return (f"step {s['step']}/{s['max_steps']}  reward {fmt(s['reward'])}  "
            + (f"exact {fmt(s['exact'])}  " if s["exact"] is not None else "")
            + f"eval {shown} {fmt(s['eval'].get(shown))}  "
            f"stale {fmt(s['staleness'], '.2f')}  {s['groups_per_s']:.1f} groups/s  "
            f"gate {s['gate']}"
            + (f"  reward errors {s['reward_errors']}" if s["reward_errors"] else "")
            + (f"  dlq {s['dlq']}" if s["dlq"] else ""))


def stop_reason(sup: Supervisor, stop: asyncio.Event, policy: RestartPolicy,
                finished_at: float | None, ending: bool = False) -> str | None:
    """Why the run ends now, from what this process sees without Redis (None: it goes
    on). Restarts crashed roles on the way (`Supervisor.handle_crashes`). A trainer that
    exited 0, or one still running `EXIT_AFTER_FINISH_S` after its `RunFinished` was
    first seen (``finished_at``), ends it as "finished". ``ending``: an orderly end is
    under way (`supervise`), so ``max_time_s`` is no longer a reason."""
    cfg = sup.cfg
    if stop.is_set():
        return "interrupted"
    if not ending and cfg.run.max_time_s and time.time() - sup.t0 > cfg.run.max_time_s:
        return "max_time_s"
    bad = sup.handle_crashes(policy)
    if bad is not None:
        if bad.proc.returncode == FATAL_EXIT_CODE:  # reported with its log already
            return f"{bad.name} stopped on an error no restart can fix"
        return (f"{bad.name} exited with code {bad.proc.returncode}"
                + (f" ({policy.count(bad.name)} crashes in "
                   f"{policy.window_s:g} s)" if policy.max_restarts else ""))
    if sup.children[0].proc.poll() == 0:  # the trainer finished the run
        return "finished"
    if finished_at is not None and time.time() - finished_at > EXIT_AFTER_FINISH_S:
        print(f"sluice: the trainer announced the end of the run but has not exited "
              f"{EXIT_AFTER_FINISH_S:g} s later; stopping it", file=sys.stderr)
        return "finished"
    return None


ORDERLY = ("max_time_s", "interrupted", "stop_at")
"""The reasons (prefixes) that end a run in order (`begin_end`) when
``up.end_timeout_s`` > 0; the others (a role given up on) stop every role at once."""
END_RESEND_S = 5.0  # the end request again this often (a trainer restarting may miss one)


def begin_end(sup: Supervisor, reason: str) -> bool:
    """Ask the trainer to end the run (`pipeline.runtime.END_SIGNAL`): it finishes its
    step and announces `RunFinished`, on which the evaluator evaluates the final version
    and every role exits. False (stop as before) when ``up.end_timeout_s`` is 0 or no
    trainer is running to ask."""
    from pipeline.runtime import END_SIGNAL
    from sluice.supervisor import signal_role

    trainer = sup.children[0]
    if not sup.cfg.up.end_timeout_s or END_SIGNAL is None or trainer.proc.poll() is not None:
        return False
    signal_role(trainer.proc, END_SIGNAL)
    what = "max_time_s reached" if reason == "max_time_s" else reason
    print(f"sluice: {what}: ending the run in order (the trainer's last step, then the "
          f"final version evaluated; at most {sup.cfg.up.end_timeout_s:g} s"
          + ("; Ctrl-C again to stop at once)" if reason == "interrupted" else ")"),
          file=sys.stderr, flush=True)
    return True


async def supervise(sup: Supervisor, stop: asyncio.Event, hard: asyncio.Event | None = None,
                    watch: ServerWatch | None = None) -> tuple[str, float | None]:
    """Watch the run until it ends (`stop_reason`, or ``up.stop_at`` met by the
    evaluator), showing its progress; returns why it ended and, when it ends in order
    (max_time_s or a first Ctrl-C, `begin_end`: the trainer has announced the end and
    the other roles are finishing), the time by which they must have exited (None for
    every other reason, and after a second Ctrl-C or ``up.end_timeout_s``: every role is
    then stopped as it stands). ``hard`` set with ``stop`` (SIGTERM, a process manager's
    stop): no orderly end. ``watch``: the vLLM servers this process launched, started
    again when one exits (`sluice.server_watch`) until the run ends in order."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    cfg = sup.cfg
    console = Console(stderr=True)
    live = console.is_terminal
    progress = Progress(TextColumn("[bold]sluice[/]"), BarColumn(), TextColumn("{task.fields[s]}"),
                        TimeElapsedColumn(), console=console, disable=not live)
    task = progress.add_task("train", total=cfg.trainer.max_steps, s="starting")
    last_print = 0.0
    policy = RestartPolicy(max_restarts=cfg.up.max_restarts, window_s=cfg.up.restart_window_s)
    target = parse_target(cfg.up.stop_at)
    shown = target.metric if target else "pass@1"  # the eval metric on the progress line
    finished_at: float | None = None  # when the trainer's RunFinished was first seen
    ending: str | None = None  # the reason of an orderly end under way
    ending_at = resent_at = 0.0
    async with connected(cfg, role="monitor") as bus:
        with progress:
            while True:
                reason = stop_reason(sup, stop, policy, finished_at, ending is not None)
                if reason is None and watch is not None and ending is None:
                    reason = watch.poll()
                if reason is not None and ending is None and reason.startswith(ORDERLY) \
                        and not (hard is not None and hard.is_set()) and begin_end(sup, reason):
                    ending, ending_at = reason, time.time()
                    resent_at = ending_at
                    stop.clear()  # a second Ctrl-C sets it again
                    continue
                if reason is not None:
                    if ending is not None and reason == "interrupted":
                        print("sluice: stopping every role now", file=sys.stderr, flush=True)
                    if ending is not None and reason == "finished":
                        return ending, ending_at + cfg.up.end_timeout_s
                    return ("interrupted" if reason == "interrupted" else ending or reason), None
                if ending is not None:
                    if time.time() - ending_at > cfg.up.end_timeout_s:
                        print(f"sluice: the orderly end took more than up.end_timeout_s = "
                              f"{cfg.up.end_timeout_s:g} s; stopping every role now",
                              file=sys.stderr, flush=True)
                        return ending, None
                    if finished_at is None and time.time() - resent_at > END_RESEND_S:
                        begin_end_again(sup)
                        resent_at = time.time()
                try:
                    snap = await snapshot(bus)
                except Exception:
                    await asyncio.sleep(0.5)
                    continue
                sup.samples.record(snap)
                if finished_at is None and await finished_announced(bus):
                    finished_at = time.time()
                s = status_line(sup, snap)
                if target is not None and target.met(s["eval"]) and ending is None:
                    reached = f"stop_at {target} reached"
                    if not begin_end(sup, reached):
                        return reached, None
                    ending, ending_at = reached, time.time()
                    resent_at = ending_at
                text = progress_text(s, shown)
                progress.update(task, completed=s["step"], s=text)
                if not live and time.time() - last_print > 10:
                    last_print = time.time()
                    print(f"[{time.time() - sup.t0:6.0f}s] {text}", file=sys.stderr,
                          flush=True)
                await asyncio.sleep(0.5)


def begin_end_again(sup: Supervisor) -> None:
    """The end request once more, quietly (a trainer restarted meanwhile, or one that was
    still importing, ignores or never saw the first; a second one is harmless)."""
    from pipeline.runtime import END_SIGNAL
    from sluice.supervisor import signal_role

    if END_SIGNAL is not None and sup.children[0].proc.poll() is None:
        signal_role(sup.children[0].proc, END_SIGNAL)


async def roles_exit(sup: Supervisor, stop: asyncio.Event, timeout_s: float) -> None:
    """Wait until every role has exited by itself, ``timeout_s`` has passed, or ``stop``
    is set (a Ctrl-C: stop waiting)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and any(c.proc.poll() is None for c in sup.children):
        if stop.is_set():
            print("sluice: stopping every role now", file=sys.stderr, flush=True)
            return
        await asyncio.sleep(0.2)


def ensure_model(cfg: Config) -> None:
    """Build the model folder ``model.path`` when it is missing: from the GGUF file
    ``model.from_gguf``, else the tiny model ``model.init`` names; a hub id is never
    built (`pipeline.hub` fetches it), and a missing folder without either is left to
    `pipeline.hub.resolve_model`, whose error names ``model.path``."""
    from pipeline.hub import is_hub_id

    path = Path(cfg.model.path)
    if cfg.model.from_gguf and is_hub_id(cfg.model.path):
        raise ConfigError(f"model.from_gguf: converts into a folder, but model.path "
                          f"{cfg.model.path!r} is a hub id (write ./{cfg.model.path})")
    if is_hub_id(cfg.model.path) or (path / "config.json").exists():
        return
    if cfg.model.from_gguf:
        from sluice.gguf_import import import_gguf

        if not Path(cfg.model.from_gguf).is_file():
            raise ConfigError(f"model.from_gguf: no such file: {cfg.model.from_gguf} (the "
                              "SmolLM2 file comes with `bash deploy/setup.sh`)")

        print(f"converting {cfg.model.from_gguf} into the model folder {path} (once)",
              file=sys.stderr, flush=True)
        import_gguf(cfg.model.from_gguf, path)
        return
    if not cfg.model.init:
        return
    from pipeline.model import init_tiny_model

    print(f"building the tiny model {cfg.model.init} in {path}", file=sys.stderr)
    init_tiny_model(path, seed=cfg.run.seed, recipe=cfg.model.init)


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
    stop = asyncio.Event()  # Ctrl-C: the orderly end first, a second one stops at once
    hard = asyncio.Event()  # SIGTERM: stop at once, as a process manager expects
    loop = asyncio.new_event_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGTERM, lambda: (hard.set(), stop.set()))
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
        watch = ServerWatch(servers, RestartPolicy(max_restarts=cfg.up.max_restarts,
                                                   window_s=cfg.up.restart_window_s))
        reason, end_by = loop.run_until_complete(supervise(sup, stop, hard, watch))
        if reason == "finished" or end_by is not None:
            # every role exits on RunFinished (the evaluator after evaluating the final
            # version); give them time to, then insist
            wait_s = 60.0 if end_by is None else max(end_by - time.time(), 10.0)
            loop.run_until_complete(roles_exit(sup, stop, wait_s))
        sup.terminate()
        for server in servers:  # they serve only the roles, all gone now: their shutdown
            server.terminate()  # (seconds each) overlaps the summary and the audit
        snap = loop.run_until_complete(_final_snapshot(cfg))
        from sluice.report import summarize

        ok = summarize(cfg, sup.samples, snap, reason)
        ok = loop.run_until_complete(audit_at_end(cfg)) and ok
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


async def _final_snapshot(cfg: Config) -> dict[str, Any]:
    async with connected(cfg, role="monitor") as bus:
        return await snapshot(bus)
