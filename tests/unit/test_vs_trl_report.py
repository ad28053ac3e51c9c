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


def test_series_are_binned_like_trl_logging_and_compared_at_the_same_steps() -> None:
    from benchmarks.vs_trl_report import binned, common_end_step, mechanism_at

    rows = [{"step": s, "entropy": float(s)} for s in range(1, 61)]
    series = binned(rows, every=25)
    # TRL logs the mean of steps 1..25 at step 25; a partial last bin at its own step
    assert [p["step"] for p in series] == [25, 50, 60]
    assert series[0]["entropy"] == 13.0 and series[2]["entropy"] == 55.5
    long_run = {"series": [{"step": s, "entropy": 1.0} for s in (25, 50, 75, 100, 400)]}
    short_run = {"series": [{"step": s, "entropy": 2.0} for s in (25, 50, 75, 100)]}
    res = {"trl": {"0": long_run}, "s1": {"0": short_run}}
    assert common_end_step(res) == 100
    # the long run's step-400 point lies past the common end: not in its "late" window
    assert mechanism_at(long_run["series"], 100) == {"early": {"entropy": 1.0},
                                                     "late": {"entropy": 1.0}}
    text = "\n".join(report({k: {"0": {**v["0"], "evals": [
        {"t": 0, "samples": 0, "step": 0, "exact": 0.0, "reward": 0.0}], "steps": 1,
        "profile": {}}} for k, v in res.items()}, 0.9, 100, 1000))
    assert "steps (0, 25] and (75, 100], the same for every run" in text


def test_arms_interleave_abba_and_ablations_have_trl_twins() -> None:
    import argparse

    from benchmarks.vs_trl import ABLATIONS, parse_arms, run_order

    assert run_order(["a", "b", "c"], [0, 1, 2]) == [
        ("a", 0), ("b", 0), ("c", 0), ("c", 1), ("b", 1), ("a", 1), ("a", 2), ("b", 2),
        ("c", 2)]
    arms = parse_arms(argparse.Namespace(
        arms="trl,trl2,s0,none,trl-none,mine,tmine",
        arm=["mine=trainer.lr=1e-3", "tmine=trl:learning_rate=1e-3;adam_beta1=0.8"]))
    assert arms["trl"].trl == {} and arms["trl2"].threads == 2
    assert arms["s0"].sets == {"trainer.max_staleness": "0"} and arms["s0"].trl is None
    assert arms["none"].sets == ABLATIONS["none"][0]
    assert arms["trl-none"].trl == {"scale_rewards": "none"}
    assert arms["mine"].sets == {"trainer.lr": "1e-3"}
    assert arms["tmine"].trl == {"learning_rate": "1e-3", "adam_beta1": "0.8"}


def test_trl_config_overrides_parse_literals_and_zero_std_splits() -> None:
    import numpy as np
    import pytest

    from benchmarks.trl_copy import config_overrides
    from trainer.stats import zero_std_split

    assert config_overrides(["scale_rewards=none", "use_adaptive_entropy=True",
                             "adam_beta1=0.8"]) == {
        "scale_rewards": "none", "use_adaptive_entropy": True, "adam_beta1": 0.8}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        config_overrides(["scale_rewards"])
    split = zero_std_split([np.ones(4), np.zeros(4), np.array([0.0, 1.0, 1.0, 1.0])], 1.0)
    assert split == pytest.approx({"frac_reward_zero_std": 2 / 3,
                                   "frac_reward_zero_std/solved": 1 / 3,
                                   "frac_reward_zero_std/stuck": 1 / 3})


def test_select_arms_keeps_the_named_arms_in_order_and_refuses_unknown_ones() -> None:
    import pytest

    from benchmarks.vs_trl import select_arms

    res = {"trl": {"0": {}}, "s1": {"0": {}}, "s0": {"0": {}}}
    assert select_arms(res, "") is res
    assert list(select_arms(res, "s1, trl")) == ["s1", "trl"]
    with pytest.raises(SystemExit, match=r"no runs of none .*arms there: trl, s1, s0"):
        select_arms(res, "trl,none")


def test_save_results_replaces_the_file_whole(tmp_path: Path) -> None:
    import json

    from benchmarks.vs_trl import save_results

    path = tmp_path / "results" / "r.json"
    save_results(path, {"runs": {"trl": {"0": {"steps": 1}}}})
    save_results(path, {"runs": {}})
    assert json.loads(path.read_text()) == {"runs": {}}
    assert sorted(p.name for p in path.parent.iterdir()) == ["r.json"]  # no temp left
