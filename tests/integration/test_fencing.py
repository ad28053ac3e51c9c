"""The fence scripts themselves (`pipeline.bus.scripts.fenced`, `RAISE_FENCE`,
`pipeline.bus.fencing`), on a real redis-server.

A trainer write carrying an older generation than its slot's ``state.fence`` must act on
nothing: no ack, no counter, no announcement, no version, and no stored op result (a
stored result would make the audit read the refused call as done). A lane's own copy of
the fence is what its scripts check, so a raised lane refuses the old generation.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis

from pipeline.bus import control
from pipeline.bus.client import Bus
from pipeline.bus.codec import encode
from pipeline.bus.fencing import FencedOut
from pipeline.bus.keys import TRAINERS_GROUP
from pipeline.bus.schema import RunFinished, WeightsPublished
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun


def _w(version: int) -> WeightsPublished:
    return WeightsPublished(version=version, step=version, uri=f"file:///w/v{version}",
                            format="safetensors", sha256="", nbytes=0, t=0.0)


def _snapshot(url: str, run: str) -> dict[str, Any]:
    """Every key of the run with its content (streams: entries and pending), so that
    "nothing changed" is checked on everything, op results included."""
    r = redis.Redis.from_url(url)
    try:
        out: dict[str, Any] = {}
        for key in sorted(r.scan_iter(match=f"*{run}*")):
            kind = r.type(key)
            if kind == b"stream":
                groups = r.xinfo_groups(key)
                out[key] = (r.xrange(key), [(g["name"], g["pending"]) for g in groups])
            elif kind == b"hash":
                out[key] = r.hgetall(key)
            elif kind == b"string":
                out[key] = r.get(key)
            else:
                out[key] = kind
        return out
    finally:
        r.close()


async def _two_generations(url: str, run: str, partitions: int) -> tuple[Bus, Bus, list[str]]:
    """Trainer "old" took the lock (generation 1), then "new" (generation 2) after it;
    two scored entries are pending on the trainers' group in the last lane. Returns
    (old's bus, new's bus, the entries' ids)."""
    old = Bus.connect(url, run, partitions=partitions)
    new = Bus.connect(url, run, partitions=partitions)
    got, old.fence = (await old.trainer_lock("old", 60_000))[:2]
    assert got == "old"
    await old.raise_lane_fences(old.fence)
    await old.release_trainer_lock("old")
    got, new.fence = (await new.trainer_lock("new", 60_000))[:2]
    assert got == "new" and new.fence > old.fence
    await new.raise_lane_fences(new.fence)
    stream = _lane(new).scored
    await new.ensure_group(stream, TRAINERS_GROUP)
    ids = [await new.xadd(stream, b"x") for _ in range(2)]
    await new.r.xreadgroup(TRAINERS_GROUP, "trainer-0", {stream: ">"})
    await new.r.xadd(new.keys.control, {b"m": encode(RunFinished(reason="max_steps", t=0.0))})
    return old, new, ids


def _lane(bus: Bus) -> Any:
    """The last lane whose hash tag is not the run's own (with 3 lanes one may share it,
    when the run's slot falls in that lane's range: it depends on the random run name);
    with one lane, that lane."""
    return next((k for k in reversed(bus.lanes.keys) if k.state != bus.keys.state),
                bus.lanes.keys[-1])


@pytest.mark.parametrize("partitions", [1, 3])
def test_a_refused_write_changes_nothing_and_stores_no_result(
        redis_server: EmbeddedRedis, run_name: str, partitions: int) -> None:
    """Each fenced write of the older generation raises `FencedOut` and leaves every key
    of the run as it was; the same write by the current generation then takes effect
    (so the snapshot would have seen it)."""

    async def go() -> None:
        old, new, ids = await _two_generations(redis_server.url, run_name, partitions)
        stream = _lane(new).scored
        try:
            before = _snapshot(redis_server.url, run_name)
            refused = {
                "retire": lambda: old.retire(stream, TRAINERS_GROUP, ids, "trained", "op-1"),
                "ack": lambda: old.ack(stream, TRAINERS_GROUP, ids[0]),
                "announce": lambda: old.announce(encode(_w(7)), 7, maxlen=100),
                "set_version": lambda: old.set_version(7),
                "finish": lambda: control.finish(old, "max_steps"),
                "clear_finished": lambda: control.clear_finished(old),
            }
            for name, call in refused.items():
                with pytest.raises(FencedOut, match="refused"):
                    await call()
                assert _snapshot(redis_server.url, run_name) == before, name
            assert await new.retire(stream, TRAINERS_GROUP, ids, "trained", "op-1") == ids
            assert await control.clear_finished(new) == 1
            await new.announce(encode(_w(7)), 7, maxlen=100)
            assert (await new.state())["version"] == 7
            assert _snapshot(redis_server.url, run_name) != before
        finally:
            await old.close()
            await new.close()

    arun(go())


def test_a_raised_lane_refuses_the_old_generation(redis_server: EmbeddedRedis,
                                                  run_name: str) -> None:
    """A lane script reads only its lane's ``state`` (on a cluster it cannot read the
    global one): the old generation is refused there once the new holder raised that
    lane's fence, and a lane's fence never moves back."""

    async def go() -> None:
        old, new, ids = await _two_generations(redis_server.url, run_name, 3)
        lane = _lane(new)
        try:
            assert lane.state != new.keys.state
            assert int(await new.r.hget(lane.state, "fence")) == new.fence
            await old.raise_lane_fences(old.fence)  # a late, older raise: ignored
            assert int(await new.r.hget(lane.state, "fence")) == new.fence
            with pytest.raises(FencedOut):
                await old.retire(lane.scored, TRAINERS_GROUP, ids, "trained", "op-2")
            assert len(await new.r.xpending_range(lane.scored, TRAINERS_GROUP, "-", "+",
                                                  10)) == 2
            assert not [k async for k in new.r.scan_iter(match=f"*{run_name}*:op:*")]
            non_trainer = Bus.connect(redis_server.url, run_name, partitions=3)
            try:  # roles other than the trainer carry no token and are never refused
                assert await non_trainer.ack(lane.scored, TRAINERS_GROUP, ids[0]) == 1
            finally:
                await non_trainer.close()
        finally:
            await old.close()
            await new.close()

    arun(go())
