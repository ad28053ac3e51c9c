"""The deploy tests' shared fixture: one real Slurm cluster per test session
(`tests.deploy.slurm_cluster`: two nodes, each a host of its own), for the cluster's own
checks (test_slurm_hosts.py) and the rendered jobs (test_slurm.py)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.slurm_cluster import SlurmCluster, SlurmUnavailable, _alive, ensure_installed


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    try:
        ensure_installed()
    except SlurmUnavailable as e:
        pytest.skip(str(e))
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=2)
    try:
        try:
            cluster.start()
        except SlurmUnavailable as e:
            pytest.skip(str(e))
        yield cluster
    finally:
        pidfiles = list(cluster.started)
        net = cluster.net
        cluster.stop()
        pids = [int(p.read_text().split()[0]) for p in pidfiles if p.exists()]
        assert not [p for p in pids if _alive(p)], "a Slurm daemon outlived the session"
        if net is not None:
            left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                  timeout=30).stdout
            assert not [h for h in net.hosts.values() if h.netns in left], left
            assert not any(Path("/etc/netns", h.netns).exists() for h in net.hosts.values())
