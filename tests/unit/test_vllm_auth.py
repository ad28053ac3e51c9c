"""Every request sluice's vLLM clients send carries the servers' key; the guard loaded
into the servers refuses what does not (docs/security.md: vLLM servers).

The clients are checked against real loopback HTTP servers that record each request's
``Authorization`` header (the fakes of test_vllm_failover answer the engine's routes);
the real-vLLM side is tests/vllm/test_contract.py.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from pipeline.vllm_auth import APIKeyError, auth_headers, run_key, vllm_api_key
from pipeline.weights.nccl import NCCLWeightSync
from sluice.vllm_launch import ServerSpec
from tests.unit.test_vllm_failover import MODEL, PARAMS, FakeServer
from workers.engines.vllm import VLLMEngine
from workers.engines.vllm_guard import EXIT_PATH, MIDDLEWARE, RequireKey
from workers.teacher import VLLMTeacher

KEY = "s3cret-key-for-tests"


@asynccontextmanager
async def recording_fake() -> AsyncIterator[tuple[FakeServer, list[tuple[str, str]]]]:
    """A `FakeServer` on loopback that logs ``(path, Authorization header)`` per request."""
    fake, seen = FakeServer(), []

    async def handle(request: web.Request) -> web.Response:
        seen.append((request.path, request.headers.get("Authorization", "")))
        return await fake.handle(request)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    fake.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield fake, seen
    finally:
        await runner.cleanup()


def _unkeyed(seen: list[tuple[str, str]]) -> list[str]:
    return [p for p, auth in seen if auth != f"Bearer {KEY}"]


def test_the_engine_sends_the_key_on_every_request() -> None:
    async def go() -> None:
        async with recording_fake() as (fake, seen):
            e = VLLMEngine([fake.url], MODEL, seed=0, metrics_interval_s=0.05, api_key=KEY)
            await e.start()
            try:
                await e.generate([[1, 2]], 2, PARAMS)
                assert await e.load_weights("/weights/v1", 1)
                await asyncio.sleep(0.2)  # a few /metrics reads of the metrics loop
            finally:
                await e.close()
        paths = {p for p, _ in seen}
        assert {"/v1/models", "/metrics", "/inference/v1/generate", "/pause",
                "/collective_rpc", "/update_weight_version", "/resume"} <= paths
        assert _unkeyed(seen) == []

    asyncio.run(go())


def test_the_nccl_sync_and_the_teacher_send_the_key() -> None:
    async def go() -> None:
        async with recording_fake() as (fake, seen):
            sync = NCCLWeightSync([fake.url], "127.0.0.1", 29500, api_key=KEY)
            try:
                await sync._call(fake.url, "POST", "/pause", params={"mode": "keep"})
                await sync._call(fake.url, "POST", "/update_weights", {"update_info": {}})
            finally:
                await sync.close()
            teacher = VLLMTeacher([fake.url], [MODEL], api_key=KEY)
            await teacher.start()
            await teacher.close()
        assert {"/pause", "/update_weights", "/v1/models"} <= {p for p, _ in seen}
        assert _unkeyed(seen) == []

    asyncio.run(go())


def test_the_key_comes_from_the_file_then_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert vllm_api_key("") is None and auth_headers(None) == {}
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert vllm_api_key("") == "from-env"
    (tmp_path / "k").write_text("from-file\n")
    assert vllm_api_key(str(tmp_path / "k")) == "from-file"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(APIKeyError, match="holds no key"):
        vllm_api_key(str(tmp_path / "empty"))
    with pytest.raises(APIKeyError, match="cannot read"):
        vllm_api_key(str(tmp_path / "missing"))


def test_a_run_key_is_random_private_and_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    key = run_key(tmp_path / "vllm")
    assert len(key) >= 40
    assert stat.S_IMODE(os.stat(tmp_path / "vllm" / "api_key").st_mode) == 0o600
    assert run_key(tmp_path / "vllm") == key  # a resumed run keeps its key
    assert run_key(tmp_path / "other") != key
    monkeypatch.setenv("VLLM_API_KEY", "mine")  # the user's own key wins
    assert run_key(tmp_path / "third") == "mine" and not (tmp_path / "third").exists()


def test_a_keyed_server_gets_the_key_in_its_environment_never_its_command_line() -> None:
    spec = ServerSpec(python=sys.executable, model="m", api_key=KEY)
    cmd = spec.command(8000)
    assert not any(KEY in a for a in cmd)
    assert cmd[cmd.index("--middleware") + 1] == MIDDLEWARE
    assert spec.own_env("/c")["VLLM_API_KEY"] == KEY
    # a keyless spec (the user's own deployment) is unchanged: no guard, no key
    bare = ServerSpec(python=sys.executable, model="m")
    assert "--middleware" not in bare.command(8000) and "VLLM_API_KEY" not in bare.own_env("/c")


def _asgi(guard: RequireKey, path: str, auth: str | None, method: str = "GET") -> int:
    """Status the guard answers for one HTTP request (200: passed to the app)."""
    sent: list[dict[str, Any]] = []
    headers = [(b"authorization", auth.encode())] if auth is not None else []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    guard.app = app
    asyncio.run(guard({"type": "http", "path": path, "headers": headers, "method": method},
                      receive, send))
    return int(sent[0]["status"])


def test_the_guard_wants_the_key_on_every_path_but_health(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is not set"):
        RequireKey(lambda *a: None)  # type: ignore[arg-type,return-value]
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    guard = RequireKey(lambda *a: None)  # type: ignore[arg-type,return-value]
    for path in ("/collective_rpc", "/pause", "/tokenize", "/metrics", "/v1/completions"):
        assert _asgi(guard, path, None) == 401
        assert _asgi(guard, path, "Bearer wrong") == 401
        assert _asgi(guard, path, f"Basic {KEY}") == 401
        assert _asgi(guard, path, f"Bearer {KEY}") == 200
    assert _asgi(guard, "/health", None) == 200


def test_only_a_keyed_post_makes_the_server_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    """``POST /sluice/exit`` with the key: answered 202, then the server's exit hook runs
    (a real server: SIGTERM to itself, tests/vllm/test_tied.py); without the key, or as a
    GET, it never runs."""
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    exits: list[int] = []
    guard = RequireKey(lambda *a: None, on_exit=lambda: exits.append(1))  # type: ignore
    assert _asgi(guard, EXIT_PATH, None, "POST") == 401
    assert _asgi(guard, EXIT_PATH, "Bearer wrong", "POST") == 401
    assert exits == []
    assert _asgi(guard, EXIT_PATH, f"Bearer {KEY}", "GET") == 200  # vLLM's own 404 then
    assert exits == []
    assert _asgi(guard, EXIT_PATH, f"Bearer {KEY}", "POST") == 202
    assert exits == [1]


def test_a_keyed_server_can_import_the_guard_from_its_own_folder(tmp_path: Path) -> None:
    """The server runs in its workdir from `.venv-vllm`, where sluice is not installed:
    its environment must still find `workers.engines.vllm_guard`, or it exits at start."""
    py = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    if not py.exists():
        pytest.skip("no .venv-vllm")
    spec = ServerSpec(python=str(py), model="m", api_key=KEY)
    mod = MIDDLEWARE.rsplit(".", 1)[0]
    done = subprocess.run([str(py), "-c", f"import {mod}"], cwd=tmp_path,
                          env=spec.env(tmp_path / "cache"), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
