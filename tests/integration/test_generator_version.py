"""A generator decodes an admitted batch on the version announced when it was admitted.

The ADMIT script returns ``state.version`` with the cursors, and the generator
applies any newer announced version (`Generator.apply`, the watcher's path) before it
decodes the batch. Here the control watcher does not run at all, so the admission reply
is the only way the generator learns of a version: a real `Generator` (the tiny model's
in-process engine) and a real redis-server; weights published through the file store
and announced on ``control`` as the trainer does; the gate opened by retiring the group
in flight, as the trainer does right after it announces a step's weights.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

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


def test_a_group_admitted_after_a_publish_is_decoded_entirely_on_the_new_version(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path,
        tiny_model_dir: Path) -> None:
    cfg = load_config(None, [
        f"run.name={run_name}", f"run.output_dir={tmp_path / 'out'}",
        f"bus.redis_url={redis_server.url}", "bus.block_ms=50", f"model.path={tiny_model_dir}",
        "model.init=''", "generation.num_generations=3", "generation.max_new_tokens=6",
        "generation.batch_groups=1", "trainer.groups_per_step=1",
        "trainer.max_staleness=0"])  # window 1: one group in flight at a time
    gen = Generator(cfg, "g0")
    store = FileTransport(gen.weights.store.root, keep=10**6)  # the trainer's side

    published: dict[int, WeightsPublished] = {}

    def publish(version: int) -> WeightsPublished:
        shifted = {k: v + 0.01 * version if v.is_floating_point() else v.clone()
                   for k, v in gen.engine.model.state_dict().items()}  # type: ignore[attr-defined]
        published[version] = store.write(shifted, version=version, step=version)
        return published[version]

    async def groups(bus: Bus) -> list[RolloutGroup]:
        out = [decode_entry(f) for _i, f in await bus.r.xrange(bus.keys.rollouts)]
        assert all(isinstance(g, RolloutGroup) for g in out)
        return out  # type: ignore[return-value]

    async def go() -> list[RolloutGroup]:
        bus = Bus.connect(cfg.redis_url, run_name)
        stop = asyncio.Event()
        producer: asyncio.Task[None] | None = None
        try:
            await control.announce(bus, publish(1))  # published before any admission
            assert gen.engine.version == 0
            producer = asyncio.create_task(gen.produce(bus, stop))  # no control watcher
            await wait_for_async(lambda: bus.r.xlen(bus.keys.rollouts), 120,
                                 "the first group to be appended")
            await wait_for_async(lambda: _gate_closed(gen), 60, "the generator to wait at "
                                 "the gate (window 1, one group in flight)")
            await control.announce(bus, publish(2))  # the trainer's next step …
            await bus.r.hincrby(bus.keys.state, "retired", 1)  # … retires, the gate opens
            await wait_for_async(lambda: _at_least(bus, 2), 120, "the second group")
            return await groups(bus)
        finally:
            stop.set()
            if producer is not None:
                await asyncio.wait_for(producer, 60)
            await bus.close()

    first, second = arun(go())[:2]
    assert first.group_id != second.group_id
    for g, version in ((first, 1), (second, 2)):
        assert len(g.rollouts) == 3
        for r in g.rollouts:
            assert len(r.versions) and (r.versions == version).all(), (g.group_id, r.versions)
    assert gen.engine.version == 2 and gen.rejected_weights == 0
    # and the engine serves exactly the published v2 weights
    served = gen.engine.model.state_dict()  # type: ignore[attr-defined]
    v2 = store.load(published[2])
    assert all(torch.equal(served[k], v2[k]) for k in v2)
    assert np.isfinite(np.concatenate([r.logprobs for r in second.rollouts])).all()


async def _gate_closed(gen: Generator) -> bool:
    return gen.gate_closed


async def _at_least(bus: Bus, n: int) -> bool:
    return await bus.r.xlen(bus.keys.rollouts) >= n
