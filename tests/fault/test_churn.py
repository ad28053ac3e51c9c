"""Fleet churn in CI (benchmarks/churn.py, shortened): generators and scorers started,
SIGTERMed and kill -9ed at random a few seconds apart while the run trains, on one Redis;
the run keeps training, no role crashes on its own, and the whole history audits clean
against Redis. The full benchmark (minutes per phase, with a no-churn baseline, on one
Redis and on a 3-master cluster) is in docs/guarantees.md."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.churn import run_phase
from pipeline.ports import free_port
from sluice.embedded import EmbeddedRedis

pytestmark = pytest.mark.fault


def test_churn_keeps_training_and_the_audit_clean(tmp_path: Path, tiny_model_dir: Path
                                                  ) -> None:
    seconds = 120.0 if os.environ.get("SLUICE_FAULTS") == "full" else 20.0
    with EmbeddedRedis(tmp_path / "redis", port=free_port(), appendonly=True) as server:
        row = run_phase(tmp_path / "run", tiny_model_dir, server.url, churn=True,
                        seconds=seconds, every=(1.5, 3.0), seed=1, heldout_n=0)
    print(f"[churn] {row}")
    assert row["audit_ok"], row["audit"]
    assert not row["bad_exits"], row["bad_exits"]
    assert row["trained_groups"] > 0  # it kept training through the churn
    assert row["starts"] + row["sigterm"] + row["kill9"] >= 4
