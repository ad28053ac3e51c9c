"""A vLLM server gone under a running generator: detected, recovered, nothing lost.

A real generator process drives the session's real server, with a real Redis. Weights
v1 (``model_b``) are announced before it starts, so it swaps them in at once. While
groups are in flight the server is asked to exit (``POST /sluice/exit``, what the
trainer does when a weight push is cut short with the server's workers in it:
`workers.engines.vllm_guard`); every process of its group ends within 30 s, and it is
started again on the same port (as `sluice up`'s `sluice.server_watch` does; it comes
back with ``model_a`` and no version label). Then:

- the generator's heartbeat reported itself unhealthy while the server was gone;
- the engine gave the returning server v1 again before using it (every token of every
  group carries version 1, and the server's label is "1");
- every admitted group was appended exactly once, whole, and none was retired dead.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request
from pathlib import Path
from typing import Any

import redis

from pipeline.bus import control
from pipeline.bus.client import Bus
from pipeline.bus.codec import decode_entry
from pipeline.bus.keys import Keys
from pipeline.bus.schema import RolloutGroup
from pipeline.model import load_model, model_state_for_publish
from pipeline.vllm_auth import auth_headers, vllm_api_key
from pipeline.weights import FileTransport
from sluice.embedded import EmbeddedRedis
from tests.helpers import run_header, spawn_role, wait_for, write_config
from tests.vllm.conftest import VLLMServer
from workers.engines.vllm import VLLMEngine
from workers.engines.vllm_guard import EXIT_PATH

WINDOW = 96
N = 8


def weight_label(url: str) -> str | None:
    try:
        req = urllib.request.Request(url + "/weight_info", headers=auth_headers(vllm_api_key()))
        with urllib.request.urlopen(req, timeout=2) as r:
            return str(json.loads(r.read())["weight_version"])
    except OSError:
        return None


def announce_v1(cfg_out: Path, srv: VLLMServer, redis_url: str, run: str) -> None:
    model, _ = load_model(srv.other_model_dir)
    msg = FileTransport(cfg_out / "weights").write(model_state_for_publish(model),
                                                   version=1, step=1)

    async def go() -> None:
        bus = Bus.connect(redis_url, run)
        try:
            await control.announce(bus, msg)
        finally:
            await bus.close()

    asyncio.run(go())


def test_killed_server_is_detected_and_recovered_without_losing_a_group(
        vllm_server: VLLMServer, redis_server: EmbeddedRedis, run_name: str,
        tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "g.toml", run_header(
        run_name, out, redis_server.url, heartbeat_s=0.3) + f"""
[model]
path = "{vllm_server.model_dir}"
[generation]
engine = "vllm"
num_generations = {N}
max_new_tokens = 128
batch_groups = 4
concurrent_batches = 4
[generation.vllm]
urls = ["{vllm_server.url}"]
backoff_max_s = 1.0
[trainer]
admission_window = {WINDOW}
""")
    announce_v1(out, vllm_server, redis_server.url, run_name)
    keys = Keys(run_name)
    r = redis.Redis.from_url(redis_server.url)
    gen = spawn_role("generate", cfg, name="g0", log=tmp_path / "generator.log")
    health: list[bool] = []

    def beat() -> dict[str, Any]:
        raw = r.hget(keys.heartbeats("generator"), "generator/g0")
        info = json.loads(raw) if raw else {}
        if info:
            health.append(bool(info.get("healthy")))
        return info

    try:
        wait_for(lambda: r.xlen(keys.rollouts) >= 2, 120, "the first groups")
        # the label is read over HTTP from a busy server (None when it does not answer
        # within 2 s): ask until it answers; what it must answer is "1"
        label = wait_for(lambda: weight_label(vllm_server.url), 60, "the server's label")
        assert label == "1", label
        assert vllm_server.local.proc is not None
        old_group = vllm_server.local.proc.pid
        ask = urllib.request.Request(vllm_server.url + EXIT_PATH, method="POST",
                                     headers=auth_headers(vllm_api_key()))
        with urllib.request.urlopen(ask, timeout=10) as answer:
            assert answer.status == 202
        proc = vllm_server.local.proc
        wait_for(lambda: proc.poll() is not None, 60, "the server to exit")  # and reaped
        wait_for(lambda: not _group_alive(old_group), 30, "the server's processes to end")
        vllm_server.local.stop(grace_s=0)  # reap it (what the watch does before a start)
        wait_for(lambda: beat().get("healthy") is False, 30, "the generator to report unhealthy")
        assert r.xlen(keys.rollouts) < WINDOW, "all groups finished before the kill"
        vllm_server.local.start().wait_ready(300)
        wait_for(lambda: weight_label(vllm_server.url) == "1", 60, "v1 to be re-applied")
        wait_for(lambda: beat().get("healthy") is True, 60, "the generator to recover")
        wait_for(lambda: r.xlen(keys.rollouts) == WINDOW, 180, "every admitted group")
        state = {k.decode(): int(v) for k, v in r.hgetall(keys.state).items()}
        info = beat()
    finally:
        gen.send_signal(signal.SIGTERM)
        gen.wait(60)
        _reset_server(vllm_server)

    log = (tmp_path / "generator.log").read_text()
    assert gen.returncode == 0, log[-3000:]
    assert False in health and health[-1] is True
    assert info["engine"]["retries"] >= 1 and info["dead_groups"] == 0, info
    assert state["cursor"] == WINDOW and state.get("generating", 0) == 0, state
    assert state.get("retired:dead", 0) == 0 and state.get("retired", 0) == 0, state
    groups = [decode_entry(f) for _id, f in r.xrange(keys.rollouts)]
    assert all(isinstance(g, RolloutGroup) for g in groups)
    ids = [g.group_id for g in groups]
    assert len(ids) == len(set(ids)) == WINDOW  # appended once each
    for g in groups:
        assert len(g.rollouts) == N  # whole groups only
        for ro in g.rollouts:
            assert (ro.versions == 1).all(), (g.group_id, ro.versions)


def _group_alive(pgid: int) -> bool:
    """Any process left in the killed server's group (its engine core, say)?"""
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _reset_server(srv: VLLMServer) -> None:
    """Leave the shared server as the other tests expect it: up, model_a, initial label
    (an engine's start reloads the base weights when the label is not its own)."""
    if srv.local.proc is None or srv.local.proc.poll() is not None:
        srv.local.start().wait_ready(300)

    async def go() -> None:
        e = VLLMEngine([srv.url], srv.model)
        await e.start()
        await e.close()

    asyncio.run(go())
