"""The monitor commands against a real Redis: `sluice status`, `sluice tail`, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from pipeline.codec import encode
from pipeline.embedded import EmbeddedRedis
from pipeline.keys import SCORERS_GROUP, Keys
from tests.helpers import ROOT, make_group

pytestmark = pytest.mark.integration


def sluice(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_status_json_reports_streams_groups_and_conservation(
        redis_server: EmbeddedRedis, run_name: str) -> None:
    r = redis.Redis.from_url(redis_server.url)
    k = Keys(run_name)
    r.xgroup_create(k.rollouts, SCORERS_GROUP, id="0", mkstream=True)
    r.hset(k.state, mapping={"cursor": 3, "retired": 1, "retired:filtered": 1,
                             "generating": 0, "version": 7})
    r.xadd(k.rollouts, {b"m": encode(make_group("0:1"))})
    r.xreadgroup(SCORERS_GROUP, "s0", {k.rollouts: ">"})  # one pending on s0
    r.xadd(k.rollouts, {b"m": encode(make_group("0:2"))})  # one not yet delivered
    r.close()
    p = sluice("status", "--json", "--set", f"bus.redis_url={redis_server.url}",
               "--set", f"run.name={run_name}")
    assert p.returncode == 0, p.stderr
    snap = json.loads(p.stdout)
    g = snap["groups"]["rollouts/scorers"]
    assert g["lag"] == 1 and g["pending"] == 1
    assert [c["name"] for c in g["consumers"]] == ["s0"]
    c = snap["conservation"]
    assert c["cursor"] == 3 and c["retired"] == 1 and c["in_flight"] == 2 and c["balanced"]
    text = sluice("status", "--set", f"bus.redis_url={redis_server.url}",
                  "--set", f"run.name={run_name}")
    assert text.returncode == 0 and "balanced" in text.stdout and "version 7" in text.stdout


def test_tail_prints_one_decoded_line_per_group(redis_server: EmbeddedRedis,
                                                run_name: str) -> None:
    r = redis.Redis.from_url(redis_server.url)
    k = Keys(run_name)
    r.xadd(k.rollouts, {b"m": encode(make_group("0:5", version=3))})
    r.xadd(k.rollouts, {b"m": b"\xc1 garbage"})
    r.close()
    p = sluice("tail", "rollouts", "--from-start", "--count", "2",
               "--set", f"bus.redis_url={redis_server.url}", "--set", f"run.name={run_name}")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 2
    assert "0:5" in lines[0] and "v3-3" in lines[0] and "'123='" in lines[0]
    assert "undecodable" in lines[1]


def test_bad_config_and_bad_arguments_fail_at_start_naming_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer]\nlrr = 1e-4\n")
    p = sluice("status", str(bad))
    assert p.returncode == 2 and "trainer.lrr" in p.stderr and "unknown key" in p.stderr
    p = sluice("train", str(tmp_path / "missing.toml"))
    assert p.returncode == 2 and "not found" in p.stderr
    p = sluice("status", "--set", "generation.top_p=7")
    assert p.returncode == 2 and "generation.top_p" in p.stderr
    p = sluice("tail", "nosuchstream")
    assert p.returncode == 2 and "invalid choice" in p.stderr
