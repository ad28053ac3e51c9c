"""Scorer scale-out: hand-offs per second with 1, 2 and 4 scorers on a CPU-bound reward.

    .venv/bin/python -m benchmarks.scorer_scaleout [--scorers 1,2,4] [--reward-ms 5]
        [--seconds 15] [--warmup 3] [--groups 0] [--size 2KB] [--read-count 1] [--quick]

The reward (`benchmarks.rewards.busy_reward`) burns ``--reward-ms`` of CPU per
completion (a busy loop on the thread's CPU clock), so a group of ``--generations``
completions costs ``reward_ms x generations`` of scorer CPU: the scorers are the
bottleneck by construction, and the question is how their rate scales with their count.

Per scorer count K, on a fresh redis-server (`benchmarks.buslab`): K real scorer roles
(``sluice score``, ``--name bench-sI``) are started and seen ready (their heartbeats),
then ``rollouts`` is filled with ``--groups`` encoded groups of ``--size`` (0 = enough
for every scorer to stay busy through warm-up and the timed window, with a 1.5x
margin, assuming a rate of min(K, CPUs) scorers' worth). Nothing else runs: the
producer's work is over before the clock starts, and Redis does little per group, so the
scorers have the machine. After ``--warmup`` seconds, groups/s = entries appended to
``scored`` in the next ``--seconds`` / the window's length. If the backlog runs dry in
the window the rate is a lower bound, and the run says so.

``--read-count`` (scoring.read_count) defaults to 1 here, not sluice's 8: a scorer
hands a read's groups on together after rewarding all of them, so with 8 per read the
count would move in steps of 8 x 40 ms of CPU, too coarse for a 1.8x target in a
15-second window.

Target: 1 -> 2 scorers >= 1.8x on a 2-core machine; 4 scorers are reported
as measured (on 2 cores they cannot exceed 2x).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import tempfile
import time
from pathlib import Path

import redis

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
    wait_progress,
    wait_workers,
)
from benchmarks.rewards import REWARD_MS_ENV
from pipeline.bus.client import Bus
from pipeline.bus.codec import encode
from pipeline.bus.keys import Keys
from pipeline.bus.schema import RolloutGroup

TARGET = 1.8  # groups/s with 2 scorers / with 1
RUN = "bench"


@dataclasses.dataclass
class Result:
    scorers: int
    groups_s: float
    scorer_cpu_per_group: float
    redis_cpu_per_group: float
    ran_dry: bool


async def prefill(url: str, group: RolloutGroup, n: int) -> None:
    """Append ``n`` copies of ``group`` (distinct group ids) to ``rollouts``."""
    bus = Bus.connect(url, RUN)
    try:
        for i in range(n):
            g = dataclasses.replace(group, group_id=f"0:{i}", prompt_index=i)
            await bus.xadd(bus.keys.rollouts, encode(g))
    finally:
        await bus.close()


def backlog_for(a: argparse.Namespace, scorers: int) -> int:
    if a.groups:
        return a.groups
    rate = min(scorers, os.cpu_count() or 1) * 1000 / (a.reward_ms * a.generations)
    return math.ceil(rate * (a.warmup + a.seconds) * 1.5) + 8 * scorers


def run_arm(a: argparse.Namespace, group: RolloutGroup, k: int, tmp: Path) -> Result:
    logs = tmp / "logs"
    logs.mkdir()
    with redis_server(tmp / "redis", tcp=a.tcp, appendonly=False) as srv:
        assert srv.proc is not None
        cfg = scorer_config(tmp / "run.toml", url=srv.url, run=RUN, output_dir=tmp / "run",
                            reward="benchmarks.rewards:busy_reward",
                            read_count=a.read_count, ledger=not a.no_ledger)
        procs = start_scorers(cfg, k, logs, env={REWARD_MS_ENV: str(a.reward_ms)})
        client = redis.Redis.from_url(srv.url)
        scored = Keys(RUN).scored
        try:
            wait_workers(srv.url, RUN, [f"scorer/bench-s{i}" for i in range(k)], procs, logs)
            backlog = backlog_for(a, k)
            asyncio.run(prefill(srv.url, group, backlog))
            time.sleep(a.warmup)
            pids = [srv.proc.pid, *(p.pid for p in procs)]
            n0, c0, t0 = client.xlen(scored), cpu_seconds(pids), time.perf_counter()
            time.sleep(a.seconds)
            wait_progress(lambda: client.xlen(scored) > n0, logs)
            n1, c1, t1 = client.xlen(scored), cpu_seconds(pids), time.perf_counter()
        finally:
            client.close()
            stop_processes(procs)
    n = n1 - n0
    return Result(k, n / (t1 - t0), cpu_used(c0, c1, pids[1:]) / n,
                  cpu_used(c0, c1, pids[:1]) / n, ran_dry=n1 >= backlog)


def report(a: argparse.Namespace, nbytes: int, results: list[Result]) -> None:
    print(f"\n{'scorers':>7}{'groups/s':>10}{'completions/s':>15}{'vs 1 scorer':>13}"
          f"{'per scorer':>12}{'scorer CPU ms/group':>21}{'redis CPU ms/group':>20}")
    base = next((r for r in results if r.scorers == 1), results[0])
    for r in results:
        gain = r.groups_s / base.groups_s if base.groups_s else float("nan")
        per_scorer = gain * base.scorers / r.scorers
        print(f"{r.scorers:>7}{r.groups_s:>10.2f}{r.groups_s * a.generations:>15.1f}"
              f"{gain:>12.2f}x{per_scorer:>11.2f}x{r.scorer_cpu_per_group * 1e3:>21.1f}"
              f"{r.redis_cpu_per_group * 1e3:>20.3f}"
              + ("   (backlog ran dry: a lower bound)" if r.ran_dry else ""))
    by_k = {r.scorers: r for r in results}
    cpus = os.cpu_count() or 1
    for k in sorted(by_k):
        if k == 1 or 1 not in by_k or not by_k[1].groups_s:
            continue
        ratio = by_k[k].groups_s / by_k[1].groups_s
        note = (f"target >= {TARGET:g}x: {'met' if ratio >= TARGET else 'not met'}" if k == 2
                else f"{k} scorers on {cpus} CPUs: at most {min(k, cpus)}x possible")
        print(f"1 -> {k} scorers groups/s = {ratio:.2f}x ({note})")
    print(f"(groups of {nbytes:,} B; the reward alone costs {a.reward_ms * a.generations:g} "
          "ms of CPU per group)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scorers", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 2, 4])
    p.add_argument("--reward-ms", type=float, default=5.0, help="CPU ms per completion")
    p.add_argument("--seconds", type=float, default=15.0, help="timed window per count")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds before the window")
    p.add_argument("--groups", type=int, default=0, help="backlog per count; 0 = auto")
    p.add_argument("--size", type=parse_size, default=parse_size("2KB"),
                   help="encoded group size")
    p.add_argument("--generations", type=int, default=8, help="completions per group")
    p.add_argument("--read-count", type=int, default=1, help="scoring.read_count")
    p.add_argument("--tcp", action="store_true", help="Redis on loopback TCP")
    p.add_argument("--no-ledger", action="store_true", help="run.ledger = false")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 1 and 2 scorers, 1 ms reward, 1 s windows")
    a = p.parse_args(argv)
    if a.quick:
        a.scorers, a.reward_ms, a.seconds, a.warmup = [1, 2], 1.0, 1.0, 0.5
    group = sized_group(a.size, generations=a.generations, prompt_tokens=16,
                        chars_per_token=4)
    print(f"scorer scale-out: {os.cpu_count()} CPUs; reward {a.reward_ms:g} ms CPU per "
          f"completion, {a.generations} completions per group ({size_label(a.size)}); "
          f"read_count {a.read_count}; backlog pre-filled per count; warm-up {a.warmup:g} s, "
          f"timed {a.seconds:g} s")
    results = []
    for k in a.scorers:
        with tempfile.TemporaryDirectory(prefix="sluice-bench-scale-") as d:
            results.append(run_arm(a, group, k, Path(d)))
    report(a, len(encode(group)), results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
