"""`pipeline.metrics`: names, what a role exposes, the endpoint, and the dashboard's names."""

from __future__ import annotations

import json
import re
import urllib.error
from pathlib import Path

import pytest

from pipeline.config import MetricsConfig, load_config
from pipeline.metrics import SPECS, MetricsPortError, RoleMetrics, exposed_names, start
from tests.helpers import loopback_listener
from tests.helpers import metric_value as value
from tests.helpers import scrape_metrics as scrape

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "sluice.json"


def test_names_are_prefixed_and_grouped_by_stage() -> None:
    stages = {"rollout", "sample", "batch", "eval", "perf", "bus", "archive"}
    assert all(s.name.split("_", 1)[0] in stages for s in SPECS)
    assert len({s.name for s in SPECS}) == len(SPECS)
    names = exposed_names()
    assert {"sluice_rollout_groups_total", "sluice_batch_staleness_bucket",
            "sluice_bus_group_lag", "process_resident_memory_bytes"} <= names
    assert all(n.startswith(("sluice_", "process_", "python_")) for n in names)


def test_a_port_in_use_fails_at_start_naming_metrics_port() -> None:
    busy = loopback_listener()
    try:
        port = busy.getsockname()[1]
        with pytest.raises(MetricsPortError) as e:
            start(MetricsConfig(port=port), "scorer", "scorer/scorer-0")
        assert "metrics.port" in str(e.value) and str(port) in str(e.value)
    finally:
        busy.close()


def test_port_zero_serves_nothing() -> None:
    m = start(MetricsConfig(), "generator", "generator/g0")
    assert m.url is None
    m.close()  # nothing to close: no error


def test_served_values_are_the_role_counters_and_move_with_them() -> None:
    free = loopback_listener()
    port = free.getsockname()[1]
    free.close()
    m = start(MetricsConfig(port=port), "scorer", "scorer/scorer-1")
    try:
        assert m.url == f"http://127.0.0.1:{port}/metrics"
        m.sync({"scored": 3, "filtered": 1, "reward_n": 10, "reward_sum": 4.0,
                "healthy": True, "reconnects": 0})
        first = scrape(m.url)
        assert value(first, "sluice_sample_groups_total", outcome="scored",
                     role="scorer", worker="scorer-1") == 3
        assert value(first, "sluice_sample_reward") == pytest.approx(0.4)
        assert value(first, "sluice_bus_healthy") == 1
        m.sync({"scored": 7, "filtered": 1, "reward_n": 20, "reward_sum": 10.0,
                "healthy": False, "reconnects": 2})
        second = scrape(m.url)
        assert value(second, "sluice_sample_groups_total", outcome="scored") == 7
        assert value(second, "sluice_sample_groups_total", outcome="filtered") == 1
        assert value(second, "sluice_sample_completions_total") == 20
        assert value(second, "sluice_sample_reward") == pytest.approx(0.6)  # (10-4)/(20-10)
        assert value(second, "sluice_bus_reconnects_total") == 2
        assert value(second, "sluice_bus_healthy") == 0
    finally:
        m.close()
    with pytest.raises(urllib.error.URLError):
        scrape(f"http://127.0.0.1:{port}/metrics")


def test_a_distilling_scorer_reports_the_teacher_kl_of_each_heartbeat_period() -> None:
    m = RoleMetrics("scorer", "scorer/scorer-0")

    def samples() -> dict:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in m.registry.collect() for s in fam.samples}

    m.sync({"teacher_kl_sum": 30.0, "teacher_tokens": 10, "teacher_errors": 1})
    assert value(samples(), "sluice_sample_teacher_kl") == pytest.approx(3.0)
    m.sync({"teacher_kl_sum": 40.0, "teacher_tokens": 20, "teacher_errors": 1})
    assert value(samples(), "sluice_sample_teacher_kl") == pytest.approx(1.0)  # 10 / 10
    m.sync({"teacher_kl_sum": 40.0, "teacher_tokens": 20, "teacher_errors": 3})
    assert value(samples(), "sluice_sample_teacher_kl") == pytest.approx(1.0)  # no tokens
    assert value(samples(), "sluice_sample_teacher_errors_total") == 3


def test_a_trainer_step_sets_gauges_and_observes_staleness_per_group() -> None:
    m = RoleMetrics("trainer", "trainer/trainer-0")
    row = {"step": 5, "version": 5, "tokens": 640, "loss": 0.25, "grad_norm": float("nan"),
           "reward": 0.5, "lr": 1e-4, "step_time_s": 0.3, "rollout_wait_s": 0.1}
    m.step(row, [0, 1, 1])
    m.step({**row, "step": 6, "version": 6}, [2])
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in m.registry.collect() for s in fam.samples}
    assert value(samples, "sluice_batch_steps_total") == 2
    assert value(samples, "sluice_batch_tokens_total") == 1280
    assert value(samples, "sluice_batch_step") == 6
    assert value(samples, "sluice_batch_loss") == 0.25
    assert value(samples, "sluice_batch_staleness_count") == 4
    assert value(samples, "sluice_batch_staleness_sum") == 4
    assert value(samples, "sluice_batch_staleness_bucket", le="0.0") == 1
    assert value(samples, "sluice_batch_staleness_bucket", le="1.0") == 3
    assert value(samples, "sluice_perf_step_seconds_count") == 2
    # a non-finite value leaves the gauge alone (never set here)
    assert not [k for k in samples if k[0] == "sluice_batch_grad_norm"]


def test_dashboard_queries_only_names_the_roles_expose() -> None:
    """deploy/grafana/sluice.json cannot drift from pipeline/metrics.py: every metric name
    in its queries is one a role's /metrics can show."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs and all(p["targets"] for p in dash["panels"])
    used = {n for e in exprs for n in re.findall(r"\b(?:sluice|process)_[a-z0-9_]+", e)}
    names = exposed_names()
    assert used - names == set()
    assert "sluice_rollout_groups" not in names  # the check sees a wrong suffix
    # the list: each has a panel
    for wanted in ("sluice_bus_stream_length", "sluice_bus_group_lag",
                   "sluice_bus_group_pending", "sluice_rollout_groups_total",
                   "sluice_batch_staleness_bucket", "sluice_batch_reward", "sluice_batch_loss",
                   "sluice_perf_step_seconds_bucket", "sluice_perf_weight_publish_seconds_bucket",
                   "sluice_perf_weight_apply_seconds_bucket", "sluice_bus_gate_in_flight",
                   "sluice_bus_leases_held", "sluice_bus_reconnects_total"):
        assert wanted in used, wanted


def test_metrics_config_bounds_and_defaults() -> None:
    cfg = load_config(None)
    assert cfg.metrics.port == 0 and cfg.metrics.host == "127.0.0.1" and cfg.up.metrics
    assert load_config(None, ["metrics.port=9100"]).metrics.port == 9100
    with pytest.raises(ValueError, match=r"metrics\.port"):
        load_config(None, ["metrics.port=70000"])
