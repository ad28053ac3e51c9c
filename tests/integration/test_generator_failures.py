"""A group whose generation fails for good is retired `dead` with its reason, never
half-written; the others of the same batch are appended whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.bus.client import Bus
from pipeline.bus.codec import decode_entry
from pipeline.bus.schema import RolloutGroup
from pipeline.config import load_config
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun
from workers.engines import Completion, EngineError, SamplingParams
from workers.generator import Generator

pytestmark = pytest.mark.integration


class FlakyEngine:
    """Independent requests (like the vLLM engine); the second prompt always fails."""

    independent_prompts = True
    version = 0

    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, prompts: list[list[int]], n: int,
                       params: SamplingParams) -> list[list[Completion]]:
        self.calls += 1
        if self.calls == 2:
            raise EngineError("20 attempts failed; last: connection refused")
        ids = np.array([5, 6, 1], dtype=np.int32)
        return [[Completion(ids, np.full(3, -1.0, np.float32), np.zeros(3, np.int32), "stop")
                 for _ in range(n)] for _ in prompts]

    def health(self) -> dict[str, Any]:
        return {"healthy": True}


def test_failed_group_retires_dead_with_reason_and_the_rest_are_appended(
        redis_server: EmbeddedRedis, run_name: str, tiny_model_dir: Path,
        tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.name={run_name}", f"run.output_dir={tmp_path}",
                             f"bus.redis_url={redis_server.url}",
                             f"model.path={tiny_model_dir}", "model.init=''",
                             "generation.num_generations=4"])
    gen = Generator(cfg, "g0")
    gen.engine = FlakyEngine()  # type: ignore[assignment]

    async def go() -> tuple[dict[str, int], list[Any], list[Any]]:
        bus = Bus.connect(cfg.redis_url, run_name)
        try:
            cursors = [c for c in [await bus.admit(16, gen.wid) for _ in range(3)]
                       if c is not None]
            await gen.generate_batch(bus, cursors)
            state = await bus.state()
            rollouts = [decode_entry(f) for _i, f in await bus.r.xrange(bus.keys.rollouts)]
            dlq = await bus.r.xrange(bus.keys.dlq)
            return state, rollouts, dlq
        finally:
            await bus.close()

    state, rollouts, dlq = arun(go())
    assert state["cursor"] == 3 and state["generating"] == 0
    assert state["retired"] == 1 and state["retired:dead"] == 1
    assert len(rollouts) == 2 and all(isinstance(g, RolloutGroup) for g in rollouts)
    assert all(len(g.rollouts) == 4 for g in rollouts)
    (_id, fields), = dlq
    assert b"connection refused" in fields[b"reason"] and fields[b"role"] == b"generator/g0"
    dead_id = fields[b"group_id"].decode()
    assert dead_id not in {g.group_id for g in rollouts}
    assert gen.info()["dead_groups"] == 1


def test_generator_with_no_reachable_server_reports_unhealthy_and_stops_cleanly(
        redis_server: EmbeddedRedis, run_name: str, tiny_model_dir: Path,
        tmp_path: Path) -> None:
    """Every vLLM server down: the generator waits (unhealthy in its heartbeat) instead of
    failing groups; on SIGTERM it gives up after the grace period, retires the admitted
    groups `dead` with the reason, and exits 0 with the books balanced."""
    import json
    import signal

    import redis

    from pipeline.bus.keys import Keys
    from pipeline.ports import free_port
    from tests.helpers import run_header, spawn_role, wait_for, write_config

    cfg = write_config(tmp_path / "g.toml", run_header(
        run_name, tmp_path / "run", redis_server.url, heartbeat_s=0.3) + f"""
[model]
path = "{tiny_model_dir}"
[generation]
engine = "vllm"
batch_groups = 2
[generation.vllm]
urls = ["http://127.0.0.1:{free_port()}"]
""")
    keys = Keys(run_name)
    r = redis.Redis.from_url(redis_server.url)
    gen = spawn_role("generate", cfg, name="g0", log=tmp_path / "gen.log")
    try:
        def beat() -> dict[str, Any]:
            raw = r.hget(keys.heartbeats("generator"), "generator/g0")
            return json.loads(raw) if raw else {}

        def log() -> str:
            return (tmp_path / "gen.log").read_text()[-2000:]

        wait_for(lambda: beat().get("healthy") is False, 60,
                 lambda: f"an unhealthy heartbeat\n{log()}")
        wait_for(lambda: int(r.hget(keys.state, "generating") or 0) == 2, 60,
                 lambda: f"two admitted groups waiting for a server\n{log()}")
        assert beat()["engine"]["servers_up"] == 0
        gen.send_signal(signal.SIGTERM)
        assert gen.wait(40) == 0, (tmp_path / "gen.log").read_text()[-2000:]
    finally:
        if gen.poll() is None:
            gen.kill()
    state = {k.decode(): int(v) for k, v in r.hgetall(keys.state).items()}
    assert state["cursor"] == 2 and state.get("generating", 0) == 0
    assert state["retired:dead"] == 2 and state["retired"] == 2
    reasons = [f[b"reason"].decode() for _i, f in r.xrange(keys.dlq)]
    assert len(reasons) == 2 and all("no vLLM server" in x for x in reasons), reasons


class BadValueEngine(FlakyEngine):
    """Independent requests; the second prompt's completions carry a value the scorer's
    decoder rejects: a NaN logprob, or a token id outside the model's vocabulary."""

    def __init__(self, bad: str) -> None:
        super().__init__()
        self.bad = bad

    async def generate(self, prompts: list[list[int]], n: int,
                       params: SamplingParams) -> list[list[Completion]]:
        self.calls += 1
        ids = np.array([5, 6, 1], dtype=np.int32)
        lp = np.full(3, -1.0, np.float32)
        if self.calls == 2 and self.bad == "nan_logprob":
            lp[1] = np.nan
        if self.calls == 2 and self.bad == "token_outside_vocab":
            ids = np.array([5, 1 << 30, 1], dtype=np.int32)
        return [[Completion(ids, lp, np.zeros(3, np.int32), "stop") for _ in range(n)]
                for _ in prompts]


@pytest.mark.parametrize("bad", ["nan_logprob", "token_outside_vocab"])
def test_group_its_consumer_would_reject_is_abandoned_dead_not_emitted(
        redis_server: EmbeddedRedis, run_name: str, tiny_model_dir: Path,
        tmp_path: Path, bad: str) -> None:
    """An honest generator whose engine yields a value the scorer's decoder rejects does
    not append it (the scorer would dead-letter it as undecodable, which retires nothing,
    and the group would hold a window slot for good): it abandons the group through the
    lease-checked ABANDON script, retired ``dead`` with the decoder's reason. The books
    balance with nothing of it left in flight, and every appended entry decodes with the
    limits the scorer uses."""
    from pipeline.bus.keys import SCORERS_GROUP
    from pipeline.runtime import limits
    from sluice.monitor import snapshot

    cfg = load_config(None, [f"run.name={run_name}", f"run.output_dir={tmp_path}",
                             f"bus.redis_url={redis_server.url}",
                             f"model.path={tiny_model_dir}", "model.init=''",
                             "generation.num_generations=4"])
    gen = Generator(cfg, "g0")
    gen.engine = BadValueEngine(bad)  # type: ignore[assignment]

    async def go() -> tuple[dict[str, Any], list[Any], list[Any]]:
        bus = Bus.connect(cfg.redis_url, run_name)
        try:
            await bus.ensure_group(bus.keys.rollouts, SCORERS_GROUP)  # its lag is in flight
            cursors = [c for c in [await bus.admit(16, gen.wid) for _ in range(3)]
                       if c is not None]
            await gen.generate_batch(bus, cursors)
            snap = await snapshot(bus)
            entries = [f for _i, f in await bus.r.xrange(bus.keys.rollouts)]
            return snap, entries, await bus.r.xrange(bus.keys.dlq)
        finally:
            await bus.close()

    snap, entries, dlq = arun(go())
    rollouts = [decode_entry(f, limits(cfg), expect=RolloutGroup) for f in entries]
    assert len(rollouts) == 2, [g.group_id for g in rollouts]
    c = snap["conservation"]
    assert c["by_reason"]["dead"] == 1 and c["retired"] == 1 and c["generating"] == 0
    assert c["cursor"] == 3 and c["in_flight"] == 2 and c["balanced"], c
    (_id, fields), = dlq
    reason = fields[b"reason"].decode()
    want = "NaN" if bad == "nan_logprob" else "outside"
    assert reason.startswith("invalid group") and want in reason, reason
    assert fields[b"group_id"].decode() not in {g.group_id for g in rollouts}
    assert gen.info()["dead_groups"] == 1
