"""What ``archive.enabled`` costs the quick start, without the learning noise.

    .venv/bin/python benchmarks/archive_cost.py [--pairs 4] [--seconds 150] [--out DIR]

Time to a target is the steps it takes divided by the step rate; the archive changes
only the step rate, but a learning run's step rate moves with what it has learned (rows
at advantage 0 are not forwarded), so learning pairs mix the archive's cost with the
run's luck. Here the policy is held still (``trainer.lr = 1e-12``), so every run does the
same work: ``sluice up examples/copy.toml`` for ``--seconds``, archive off and on in
ABBA order (off, on, on, off, ...: a linear drift of the machine cancels), one run at a
time. Each run's step rate is taken over its trainer's clock from ``--warmup-s`` to its
last step (start-up excluded); the archiver's CPU seconds come from its own log line.
Prints each pair's ratio (with / without) and the mean of the rates' ratio.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def step_rate(out: Path, warmup_s: float) -> float:
    """Steps per second of the trainer's clock ``t`` from ``warmup_s`` to the last line."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    a = next(r for r in rows if r["t"] >= warmup_s)
    b = rows[-1]
    if b["t"] <= a["t"]:
        raise SystemExit(f"{out}: no steps after {warmup_s} s; raise --seconds")
    return (b["step"] - a["step"]) / (b["t"] - a["t"])


def archiver_cpu_s(out: Path) -> float | None:
    hits = [m for f in sorted((out / "logs").glob("archiver*.log"))
            for m in re.findall(r"([0-9.]+) CPU s", f.read_text())]
    return float(hits[-1]) if hits else None


def run(out: Path, archive: bool, seconds: float) -> None:
    cmd = [str(ROOT / ".venv" / "bin" / "sluice"), "up", str(ROOT / "examples" / "copy.toml"),
           "--fresh", "--set", f'run.output_dir="{out}"', "--set", "trainer.lr=1e-12",
           "--set", f"run.max_time_s={seconds}", "--set", 'up.stop_at=""',
           "--set", "trainer.max_steps=1000000", "--set", "up.plot=false",
           "--set", f"archive.enabled={'true' if archive else 'false'}"]
    with open(out.parent / f"{out.name}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {rc}; see {out.parent / (out.name + '.log')}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--seconds", type=float, default=150.0)
    p.add_argument("--warmup-s", type=float, default=30.0)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "archive-cost")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    order = [arm for i in range(a.pairs) for arm in (("off", "on") if i % 2 == 0
                                                     else ("on", "off"))]
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for i, arm in enumerate(order, 1):
        out = (a.out / f"{i}-{arm}").resolve()
        print(f"== run {i}/{len(order)}: archive {arm}", flush=True)
        run(out, arm == "on", a.seconds)
        rate = step_rate(out, a.warmup_s)
        rates[arm].append(rate)
        cpu = archiver_cpu_s(out)
        print(f"   {rate:.2f} steps/s" + (f", archiver {cpu:.1f} CPU s" if cpu else ""),
              flush=True)
    print(f"\nstep rate, trainer clock {a.warmup_s:.0f} s to the end, lr 1e-12, "
          f"{a.seconds:.0f} s per run, ABBA")
    print("pair   without    with   with/without")
    for k, (off, on) in enumerate(zip(rates["off"], rates["on"], strict=True), 1):
        print(f"{k:4d}  {off:8.2f}  {on:6.2f}   {on / off:.3f}")
    off, on = statistics.fmean(rates["off"]), statistics.fmean(rates["on"])
    print(f"mean  {off:8.2f}  {on:6.2f}   {on / off:.3f}")


if __name__ == "__main__":
    sys.exit(main())
