"""Failover orchestration of the vLLM engine against small fake vLLM servers.

The real-server behaviour is tested in tests/vllm; these fakes (aiohttp on loopback)
make failures happen on cue: a swap that fails half-way, a server answering 500. They
answer the routes the engine uses with the shapes vLLM 0.32 returns.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web

from workers.engines import EngineError, SamplingParams
from workers.engines.vllm import VLLMEngine

MODEL = "/models/tiny"
HALF = math.log(0.5)


class FakeServer:
    """Records every call; ``fail`` maps a path to how many more times it answers 500."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail: dict[str, int] = {}
        self.label = "default"
        self.paused = False
        self.fail_requests = False  # 500 for generate requests (not the 1-token probe)
        self.url = ""

    def _failing(self, path: str) -> bool:
        if self.fail.get(path, 0) > 0:
            self.fail[path] -= 1
            return True
        return False

    async def handle(self, request: web.Request) -> web.Response:
        path = request.path
        self.calls.append(path)
        if self._failing(path):
            return web.Response(status=500, text="boom")
        body: dict[str, Any] = await request.json() if request.can_read_body else {}
        if path == "/v1/models":
            return web.json_response({"data": [{"id": MODEL, "max_model_len": 512}]})
        if path == "/metrics":
            return web.Response(text='vllm:cache_config_info{kv_cache_size_tokens="8192"} 1\n'
                                     "vllm:kv_cache_usage_perc 0.9\n")
        if path == "/pause":
            self.paused = True
        elif path == "/resume":
            self.paused = False
        elif path == "/is_paused":
            return web.json_response({"is_paused": self.paused})
        elif path == "/update_weight_version":
            self.label = body["new_version"]
        elif path == "/weight_info":
            return web.json_response({"weight_version": self.label})
        elif path == "/inference/v1/generate":
            n = body["sampling_params"]["n"]
            ntok = body["sampling_params"]["max_tokens"]
            if self.fail_requests and ntok > 1:
                return web.Response(status=500, text="engine core died")
            content = [{"token_id": 5, "logprob": HALF,
                        "top_logprobs": [{"token_id": 5, "logprob": HALF},
                                         {"token_id": 6, "logprob": HALF}]}] * ntok
            return web.json_response({"choices": [
                {"index": i, "token_ids": [5] * ntok, "finish_reason": "length",
                 "logprobs": {"content": content},
                 "weight_versions": [{"version": self.label, "start": 0, "end": ntok}]}
                for i in range(n)]})
        return web.json_response({})


@asynccontextmanager
async def fakes(n: int) -> AsyncIterator[list[FakeServer]]:
    servers, runners = [], []
    for _ in range(n):
        fake = FakeServer()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", fake.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        fake.url = f"http://127.0.0.1:{port}"
        servers.append(fake)
        runners.append(runner)
    try:
        yield servers
    finally:
        for r in runners:
            await r.cleanup()


def engine(servers: list[FakeServer], **kw: Any) -> VLLMEngine:
    return VLLMEngine([s.url for s in servers], MODEL, seed=0, metrics_interval_s=0.05,
                      backoff_max_s=0.2, **kw)


PARAMS = SamplingParams(max_new_tokens=3)


def test_a_server_failing_its_swap_is_resumed_taken_out_and_resynced_before_rejoining(
        ) -> None:
    async def go() -> None:
        async with fakes(2) as (a, b):
            e = engine([a, b])
            await e.start()
            try:
                a.fail["/collective_rpc"] = 3  # the reload fails now and on two re-tries
                assert await e.load_weights("/weights/v1", 1)
                assert not a.paused and a.calls[-1] == "/resume"  # never left paused
                assert [s.healthy for s in e.servers] == [False, True]
                assert b.label == "1" and a.label == "default"
                a.calls.clear()
                out = await e.generate([[1, 2]] * 6, 2, PARAMS)  # all served by b
                assert "/inference/v1/generate" not in a.calls
                assert all((c.versions == 1).all() for g in out for c in g)
                assert e.health()["healthy"] is True  # b keeps the engine healthy
                for _ in range(100):  # recovery: probe, reconcile, reload v1, rejoin
                    if e.servers[0].healthy:
                        break
                    await asyncio.sleep(0.05)
                assert e.servers[0].healthy and a.label == "1" and e.servers[0].version == 1
            finally:
                await e.close()

    asyncio.run(go())


def test_failed_requests_move_to_another_server_then_give_up_after_the_attempts() -> None:
    async def go() -> None:
        async with fakes(2) as (a, b):
            e = engine([a, b], request_attempts=3)
            await e.start()
            try:
                a.fail["/inference/v1/generate"] = 1
                b.fail["/inference/v1/generate"] = 0
                out = await e.generate([[1, 2]], 4, PARAMS)
                assert len(out[0]) == 4 and e.retries == 1
                # both servers pass their health probe, then fail every real request:
                # the prompt fails after 3 attempts
                a.fail_requests = b.fail_requests = True
                with pytest.raises(EngineError, match="3 attempts failed"):
                    await asyncio.wait_for(e.generate([[1, 2]], 4, PARAMS), 30)
                assert e.failed_requests == 1
            finally:
                await e.close()

    asyncio.run(go())


def test_caps_shrink_under_kv_pressure_and_requests_wait_for_room() -> None:
    """kv usage 0.9 shrinks the cap 30% per read (16 -> 11 -> 7 ...); a request larger
    than the whole cap still runs on an idle server."""
    async def go() -> None:
        async with fakes(1) as (a,):
            e = engine([a])
            await e.start()
            try:
                assert e.servers[0].cap == 8192 // 512
                await asyncio.sleep(0.3)
                assert e.servers[0].cap < 16
                out = await e.generate([[1]], 32, PARAMS)
                assert len(out[0]) == 32
            finally:
                await e.close()

    asyncio.run(go())
