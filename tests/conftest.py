"""Shared fixtures: one real redis-server per test session, on a free loopback port.

The server is started by the session (loopback only, no persistence unless a test asks)
and stopped by PID at the end; each test gets its own run name, so keys never collide.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from pipeline.ports import free_port
from sluice.embedded import EmbeddedCluster, EmbeddedRedis

T = TypeVar("T")


def arun(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    srv = EmbeddedRedis(tmp_path_factory.mktemp("redis"), port=free_port(), appendonly=False)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedCluster]:
    """One real 3-master Redis Cluster per test session (loopback, no persistence)."""
    with EmbeddedCluster(tmp_path_factory.mktemp("cluster"), masters=3) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One real S3 server (SeaweedFS, `tests.seaweed`) per test session, on free loopback
    ports, with one access key; stopped by PID at the end. Each test makes its own bucket
    (`SeaweedFS.bucket`)."""
    from tests.seaweed import SeaweedFS

    with SeaweedFS(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture
def run_name() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.model import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct as a plain float32 model folder, converted once per session
    from the GGUF file in the wheel deploy/setup.sh downloads (`tests.smollm2`)."""
    from tests.smollm2 import smollm2_folder

    return smollm2_folder(tmp_path_factory.mktemp("smollm2"))
