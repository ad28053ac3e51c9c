"""The bus on a real 3-master Redis Cluster (`bus.cluster`): every key of a run on one
slot, clear errors at start for a cluster that is missing slots or a client that was not
told it talks to one, and a whole `sluice up` run on the cluster with a clean audit."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest
import redis

from pipeline.bus.client import Bus
from pipeline.bus.connection import ClusterModeError, check_cluster
from pipeline.config import ConfigError, load_config
from pipeline.ports import free_port
from sluice.embedded import EmbeddedCluster, EmbeddedRedis
from tests.helpers import ROOT, run_up, up_args


def master_of(cluster: EmbeddedCluster, key: str) -> int:
    """The port of the master serving ``key``'s slot, asked of the cluster itself."""
    client = redis.RedisCluster.from_url(cluster.url)
    try:
        return int(client.get_node_from_key(key).port)
    finally:
        client.close()


def test_a_healthy_cluster_passes_the_start_check(redis_cluster: EmbeddedCluster) -> None:
    assert check_cluster(redis_cluster.url) == 3


def test_cluster_mode_against_a_plain_redis_fails_at_start(redis_server: EmbeddedRedis) -> None:
    with pytest.raises(ClusterModeError, match=r"not a cluster node.*bus\.cluster = false"):
        check_cluster(redis_server.url)


def test_a_cluster_missing_slots_fails_at_start(tmp_path: Path) -> None:
    """Cluster-enabled nodes that were never given slots: cluster_state fail."""
    node = EmbeddedRedis(tmp_path / "n", port=free_port(), appendonly=False,
                         extra_args=["--cluster-enabled", "yes", "--cluster-port", str(free_port()),
                                     "--cluster-config-file",
                                     str(tmp_path / "n" / "nodes.conf")])
    with node:
        with pytest.raises(ClusterModeError, match=r"0 of 16384 slots assigned"):
            check_cluster(node.url)


def test_a_plain_client_on_a_cluster_is_told_to_set_bus_cluster(
        redis_cluster: EmbeddedCluster) -> None:
    """The first node serves only a third of the slots: a run whose keys hash elsewhere
    gets MOVED, reported as the config key to set rather than a redis-py error."""
    first = redis_cluster.ports[0]
    run = next(f"moved{i}" for i in range(100)
               if master_of(redis_cluster, f"sluice:{{moved{i}}}:state") != first)

    async def main() -> None:
        bus = Bus.connect(redis_cluster.url, run)
        try:
            with pytest.raises(ClusterModeError, match=r"bus\.cluster = true"):
                await bus.retrying(bus.state, "state")
        finally:
            await bus.close()

    asyncio.run(main())


def test_bus_cluster_needs_a_tcp_url() -> None:
    with pytest.raises(ConfigError, match=r"bus\.cluster"):
        load_config(None, ["bus.cluster=true"])
    assert load_config(None, ["bus.cluster=true", "bus.redis_url=redis://127.0.0.1:7000"]
                       ).bus.cluster


@pytest.mark.e2e
def test_sluice_up_with_three_lanes_spreads_over_the_masters_and_audits_clean(
        tmp_path: Path, redis_cluster: EmbeddedCluster) -> None:
    """`bus.partitions = 3` on the 3-master cluster: each lane's keys on its own master,
    the run trains, conservation and the whole-history audit hold; resuming the run with
    another partition count is refused at start, naming the key.

    12 steps (96 groups: global cursor c goes to lane c % 3, so every lane trains ~32),
    16 held-out prompts and no plot: nothing here measures learning (40 steps and 256
    prompts took 190 s against 116 s, the two run side by side on a loaded 2-core machine)."""
    steps = 12
    out = tmp_path / "run"
    cfg = tmp_path / "c.toml"
    cfg.write_text((ROOT / "examples" / "copy.toml").read_text())
    args = up_args(cfg, out, tmp_path / "model", "oncluster", f"trainer.max_steps={steps}",
                   f"bus.redis_url={redis_cluster.url}", "bus.cluster=true",
                   "bus.partitions=3", "run.max_time_s=300", "task.heldout=16",
                   "up.plot=false")
    proc, summary = run_up(args, out, tmp_path, 420)
    c = summary["conservation"]
    assert summary["steps"] == steps and c["balanced"], summary
    assert c["by_reason"]["trained"] == steps * 8
    assert "ledger audit" in proc.stderr and ": OK:" in proc.stderr, proc.stderr[-3000:]
    client = redis.RedisCluster.from_url(redis_cluster.url)
    try:
        keys = [k.decode() for k in client.scan_iter(match="sluice:{oncluster*}:*",
                                                     target_nodes=redis.RedisCluster.ALL_NODES)]
        scored = sorted(k for k in keys if k.endswith(":scored"))
        assert len(scored) == 3, keys
        # every lane has trained groups, and the three lanes sit on three masters
        assert all(client.xinfo_groups(k)[0]["entries-read"] > 0 for k in scored)
    finally:
        client.close()
    assert len({master_of(redis_cluster, k) for k in scored}) == 3
    for k in keys:  # each key on the master of its own lane's tag
        tag = k[k.index("{") + 1:k.index("}")]
        assert master_of(redis_cluster, k) == master_of(redis_cluster, f"{{{tag}}}")

    again = [a.replace("bus.partitions=3", "bus.partitions=1") for a in args]
    fail = subprocess.run(again, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert fail.returncode == 2, fail.stderr[-2000:]
    assert "bus.partitions = 1, but this run was created with 3" in fail.stderr
