"""The bus alone: generators -> scorers -> trainer through a real Redis, against one
`multiprocessing.Queue` + pickle hop (TRL's path), on the same groups in the same run.

    .venv/bin/python -m benchmarks.bus [--sizes 2KB,48KB,1MB] [--seconds 10] [--warmup 3]
        [--generators 1] [--scorers 2] [--window 64] [--tcp] [--appendonly] [--quick]

Null model, trivial reward (`benchmarks.rewards.trivial_reward`). Per group size (the
encoded `RolloutGroup`, sized by completion length: ``--generations`` completions of
equal length, ``--chars-per-token`` characters of text per token):

- sluice (two hops): ``--generators`` processes each admit (`Bus.admit`, window
  ``--window``) and append (`Bus.emit`) groups encoded with the real codec, a fresh
  group id per admission (``--gen-concurrency`` admit -> emit loops per process, so a
  generator is not one round trip at a time); ``--scorers`` real scorer roles (``sluice
  score``: read_group -> decode -> reward -> advantages -> `Bus.handoff`, ledger and
  janitor included); one trainer-side consumer that reads ``scored``, decodes every
  entry (`ScoredGroup`), retires it (`Bus.retire`, ``trained``) and trims what it
  acknowledged, with no model.
- baseline (one hop): as many producer processes put the same `RolloutGroup` objects
  (numpy arrays inside) into one ``multiprocessing.Queue(maxsize=--window)``, pickled by
  the queue; one consumer process gets (unpickles) them.

Each arm runs ``--warmup`` seconds, then ``--seconds`` timed. groups/s = groups the
consumer finished in the timed window / its length; MB/s = groups/s x the encoded
group size (the payload generators append). CPU per group = user + system seconds of
every process of the arm in the window (redis-server, generators, scorers, consumer;
producers and consumer for the baseline) / groups: with a null model and a trivial
reward that is the bus's cost, an upper bound (the scorer's bookkeeping counts in it).

The trainer step it is compared with: the tiny char model (`pipeline.model
.init_tiny_model`, 2 layers, hidden 128) takes one optimizer step (`trainer.step
.optimize`, padded layout, loss dapo, ``--step-threads`` torch threads) on
``--step-groups`` synthetic groups of each size's shape (`benchmarks.synthetic`);
median of ``--step-repeats`` steps after a warm-up step, per group. Sizes whose
samples are longer than ``--step-max-tokens`` are not timed (the tiny model does not
train such sequences; the step would dominate the run).

Targets: sluice >= 2x the mp.Queue groups/s at 2 KB and 48 KB; bus CPU per
group <= 2% of the tiny model's trainer step per group. P = 3 partitions on a 3-master
cluster needs ``bus.partitions``, which does not exist yet: the run says so.
The machine may be shared: ratios measured in one run are the result.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import multiprocessing as mp
import os
import queue
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.buslab import (
    cpu_seconds,
    cpu_used,
    parse_size,
    redis_server,
    scorer_config,
    size_label,
    sized_group,
    start_scorers,
    stop_processes,
    trainer_step_s_per_group,
    wait_progress,
    wait_workers,
)
from pipeline.bus.client import Bus
from pipeline.bus.codec import decode_entry, encode
from pipeline.bus.keys import TRAINERS_GROUP
from pipeline.bus.schema import Limits, RolloutGroup, ScoredGroup
from sluice.embedded import EmbeddedCluster

TARGET_RATE = 2.0  # sluice / mp.Queue groups/s, at 2 KB and 48 KB
TARGET_RATE_SIZES = (2 * 1024, 48 * 1024)
TARGET_CPU_SHARE = 0.02  # bus CPU per group / trainer step per group
GATE_POLL_S = 0.002  # a generator finding the gate closed polls again after this
TRIM_EVERY_S = 1.0  # the consumer trims acknowledged `scored` entries this often
RUN = "bench"


@dataclasses.dataclass
class Arm:
    """One measured path: groups/s in the timed window and CPU seconds per group by role."""

    name: str
    groups_s: float
    cpu_per_group: dict[str, float]

    @property
    def cpu_total(self) -> float:
        return sum(self.cpu_per_group.values())


def _loop_run(coro: Any) -> None:
    """As a role runs (`pipeline.runtime.run_role`): uvloop when installed."""
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


# ------------------------------------------------------------ sluice arm: processes


def generator_main(run: str, url: str, owner: str, group: RolloutGroup, window: int,
                   concurrency: int, batch: int, lanes: tuple[bool, int], stop: Any,
                   ready: Any) -> None:
    """Admit a batch -> encode -> emit the batch until ``stop``, as `workers.generator`
    does (one admission script for up to ``batch`` cursors, their EMITs pipelined);
    ``concurrency`` loops share one Bus. ``lanes``: (bus.cluster, bus.partitions)."""
    async def go() -> None:
        bus = Bus.connect(url, run, cluster=lanes[0], partitions=lanes[1])
        await bus.state()  # connected before the arm's clock starts

        async def loop() -> None:
            while not stop.is_set():
                got = await bus.admit_many(window, owner, 600_000, batch)
                if not got.cursors:
                    await asyncio.sleep(GATE_POLL_S)
                    continue
                now = time.time()
                await bus.emit_many([(c, encode(dataclasses.replace(
                    group, group_id=f"0:{c}", prompt_index=c, t_admit=now, t_done=now)),
                    f"emit:{c}") for c in got.cursors], owner)

        ready.set()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        await bus.close()

    _loop_run(go())


def consumer_main(run: str, url: str, read_count: int, keep_acked_s: float,
                  lanes: tuple[bool, int],
                  stop: Any, ready: Any, done: Any) -> None:
    """The trainer's side without a model: read ``scored`` (every lane), decode, retire,
    trim."""
    async def go() -> None:
        bus = Bus.connect(url, run, cluster=lanes[0], partitions=lanes[1])
        for k in bus.lanes.keys:
            await bus.ensure_group(k.scored, TRAINERS_GROUP)
        limits = Limits()
        last_trim = time.monotonic()
        ready.set()
        while not stop.is_set():
            entries = await bus.read_lanes("scored", TRAINERS_GROUP, "bench-trainer",
                                           count=read_count, block_ms=100)
            for e in entries:
                if e.fields is not None:
                    decode_entry(e.fields, limits, expect=ScoredGroup)
            if entries:  # one read is one lane's
                ids = [e.id for e in entries]
                await bus.retire(entries[0].stream, TRAINERS_GROUP, ids, "trained",
                                 op=f"b:{ids[0]}")
                done.value += len(ids)
            if time.monotonic() - last_trim > TRIM_EVERY_S:
                last_trim = time.monotonic()
                for k in bus.lanes.keys:
                    await bus.trim_acked(k.scored, keep_ms=int(keep_acked_s * 1000))
        await bus.close()

    _loop_run(go())


# ------------------------------------------------------------ baseline arm: processes


def producer_main(q: Any, group: RolloutGroup, first: int, step: int, stop: Any,
                  ready: Any) -> None:
    """Put fresh copies of ``group`` (new id; arrays shared) into ``q`` until ``stop``."""
    q.cancel_join_thread()  # exit without flushing what the consumer will never read
    ready.set()
    i = first
    while not stop.is_set():
        now = time.time()
        g = dataclasses.replace(group, group_id=f"0:{i}", prompt_index=i, t_admit=now,
                                t_done=now)
        try:
            q.put(g, timeout=0.1)
        except queue.Full:
            continue
        i += step


def queue_consumer_main(q: Any, stop: Any, ready: Any, done: Any) -> None:
    ready.set()
    while not stop.is_set():
        try:
            q.get(timeout=0.1)
        except queue.Empty:
            continue
        done.value += 1


# ------------------------------------------------------------ orchestration


def measure(a: argparse.Namespace, name: str, done: Any, roles: dict[str, list[int]],
            logs: Path | None = None) -> Arm:
    """Warm up, then count the consumer's groups and every role's CPU over the window
    (which runs on past ``--seconds`` until at least one group is through)."""
    time.sleep(a.warmup)
    pids = [p for ps in roles.values() for p in ps]
    n0, c0, t0 = done.value, cpu_seconds(pids), time.perf_counter()
    time.sleep(a.seconds)
    wait_progress(lambda: done.value > n0, logs)
    n1, c1, t1 = done.value, cpu_seconds(pids), time.perf_counter()
    n = n1 - n0
    return Arm(name, n / (t1 - t0), {role: cpu_used(c0, c1, ps) / n
                                     for role, ps in roles.items()})


def start_all(procs: list[Any], readies: list[Any], timeout_s: float = 60.0) -> None:
    """Start ``procs`` and wait until each has set its ready event (RuntimeError if one
    exits first or ``timeout_s`` passes)."""
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p, r in zip(procs, readies, strict=True):
        while not r.wait(0.1):
            if p.exitcode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{p.name} did not start (exit code {p.exitcode})")


def end_all(procs: list[Any], stop: Any) -> None:
    """Ask every started process to stop; terminate (by PID) one that does not."""
    stop.set()
    for p in procs:
        if p.pid is None:
            continue
        p.join(10)
        if p.is_alive():
            p.terminate()
            p.join(5)


def run_sluice(a: argparse.Namespace, group: RolloutGroup, tmp: Path,
               cluster: EmbeddedCluster | None = None, partitions: int = 1,
               run: str = RUN) -> Arm:
    """The two-hop pipeline on a fresh redis-server, or on ``cluster`` in ``partitions``
    lanes (a run name per arm: the cluster is shared by the arms)."""
    with contextlib.ExitStack() as stack:
        if cluster is None:
            srv = stack.enter_context(redis_server(tmp / "redis", tcp=a.tcp,
                                                   appendonly=a.appendonly))
            assert srv.proc is not None
            url, redis_pids = srv.url, [srv.proc.pid]
        else:
            url, redis_pids = cluster.url, [n.proc.pid for n in cluster.nodes if n.proc]
        return _run_sluice(a, group, tmp, url, redis_pids, (cluster is not None, partitions),
                           run)


def _run_sluice(a: argparse.Namespace, group: RolloutGroup, tmp: Path, url: str,
                redis_pids: list[int], lanes: tuple[bool, int], run: str) -> Arm:
    ctx = mp.get_context("spawn")
    logs = tmp / "logs"
    logs.mkdir(exist_ok=True)
    cfg = scorer_config(tmp / "run.toml", url=url, run=run, output_dir=tmp / "run",
                        reward="benchmarks.rewards:trivial_reward",
                        read_count=a.read_count, ledger=not a.no_ledger,
                        # the scorers' janitor (trim of `rollouts`) runs every
                        # claim_idle_ms / 2: every second, as the consumer's of `scored`
                        bus={"keep_acked_s": a.keep_acked_s, "claim_idle_ms": 2000,
                             "cluster": str(lanes[0]).lower(), "partitions": lanes[1]})
    scorers = start_scorers(cfg, a.scorers, logs)
    stop = ctx.Event()
    procs: list[Any] = []
    try:
        wait_workers(url, run, [f"scorer/bench-s{i}" for i in range(a.scorers)], scorers,
                     logs, cluster=lanes[0])
        done = ctx.RawValue("q", 0)
        readies = [ctx.Event() for _ in range(a.generators + 1)]
        procs = [ctx.Process(target=consumer_main, name="consumer", args=(
            run, url, a.read_count, a.keep_acked_s, lanes, stop, readies[0],
            done))]
        procs += [ctx.Process(target=generator_main, name=f"generator-{i}", args=(
            run, url, f"bench-g{i}", group, a.window, a.gen_concurrency,
            a.batch, lanes, stop, readies[i + 1])) for i in range(a.generators)]
        start_all(procs, readies)
        roles = {"redis": redis_pids, "generators": [p.pid for p in procs[1:]],
                 "scorers": [p.pid for p in scorers], "trainer": [procs[0].pid]}
        return measure(a, "sluice", done, roles, logs)
    finally:
        end_all(procs, stop)
        stop_processes(scorers)



def run_queue(a: argparse.Namespace, group: RolloutGroup) -> Arm:
    ctx = mp.get_context("spawn")
    q = ctx.Queue(maxsize=a.window)
    stop = ctx.Event()
    done = ctx.RawValue("q", 0)
    readies = [ctx.Event() for _ in range(a.generators + 1)]
    procs: list[Any] = [ctx.Process(target=queue_consumer_main, name="consumer",
                                    args=(q, stop, readies[0], done))]
    procs += [ctx.Process(target=producer_main, name=f"producer-{i}",
                          args=(q, group, i, a.generators, stop, readies[i + 1]))
              for i in range(a.generators)]
    try:
        start_all(procs, readies)
        roles = {"producers": [p.pid for p in procs[1:]], "consumer": [procs[0].pid]}
        return measure(a, "mp.Queue", done, roles)
    finally:
        end_all(procs, stop)
        q.close()
        q.cancel_join_thread()


def verdict(ok: bool) -> str:
    return "met" if ok else "not met"


def report(a: argparse.Namespace, nbytes: int, target: int, group: RolloutGroup,
           sluice: Arm, base: Arm, step_s: float | None) -> None:
    n, t = len(group.rollouts), len(group.rollouts[0].completion_ids)
    print(f"\n== {size_label(target)} groups: {nbytes:,} B encoded ({n} completions x {t} "
          f"tokens, prompt {len(group.prompt_ids)} tokens) ==")
    roles = [*sluice.cpu_per_group, *base.cpu_per_group]
    print(f"{'path':<40}{'groups/s':>10}{'MB/s':>9}{'bus CPU ms/group':>18}  "
          + "  ".join(f"{r:>10}" for r in roles))
    scorers = f"{a.scorers} scorer{'s' if a.scorers != 1 else ''}"
    for arm, label in ((sluice, f"sluice: {a.generators} gen -> {scorers} -> trainer"),
                       (base, f"mp.Queue: {a.generators} producer -> consumer")):
        cells = "  ".join(f"{arm.cpu_per_group[r] * 1e3:>10.3f}" if r in arm.cpu_per_group
                          else f"{'':>10}" for r in roles)
        print(f"{label:<40}{arm.groups_s:>10.1f}{arm.groups_s * nbytes / 2**20:>9.1f}"
              f"{arm.cpu_total * 1e3:>18.3f}  {cells}")
    ratio = sluice.groups_s / base.groups_s if base.groups_s else float("inf")
    line = f"sluice / mp.Queue groups/s = {ratio:.2f}x"
    if target in TARGET_RATE_SIZES:
        line += f" (target >= {TARGET_RATE:g}x: {verdict(ratio >= TARGET_RATE)})"
    print(line)
    print(f"CPU per group sluice / mp.Queue = {sluice.cpu_total / base.cpu_total:.2f}x")
    if step_s is None:
        print(f"tiny-model trainer step: not timed (samples over --step-max-tokens "
              f"{a.step_max_tokens})")
    else:
        share = sluice.cpu_total / step_s
        print(f"tiny-model trainer step: {step_s * 1e3:.2f} ms per group ({a.step_groups} "
              f"groups/step, {a.step_threads} thread); bus CPU per group = {share:.1%} of it "
              f"(target <= {TARGET_CPU_SHARE:.0%}: {verdict(share <= TARGET_CPU_SHARE)})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",")],
                   default=[parse_size(x) for x in ("2KB", "48KB", "1MB")],
                   help="encoded group sizes, e.g. 2KB,48KB,1MB")
    p.add_argument("--seconds", type=float, default=10.0, help="timed window per arm")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds before the window")
    p.add_argument("--generators", type=int, default=1, help="also the baseline's producers")
    p.add_argument("--gen-concurrency", type=int, default=4,
                   help="admit -> emit loops per generator process")
    p.add_argument("--scorers", type=int, default=2)
    p.add_argument("--window", type=int, default=64,
                   help="admission window; the baseline queue's maxsize")
    p.add_argument("--read-count", type=int, default=8, help="scoring.read_count; also "
                   "the consumer's read size")
    p.add_argument("--keep-acked-s", type=float, default=60.0, help="bus.keep_acked_s: "
                   "acknowledged entries kept this long for `sluice tail`")
    p.add_argument("--batch", type=int, default=8, help="generation.batch_groups: cursors "
                   "per admission call, EMITs per pipeline")
    p.add_argument("--cluster-sizes", type=lambda s: [parse_size(x) for x in s.split(",")
                                                      if x],
                   default=None, help="sizes also run on a 3-master Redis Cluster with "
                   "bus.partitions 1 and 3 (default 48KB; none with --quick; '' = none)")
    p.add_argument("--generations", type=int, default=8, help="completions per group")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--chars-per-token", type=int, default=4, help="completion text length")
    p.add_argument("--tcp", action="store_true", help="Redis on loopback TCP, not a unix "
                   "socket (as `sluice up`)")
    p.add_argument("--appendonly", action="store_true", help="Redis AOF on (as `sluice up`)")
    p.add_argument("--no-ledger", action="store_true", help="run.ledger = false")
    p.add_argument("--step-groups", type=int, default=8)
    p.add_argument("--step-repeats", type=int, default=3)
    p.add_argument("--step-threads", type=int, default=1, help="as trainer.threads")
    p.add_argument("--step-max-tokens", type=int, default=2048)
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 2 KB only, one scorer, 1 s windows, one timed step "
                   "(the cluster arm only with --cluster-sizes)")
    a = p.parse_args(argv)
    if a.cluster_sizes is None:
        a.cluster_sizes = [] if a.quick else [parse_size("48KB")]
    if a.quick:
        a.sizes, a.seconds, a.warmup, a.step_repeats, a.step_groups = [2048], 1.0, 0.5, 1, 2
        a.scorers = 1
    print(f"bus benchmark: {os.cpu_count()} CPUs, Redis on "
          f"{'loopback TCP' if a.tcp else 'a unix socket'}, AOF "
          f"{'on' if a.appendonly else 'off'}, window {a.window}, read_count {a.read_count}, "
          f"keep_acked_s {a.keep_acked_s:g}, batch {a.batch}, "
          f"warm-up {a.warmup:g} s, timed {a.seconds:g} s per arm; CPU ms/group by process "
          "role in the columns on the right")
    for target in a.sizes:
        group = sized_group(target, generations=a.generations, prompt_tokens=a.prompt_tokens,
                            chars_per_token=a.chars_per_token)
        nbytes = len(encode(group))
        with tempfile.TemporaryDirectory(prefix="sluice-bench-bus-") as d:
            sluice = run_sluice(a, group, Path(d))
        base = run_queue(a, group)
        report(a, nbytes, target, group, sluice, base, trainer_step_s_per_group(
            group, groups=a.step_groups, repeats=a.step_repeats, threads=a.step_threads,
            max_tokens=a.step_max_tokens))
    if a.cluster_sizes:
        cluster_scaling(a)
    return 0


def cluster_scaling(a: argparse.Namespace) -> None:
    """The same pipeline on one 3-master Redis Cluster, the bus in 1 lane (every key on
    one master) and in 3 (`bus.partitions`: one lane per master)."""
    with tempfile.TemporaryDirectory(prefix="sluice-bench-cluster-") as d, \
            EmbeddedCluster(Path(d) / "cluster", masters=3) as cluster:
        for target in a.cluster_sizes:
            group = sized_group(target, generations=a.generations,
                                prompt_tokens=a.prompt_tokens,
                                chars_per_token=a.chars_per_token)
            arms = {}
            for p in (1, 3):
                with tempfile.TemporaryDirectory(prefix="sluice-bench-bus-") as d2:
                    arms[p] = run_sluice(a, group, Path(d2), cluster=cluster, partitions=p,
                                         run=f"bench-p{p}-{target}")
            print(f"\n== Redis Cluster, 3 masters, {size_label(target)} groups ==")
            print(f"{'bus.partitions':<16}{'groups/s':>10}{'bus CPU ms/group':>18}"
                  f"{'redis ms/group':>16}")
            for p, arm in arms.items():
                print(f"{p:<16}{arm.groups_s:>10.1f}{arm.cpu_total * 1e3:>18.3f}"
                      f"{arm.cpu_per_group['redis'] * 1e3:>16.3f}")
            print(f"P=3 / P=1 groups/s = {arms[3].groups_s / arms[1].groups_s:.2f}x "
                  f"({os.cpu_count()} CPUs shared by every process: the cluster can only "
                  "spread Redis's own work)")


if __name__ == "__main__":
    raise SystemExit(main())
