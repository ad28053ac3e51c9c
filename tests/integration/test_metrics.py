"""/metrics against a real Redis: the bus gauges, the heartbeat, a port in use at start."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
from pathlib import Path

import pytest
import redis

from pipeline.bus.client import Bus
from pipeline.bus.keys import SCORERS_GROUP, Keys
from pipeline.config import MetricsConfig
from pipeline.metrics import RoleMetrics
from pipeline.runtime import Heartbeat
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun
from tests.helpers import ROOT, loopback_listener, run_header
from tests.helpers import metric_value as value
from tests.helpers import scrape_metrics as scrape

pytestmark = pytest.mark.integration


def free_loopback_port() -> int:
    s = loopback_listener()
    port = s.getsockname()[1]
    s.close()
    return port


def test_bus_gauges_and_heartbeat_read_the_run(redis_server: EmbeddedRedis,
                                                run_name: str) -> None:
    """A served role reads length, lag and pending of the group it consumes, the dlq
    length and the gate from Redis on each beat; its heartbeat carries the URL."""
    r = redis.Redis.from_url(redis_server.url)
    k = Keys(run_name)
    r.xgroup_create(k.rollouts, SCORERS_GROUP, id="0", mkstream=True)
    for i in range(3):
        r.xadd(k.rollouts, {b"m": b"x%d" % i})
    r.xreadgroup(SCORERS_GROUP, "s0", {k.rollouts: ">"}, count=1)  # 1 pending, 2 lag
    r.xadd(k.dlq, {b"reason": b"test"})
    r.hset(k.state, mapping={"cursor": 9, "retired": 4, "retired:trained": 3,
                             "retired:dead": 1})
    r.close()
    m = RoleMetrics("scorer", "scorer/s0", groups=[("rollouts", SCORERS_GROUP)],
                    lengths=["rollouts", "dlq"], window=16)
    m.serve(MetricsConfig(port=free_loopback_port()))

    assert m.url is not None
    url = m.url
    samples: dict = {}

    async def beat_and_scrape() -> dict:
        nonlocal samples
        bus = Bus.connect(redis_server.url, run_name)
        hb = Heartbeat(bus, "scorer/s0", 1.0, lambda: {"scored": 5}, m)
        try:
            await hb.beat()
            samples = scrape(url)
            return (await bus.workers())["scorer/s0"]
        finally:
            await hb.stop(forget=True)  # the role's end: closes the endpoint too
            await bus.close()

    beat = arun(beat_and_scrape())
    assert beat["metrics"] == url and beat["scored"] == 5
    assert value(samples, "sluice_sample_groups_total", outcome="scored") == 5
    assert value(samples, "sluice_bus_stream_length", stream="rollouts") == 3
    assert value(samples, "sluice_bus_stream_length", stream="dlq") == 1
    assert value(samples, "sluice_bus_group_lag", stream="rollouts", group=SCORERS_GROUP) == 2
    assert value(samples, "sluice_bus_group_pending", stream="rollouts",
                 group=SCORERS_GROUP) == 1
    assert value(samples, "sluice_bus_gate_in_flight") == 5
    assert value(samples, "sluice_bus_gate_window") == 16
    assert value(samples, "sluice_bus_retired", reason="dead") == 1
    with pytest.raises(urllib.error.URLError):
        scrape(url)


def test_a_role_whose_metrics_port_is_in_use_exits_2_naming_it(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(run_header(run_name, tmp_path / "out", redis_server.url))
    busy = loopback_listener()
    port = busy.getsockname()[1]
    try:
        p = subprocess.run([sys.executable, "-m", "sluice.cli", "score", str(cfg),
                            "--set", f"metrics.port={port}"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    finally:
        busy.close()
    assert p.returncode == 2, p.stderr[-3000:]
    assert "metrics.port" in p.stderr and f"127.0.0.1:{port}" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
