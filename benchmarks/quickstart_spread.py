"""How much the quick start's time to target varies: the same command, run N times.

    .venv/bin/python benchmarks/quickstart_spread.py --runs 5 \\
        [--results benchmarks/results/quickstart.json] [--set KEY=VALUE ...]

Each run is ``sluice up examples/copy.toml --fresh`` (the README's main job, the same
seed every time) with only ``run.output_dir`` changed, one run at a time, with the
machine otherwise idle. sluice's roles are separate processes racing on shared cores,
so two runs of one seed do not train on the same batches: the spread is the
command's, which is what a user who runs it sees. ``--set`` applies ``sluice up --set``
overrides to every run (a candidate default, measured against the same command
without it).

Per run, from its ``eval.jsonl``: the first evaluated version whose held-out pass@1
met ``up.stop_at`` (its step, and seconds from the step-0 evaluation to that
evaluation), or "not reached" when the run ended on ``run.max_time_s`` (900 s) or
``trainer.max_steps`` first. Printed: each run, then the mean, standard deviation,
min and max over the runs that reached it, and how many did. Results are written to
``--results`` after every run (with the machine's CPU model); a rerun of the same
command continues where an interrupted one stopped (``--redo`` starts over).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.vs_trl import machine, save_results  # noqa: E402
from sluice.report import read_jsonl  # noqa: E402


def time_to_target(evals: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """The first eval row with pass@1 >= ``target``: its step and its seconds after the
    first row (the step-0 evaluation); ``reached`` False (and the last row's figures)
    when none is."""
    if not evals:
        return {"reached": False, "step": None, "t_s": None, "final_pass@1": None}
    t0 = evals[0]["ts"]
    hit = next((e for e in evals if e.get("pass@1", 0.0) >= target), None)
    row = hit or evals[-1]
    return {"reached": hit is not None, "step": row["step"], "t_s": row["ts"] - t0,
            "final_pass@1": evals[-1].get("pass@1")}


def spread(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean, sample standard deviation, min and max of steps and seconds to the target
    over the runs that reached it, and how many did."""
    hits = [r for r in runs if r["reached"]]
    out: dict[str, Any] = {"runs": len(runs), "reached": len(hits)}
    for key in ("step", "t_s"):
        xs = [float(r[key]) for r in hits]
        if xs:
            out[key] = {"mean": statistics.fmean(xs),
                        "sd": statistics.stdev(xs) if len(xs) > 1 else 0.0,
                        "min": min(xs), "max": max(xs)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--config", type=Path, default=ROOT / "examples" / "copy.toml")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_quickstart")
    p.add_argument("--results", type=Path, default=None,
                   help="results file (default OUT/results.json)")
    p.add_argument("--target", type=float, default=0.9,
                   help="pass@1 that counts as reached (copy.toml's up.stop_at)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--redo", action="store_true")
    a = p.parse_args()
    path = a.results or a.out / "results.json"
    saved = json.loads(path.read_text()) if path.exists() and not a.redo else {}
    key = " ".join(a.sets) or "as shipped"
    runs: list[dict[str, Any]] = saved.setdefault(key, [])
    for i in range(len(runs), a.runs):
        out = a.out / (key.replace(" ", "_").replace("/", "_") + f"-run{i}")
        cmd = [str(ROOT / ".venv" / "bin" / "sluice"), "up", str(a.config), "--fresh",
               "--set", f"run.output_dir={out}", "--set", "up.plot=false"]
        for kv in a.sets:
            cmd += ["--set", kv]
        print(f"== run {i + 1}/{a.runs} ({key})", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{out}.log", "w") as log:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
        r = {**time_to_target(read_jsonl(out / "eval.jsonl"), a.target), "rc": rc,
             "machine": machine()}
        runs.append(r)
        print(f"   {'reached' if r['reached'] else 'NOT reached'}: step {r['step']}, "
              f"{r['t_s'] or 0:.0f} s (exit {rc})", flush=True)
        save_results(path, saved)
    for name, rs in saved.items():
        s = spread(rs)
        print(f"\n{name}: reached pass@1>={a.target} in {s['reached']} of {s['runs']} runs")
        for k, unit in (("step", "steps"), ("t_s", "s")):
            if k in s:
                v = s[k]
                print(f"  {unit:<6} mean {v['mean']:.0f}  sd {v['sd']:.0f}  "
                      f"min {v['min']:.0f}  max {v['max']:.0f}")


if __name__ == "__main__":
    main()
