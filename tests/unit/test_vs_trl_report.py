"""benchmarks/vs_trl_report.py on made-up runs: every section renders, the areas pair the
seeds, and the mechanism summary reads each run's first and last quarter."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from benchmarks.vs_trl import parts_of, pick_metric, watch
from benchmarks.vs_trl_report import common_samples, mechanism, report


def _run(rate: float) -> dict:
    evals = [{"t": t, "samples": t * 1000, "step": t * 10, "exact": min(1.0, rate * t / 2),
              "reward": min(1.0, rate * t)} for t in range(0, 101, 10)]
    rows = [{"step": s, "entropy": 1.0 - s / 1000, "grad_norm": 2.0} for s in range(1000)]
    return {"evals": evals, "steps": 1000, "profile": {"trainer": 1.0}, "mech": mechanism(rows)}


def test_the_report_renders_every_section_and_pairs_seeds() -> None:
    res = {"trl": {"0": _run(0.005), "1": _run(0.006)},
           "s1": {"0": _run(0.008), "1": _run(0.009)}}
    text = "\n".join(report(res, target=0.9, budget_s=100, samples=100_000))
    assert "area under the held-out reward curve" in text
    assert "vs trl: +" in text  # s1 learns faster on both seeds: a positive paired gain
    assert "mechanism:" in text and "held-out reward against s" in text


def test_mechanism_means_early_and_late_quarters() -> None:
    m = mechanism([{"step": s, "entropy": float(s), "clip_ratio/region_mean": math.nan}
                   for s in range(8)])
    assert m["early"]["entropy"] == 0.5 and m["late"]["entropy"] == 6.5
    assert "clip_ratio/region_mean" not in m["late"]  # NaN only: omitted
    assert mechanism([]) == {}


def test_runs_are_reported_by_any_stored_figure_and_watch_sends_the_stop_signal(
        tmp_path: Path) -> None:

    row = {"t": 0.0, "pass@1": 0.25, "reward": 0.5, "rewards/a": 0.75, "eval_s": 3.0}
    assert parts_of(row) == {"pass@1": 0.25, "reward": 0.5, "rewards/a": 0.75}
    res = {"trl": {"0": {"evals": [{"reward": 0.5, "parts": parts_of(row)}, {"reward": 0.1}]}}}
    pick_metric(res, "rewards/a")
    assert [e["reward"] for e in res["trl"]["0"]["evals"]] == [0.75, 0.1]  # old rows kept

    # a run stopped with SIGINT (sluice up's orderly end) sees SIGINT, not SIGTERM
    seen = tmp_path / "seen"
    code = ("import signal, sys, time\n"
            f"def got(n, f):\n    open({str(seen)!r}, 'w').write(str(n)); sys.exit(0)\n"
            "signal.signal(signal.SIGINT, got)\nsignal.signal(signal.SIGTERM, got)\n"
            "open(" + repr(str(seen) + ".ready") + ", 'w').close()\ntime.sleep(60)\n")
    proc = psutil.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL)
    ready = Path(str(seen) + ".ready")
    watch(proc, lambda: ready.exists(), every_s=0.1, stop_signal=signal.SIGINT)
    assert seen.read_text() == str(int(signal.SIGINT))


def test_the_samples_window_is_what_every_unfinished_run_covers() -> None:
    short = _run(0.005)
    short["evals"] = short["evals"][:8]  # ended at 70k samples, below the target
    done = _run(0.05)  # exact 0.9+ by t=40: stopped because it was done
    done["evals"] = done["evals"][:5]
    res = {"trl": {"0": _run(0.005), "1": short}, "s1": {"0": done, "1": _run(0.006)}}
    assert common_samples(res, target=0.9) == 70_000
    assert common_samples({}, target=0.9) == 0.0
