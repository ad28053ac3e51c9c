"""A generator too far behind the run's weights stops admitting until it has caught up.

Everything a generator samples more than ``trainer.max_staleness`` versions behind the
run's ``state.version`` is retired ``stale`` by the trainer: admitting more only churns
the gate (a livelock when its weights never load). Here a real `Generator` (the tiny
model's in-process engine, its control watcher and one producer) on a real redis-server
meets an announced version it cannot load (a wrong sha256): it must hold the cursor
still and say so, then resume on the first version it loads.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from pipeline.bus import control
from pipeline.bus.client import Bus
from pipeline.bus.codec import decode_entry
from pipeline.bus.schema import RolloutGroup, WeightsPublished
from pipeline.config import load_config
from pipeline.weights import FileTransport
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun
from tests.helpers import wait_for_async
from workers.generator import Generator

pytestmark = pytest.mark.integration


def test_a_generator_behind_by_more_than_max_staleness_stops_admitting_until_it_loads(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path,
        tiny_model_dir: Path) -> None:
    cfg = load_config(None, [
        f"run.name={run_name}", f"run.output_dir={tmp_path / 'out'}",
        f"bus.redis_url={redis_server.url}", "bus.block_ms=50", f"model.path={tiny_model_dir}",
        "model.init=''", "generation.num_generations=2", "generation.max_new_tokens=4",
        "generation.batch_groups=1", "trainer.groups_per_step=1", "trainer.max_staleness=1",
        "trainer.admission_window=100"])  # the gate never closes: only staleness may stop it
    gen = Generator(cfg, "g0")
    store = FileTransport(gen.weights.store.root, keep=10**6)  # the trainer's side

    def publish(version: int) -> WeightsPublished:
        shifted = {k: v + 0.01 * version if v.is_floating_point() else v.clone()
                   for k, v in gen.engine.model.state_dict().items()}  # type: ignore[attr-defined]
        return store.write(shifted, version=version, step=version)

    async def go() -> RolloutGroup:
        bus = Bus.connect(cfg.redis_url, run_name)
        stop = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []
        try:
            # v3 announced (state.version 3) but unloadable: the engine stays at v0
            await control.announce(bus, dataclasses.replace(publish(3), sha256="0" * 64))
            tasks = [asyncio.create_task(gen.watch_control(bus, stop)),
                     asyncio.create_task(gen.produce(bus, stop))]

            async def tried_to_load_three_times() -> bool:
                for t in tasks:
                    if t.done():
                        t.result()  # a crashed loop fails the test with its error
                return gen.rejected_weights >= 3

            await wait_for_async(tried_to_load_three_times, 60,
                                 lambda: f"three failed loads of v3 ({gen.info()})")
            state = await bus.state()
            assert state.get("cursor", 0) == 0, ("admitted while 3 versions behind", state)
            assert await bus.r.xlen(bus.keys.rollouts) == 0
            info = gen.info()
            assert info["waiting_for_weights"] is True and info["weights_behind"] == 3, info
            await control.announce(bus, publish(4))  # a version it can load
            await wait_for_async(lambda: bus.r.xlen(bus.keys.rollouts), 120,
                                 lambda: f"a group after v4 was announced ({gen.info()})")
            _id, fields = (await bus.r.xrange(bus.keys.rollouts, count=1))[0]
            group = decode_entry(fields)
            assert isinstance(group, RolloutGroup)
            assert gen.info()["waiting_for_weights"] is False
            return group
        finally:
            stop.set()
            for t in tasks:
                await asyncio.wait_for(t, 60)
            await bus.close()

    group = arun(go())
    assert gen.engine.version == 4
    for r in group.rollouts:  # decoded on the version it waited for, never on v0
        assert len(r.versions) and (r.versions == 4).all(), r.versions
