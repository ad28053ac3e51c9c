"""Bad weight announcements reach a real generator: it keeps serving what it has.

docs/design.md §7: generators apply only strictly newer versions and refuse weights whose
sha256 does not match; the weight store refuses URIs outside its root. Here a real
`Generator` with the tiny model's in-process engine meets duplicate, reordered and
corrupt announcements (a wrong but well-formed sha256, missing files, a URI outside the
weights directory, a file that hashes right but is no safetensors file, tensors of the
wrong shape, an index that disagrees with its shards, undecodable control entries). For
each it keeps its version and its weights, counts the refusal in ``rejected_weights``
(what its heartbeat shows), and a later good announcement is still applied. Both paths
are covered: `Generator.apply` one announcement at a time, and `Generator.watch_control`
reading the control stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import msgpack
import pytest
import torch
from safetensors.torch import save

from pipeline.bus import control
from pipeline.bus.client import Bus
from pipeline.bus.codec import encode
from pipeline.bus.schema import SCHEMA_VERSION, WeightsPublished
from pipeline.config import Config, load_config
from pipeline.weights import INDEX, FileTransport
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun
from workers.generator import Generator

pytestmark = pytest.mark.integration


def _cfg(redis_server: EmbeddedRedis, run_name: str, tmp_path: Path, model: Path) -> Config:
    return load_config(None, [
        f"run.name={run_name}", f"run.output_dir={tmp_path / 'out'}",
        f"bus.redis_url={redis_server.url}", "bus.block_ms=50", f"model.path={model}",
        "model.init=''"])


def _weights(gen: Generator, shift: float) -> dict[str, torch.Tensor]:
    """The engine model's state moved by ``shift``: each version is recognisable."""
    return {k: v + shift if v.is_floating_point() else v.clone()
            for k, v in gen.engine.model.state_dict().items()}  # type: ignore[attr-defined]


def _serving(gen: Generator) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in gen.engine.model.state_dict().items()}  # type: ignore[attr-defined]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _publisher(gen: Generator) -> FileTransport:
    """The trainer's side of the generator's store; keeps every version (no pruning)."""
    return FileTransport(gen.weights.store.root, keep=10**6)


def _hand_made(store: FileTransport, version: int, shard: bytes,
               weight_map: dict[str, str] | None = None) -> WeightsPublished:
    """A version directory whose one shard is ``shard`` behind an index (mapping
    ``weight_map``), committed like a real one (manifest and announcement carry the
    true hashes): it passes every check of the store but loading."""
    name = "model-00001-of-00001.safetensors"
    index = {"metadata": {"total_size": len(shard)},
             "weight_map": weight_map or {"model.norm.weight": name}}
    return store.store.commit([(name, shard), (INDEX, json.dumps(index).encode())],
                              fmt="safetensors", version=version, step=version)


def _bad_announcements(gen: Generator, tmp_path: Path) -> dict[str, WeightsPublished]:
    """Every refusable announcement, each for a version newer than the one served."""
    store = _publisher(gen)
    good = store.write(_weights(gen, 2.0), version=2, step=2)
    wrong_shape = _weights(gen, 3.0)
    name = next(k for k, v in wrong_shape.items() if v.ndim == 2)
    wrong_shape[name] = wrong_shape[name][:, :-1].contiguous()
    elsewhere = FileTransport(tmp_path / "elsewhere").write(_weights(gen, 4.0),
                                                            version=4, step=4)
    return {
        "wrong-sha256": dataclasses.replace(good, sha256="0123456789abcdef" * 4),
        "missing-files": dataclasses.replace(good, version=3,
                                             uri=store.store.dir_for(3).as_uri()),
        "outside-the-store": elsewhere,
        "outside-via-dotdot": dataclasses.replace(
            elsewhere, version=5, uri=f"{store.store.root.as_uri()}/../../elsewhere/v00000004"),
        "not-a-file-uri": dataclasses.replace(good, version=6, uri="http://evil/v6"),
        "not-safetensors": _hand_made(store, 7, b"\x00" * 64 + b"not a safetensors file"),
        "wrong-shapes": store.write(wrong_shape, version=8, step=8),
        "unknown-engine-format": dataclasses.replace(good, version=9, format="nccl"),
        "index-disagrees": _hand_made(store, 6, save(_weights(gen, 5.0)),
                                      {"model.norm.weight": "model-00001-of-00001.safetensors"}),
    }


def test_generator_refuses_bad_weights_keeps_serving_and_applies_the_next_good_ones(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path,
        tiny_model_dir: Path) -> None:
    gen = Generator(_cfg(redis_server, run_name, tmp_path, tiny_model_dir), "g0")
    v1 = _publisher(gen).write(_weights(gen, 1.0), version=1, step=1)
    bad = _bad_announcements(gen, tmp_path)

    async def go() -> None:
        await gen.apply(v1)
        assert gen.engine.version == 1
        served = _serving(gen)
        assert _same(served, _weights(gen, 0.0))  # what the engine serves is v1 …
        published = _publisher(gen).load(v1)
        assert all(torch.equal(served[k], published[k]) for k in published)  # … as published
        for dup in (v1, dataclasses.replace(v1, t=9.0)):  # duplicates: nothing to do
            await gen.apply(dup)
        assert gen.rejected_weights == 0
        for i, (kind, msg) in enumerate(bad.items(), start=1):
            await gen.apply(msg)
            assert gen.engine.version == 1, kind
            assert _same(_serving(gen), served), f"{kind}: the served weights changed"
            assert gen.rejected_weights == i, kind
            assert gen.info()["rejected_weights"] == i
        v10 = _publisher(gen).write(_weights(gen, 10.0), version=10, step=10)
        await gen.apply(v10)
        assert gen.engine.version == 10
        assert _same(_serving(gen), _publisher(gen).load(v10))
        v11 = _publisher(gen).write(_weights(gen, 1.0), version=11, step=11)
        for old in (v1, bad["wrong-sha256"]):  # reordered: older than what is served
            await gen.apply(old)
        assert gen.engine.version == 10 and gen.rejected_weights == len(bad)
        await gen.apply(v11)
        assert gen.engine.version == 11

    arun(go())


def test_generator_watching_control_skips_corrupt_entries_and_applies_good_ones(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path,
        tiny_model_dir: Path) -> None:
    """The same through the control stream, plus entries no decoder accepts; the watcher
    must outlive all of them and still apply the good version announced last."""
    gen = Generator(_cfg(redis_server, run_name, tmp_path, tiny_model_dir), "g0")
    v1 = _publisher(gen).write(_weights(gen, 1.0), version=1, step=1)
    bad = _bad_announcements(gen, tmp_path)
    undecodable = [
        b"\xc1 not msgpack",
        msgpack.packb({**msgpack.unpackb(encode(v1)), "version": 12, "sha256": "xyz"}),
        msgpack.packb({**msgpack.unpackb(encode(v1)), "version": -1}),
        msgpack.packb({**msgpack.unpackb(encode(v1)), "version": 12, "schema": SCHEMA_VERSION + 1}),
        msgpack.packb({**msgpack.unpackb(encode(v1)), "version": "12"}),
    ]

    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        try:
            await control.announce(bus, v1)
            await control.announce(bus, v1)  # duplicate
            for msg in bad.values():
                await control.announce(bus, msg)
            for payload in undecodable:
                await bus.r.xadd(bus.keys.control, {b"m": payload})
            await bus.r.xadd(bus.keys.control, {b"other": b"field"})
            v12 = _publisher(gen).write(_weights(gen, 12.0), version=12, step=12)
            await control.announce(bus, v12)
            v11 = _publisher(gen).write(_weights(gen, 11.0), version=11, step=11)
            await control.announce(bus, v11)  # reordered: older, after newer
            await control.finish(bus, "max_steps")
            stop = asyncio.Event()
            await asyncio.wait_for(gen.watch_control(bus, stop), 30)  # ends on RunFinished
            assert stop.is_set()
            assert gen.engine.version == 12
            assert _same(_serving(gen), _publisher(gen).load(v12))
            assert gen.rejected_weights == len(bad)
            # a generator that (re)starts now catches up to the same version, announced
            # to it by the admission reply
            late = Generator(gen.cfg, "g1")
            await late.catch_up(bus, (await bus.admit_many(64, late.wid, 1000, 0)).version)
            assert late.engine.version == 12 and late.rejected_weights == 0
        finally:
            await bus.close()

    arun(go())
