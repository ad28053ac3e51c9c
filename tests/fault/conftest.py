"""The fault tests' pipeline fixture: each test that takes ``pipeline`` runs twice."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.fault.harness import Pipeline


@pytest.fixture(params=["redis", "cluster"])
def pipeline(request: pytest.FixtureRequest, tmp_path: Path, tiny_model_dir: Path
             ) -> Pipeline:
    """The test on its own redis-server, and on the session's 3-master Redis Cluster with
    the bus in 3 lanes (`bus.partitions`)."""
    if request.param == "redis":
        return Pipeline(tmp_path, tiny_model_dir)
    cluster = request.getfixturevalue("redis_cluster")
    return Pipeline(tmp_path, tiny_model_dir, run=f"k{uuid.uuid4().hex[:8]}",
                    cluster=cluster, partitions=3)
