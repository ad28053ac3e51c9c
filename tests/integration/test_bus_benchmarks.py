"""Smoke tests of the bus benchmarks (``--quick``: one small size, 1-second windows), run
as the lead runs them, ``python -m benchmarks.…`` from the repository root, so they
cannot rot: each starts its redis-servers and real scorer roles, prints its table with
a rate above zero for every arm (a window ends only once a group went through it; a
pipeline that moves nothing exits nonzero) and exits 0. Their numbers mean nothing on a
shared machine; the full runs are for that."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.integration


def run_benchmark(module: str, *args: str, timeout_s: float = 180) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def number(pattern: str, out: str) -> float:
    m = re.search(pattern, out)
    assert m, f"{pattern!r} not in:\n{out}"
    return float(m.group(1))


def test_bus_benchmark_quick_prints_both_paths_and_the_targets() -> None:
    out = run_benchmark("benchmarks.bus", "--quick", "--cluster-sizes", "2KB")
    assert "== 2 KB groups" in out
    for row in (r"sluice: 1 gen -> 1 scorer -> trainer", r"mp\.Queue: 1 producer -> consumer"):
        assert number(row + r"\s+(\d+\.\d+)", out) > 0, out  # groups/s
    ratio = number(r"sluice / mp\.Queue groups/s = (\S+)x \(target >= 2x: (?:met|not met)\)",
                   out)
    assert math.isfinite(ratio) and ratio > 0
    share = number(r"bus CPU per group = (\S+)% of it \(target <= 2%: (?:met|not met)\)", out)
    assert math.isfinite(share) and share > 0
    # the same pipeline on a 3-master Redis Cluster, the bus in 1 lane and in 3
    assert "== Redis Cluster, 3 masters, 2 KB groups ==" in out
    for p in (1, 3):
        assert number(rf"\n{p}\s+(\d+\.\d+)", out) > 0, out
    assert number(r"P=3 / P=1 groups/s = (\S+)x", out) > 0


def test_scorer_scaleout_quick_prints_the_scaling() -> None:
    out = run_benchmark("benchmarks.scorer_scaleout", "--quick")
    for k in (1, 2):
        assert number(rf"\n\s+{k}\s+(\d+\.\d+)", out) > 0, out  # groups/s with k scorers
    ratio = number(r"1 -> 2 scorers groups/s = (\S+)x \(target >= 1\.8x: (?:met|not met)\)",
                   out)
    assert math.isfinite(ratio) and ratio > 0
