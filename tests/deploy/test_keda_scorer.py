"""The KEDA scaler watches what the scorers really consume: a real scorer (its own code
path, `workers.scorer.Scorer.run`) on a real Redis with three lanes joins one consumer
group per lane; the (stream, group) pairs where it is a consumer must be exactly the
(stream, consumerGroup) of the rendered ScaledObject's triggers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis
import yaml

from pipeline.config import load_config
from sluice.deploy import render
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun
from tests.helpers import wait_for_async
from workers.scorer import Scorer

pytestmark = pytest.mark.integration


def test_keda_triggers_name_the_streams_and_group_the_scorer_reads(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path) -> None:
    sets = [f"run.name={run_name}", f"run.output_dir={tmp_path / 'run'}", "bus.partitions=3",
            "bus.block_ms=50"]
    config = tmp_path / "run.toml"
    config.write_text("")
    render(config, [*sets, "deploy.acl=false", "deploy.redis=external", "deploy.autoscale=true",
                    "bus.redis_url=redis://redis.invalid:6379/0", "run.output_dir=run"],
           "k8s", tmp_path / "k8s")
    docs = yaml.safe_load_all((tmp_path / "k8s" / "keda.yaml").read_text())
    scaled = next(d for d in docs if d["kind"] == "ScaledObject")
    watched = {(t["metadata"]["stream"], t["metadata"]["consumerGroup"])
               for t in scaled["spec"]["triggers"]}

    cfg = load_config(config, [*sets, f"bus.redis_url={redis_server.url}"])
    client = redis.Redis.from_url(redis_server.url)

    def consumed() -> set[tuple[str, str]]:
        """(stream, group) where the scorer under test is a consumer."""
        out = set()
        for key in client.scan_iter(f"sluice:{{{run_name}*}}:rollouts"):
            for g in client.xinfo_groups(key):
                names = {c["name"] for c in client.xinfo_consumers(key, g["name"])}
                if b"keda-probe" in names or "keda-probe" in names:
                    out.add((key.decode(), g["name"].decode()))
        return out

    async def go() -> set[tuple[str, str]]:
        stop = asyncio.Event()
        task = asyncio.create_task(Scorer(cfg, "keda-probe").run(stop))
        try:  # while it runs: a scorer that stops cleanly leaves its groups
            await wait_for_async(lambda: _ready(consumed, len(watched)), 60,
                                 lambda: f"the scorer to read every lane: {consumed()}")
            return consumed()
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)

    try:
        seen = arun(go())
    finally:
        client.close()
    assert len(watched) == 3
    assert seen == watched


async def _ready(consumed: object, n: int) -> bool:
    return len(consumed()) == n  # type: ignore[operator]
