"""One ACL user per role on a Redis Cluster: the rendered users loaded on every node of a
3-master cluster of the test's own, and a short `sluice up` in 3 lanes with each role
logged in as its own user; nothing is refused to anyone (every node's ACL LOG empty)."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from pipeline.bus.security import load_credentials_file
from sluice.acl import make_acl
from sluice.embedded import EmbeddedCluster
from tests.integration.test_security import short_run

pytestmark = pytest.mark.e2e

RUN = "aclcluster"


def load_users(port: int, acl_file: Path) -> None:
    """`sluice acl`'s users on one node, by ACL SETUSER (the cluster was created before
    any user existed); the ``default`` user, switched off, comes last."""
    r = redis.Redis(host="127.0.0.1", port=port)
    lines = [line.split() for line in acl_file.read_text().splitlines() if line.strip()]
    for _, name, *rules in sorted(lines, key=lambda w: w[1] == "default"):
        r.execute_command("ACL", "SETUSER", name, *rules)
    r.close()


def test_a_pipeline_in_three_lanes_runs_with_one_acl_user_per_role(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    rendered = make_acl(tmp_path / "acl", RUN)
    with EmbeddedCluster(tmp_path / "cluster", masters=3) as cluster:
        for port in cluster.ports:
            load_users(port, rendered.acl_file)
        admin = load_credentials_file(rendered.credentials_file)["admin"]
        bus = (f'credentials_file = "{rendered.credentials_file}"\ncluster = true\n'
               "partitions = 3")
        summary = short_run(tmp_path, RUN, cluster.url, tiny_model_dir, bus)
        assert summary["conservation"]["balanced"]
        for port in cluster.ports:  # nothing refused, on any master
            r = redis.Redis(host="127.0.0.1", port=port, username=admin.username,
                            password=admin.password)
            assert r.acl_log() == [], (port, r.acl_log())
            r.close()
