"""Hostile input on every consumer of the bus, on one Redis and on a 3-master cluster.

tests/integration/test_bad_input.py puts one malformed entry at a time between good ones;
this sends the entries a hostile or broken writer could append all at once, to every
role that reads the bus, through the roles' own reading code in-process: the scorer
(`Scorer.process` on ``rollouts``), the trainer's reader (`Reader.collect` on ``scored``),
the archiver (`Archiver.take` on ``scored``) and the control watch every generator, the
scorer and the evaluator follow (`pipeline.bus.control`). The entries: 10,000 fields
(an entry whose copy once could not be dead-lettered: Lua's ``unpack`` refuses that many
values, so the reader crashed on it at every restart), a 100 MB field (well under Redis's
default ``proto-max-bulk-len`` of 512 MB, which the embedded servers keep), wrong types,
a forged group id (that of a group in flight, on an entry that does not decode), NaN /
inf / overflowing rewards and advantages, negative and out-of-vocabulary token ids, an
empty group; and entries that are odd but valid: a completion with no tokens.

What must hold afterwards (docs/guarantees.md, "Bad input never stops a role"): no role
raised; the good entries sent after the bad ones were handed on / buffered / held /
yielded; every bad entry is in the dlq with its reason and a bounded copy of its fields
(`pipeline.bus.dlq.DLQ_MAX_BYTES`); the books balance (``cursor == retired +
in_flight``, the undecodable entries counted apart in ``state.undecodable`` and never as
retirements); and the ledger audit of the whole history, against Redis, is clean.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from pipeline.bus import control
from pipeline.bus.audit import audit, live_view, pending_intents
from pipeline.bus.client import Bus
from pipeline.bus.codec import FIELD, encode
from pipeline.bus.dlq import DLQ_MAX_BYTES
from pipeline.bus.keys import ARCHIVERS_GROUP, SCORERS_GROUP, TRAINERS_GROUP
from pipeline.bus.ledger import Ledger, read_ledgers
from pipeline.bus.schema import RunFinished, WeightsPublished
from pipeline.config import Config, load_config
from pipeline.runtime import limits
from sluice.monitor import snapshot
from tests.conftest import arun
from tests.helpers import make_group
from tests.integration.test_bad_input import COMMON, SCORED_ONLY, _mutated, _poison
from trainer.reader import Reader
from workers.archiver import Archiver
from workers.scorer import Scorer

pytestmark = pytest.mark.integration

MAX_BYTES = 4096  # bus.max_message_bytes: an honest group here is ~600 bytes
BIG_BYTES = 100 * 2**20  # the one huge field
MANY_FIELDS = 10_000
VERSION = 2  # the trainer's weight version; max_staleness 1
RUN_PREFIX = "sluice:{"


def _huge_map(stream: str, gid: str) -> dict[bytes, bytes]:
    """A well-formed map naming a group in flight, 100 MB long."""
    return {FIELD: msgpack.packb({"schema": 3, "type": stream[:-1], "gid": gid,
                                  "pad": b"\0" * BIG_BYTES}, use_bin_type=True)}


def _many_fields(with_m: bool) -> Callable[[str, str], dict[bytes, bytes]]:
    def make(stream: str, gid: str) -> dict[bytes, bytes]:
        fields = {b"f%05d" % i: b"x" * 8 for i in range(MANY_FIELDS)}
        if with_m:  # a forged group id on an entry that does not decode
            del fields[b"f00000"]
            fields[FIELD] = msgpack.packb({"schema": 99, "type": "rollout", "gid": gid})
        return fields
    return make


def _forged(stream: str, gid: str) -> dict[bytes, bytes]:
    """An undecodable entry (wrong schema) claiming a group in flight."""
    return {FIELD: msgpack.packb({"schema": 3, "type": "scored" if stream == "scored"
                                  else "rollout", "gid": gid, "ro": "no"}, use_bin_type=True)}


def _huge_f32(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    """A float64 value beyond float32 range, stored as float32 (inf), as a writer that
    casts an overflowing reward would."""
    with np.errstate(over="ignore"):
        return _poison(path, 0, float(np.float32(np.float64(1e300))), "<f4")


# name -> (fields maker (stream, claimed gid), dlq reason regex)
Case = tuple[Callable[[str, str], dict[bytes, bytes]], str]
HOSTILE: dict[str, Case] = {
    "10k-fields-forged-gid": (_many_fields(True), r"unknown schema version 99"),
    "10k-fields-no-m": (_many_fields(False), r"stream entry has no b'm' field"),
    "100MB-field": (_huge_map, rf"payload of \d+ bytes exceeds {MAX_BYTES}"),
    "forged-gid": (_forged, r"ro: expected list, got str"),
    **{k: (COMMON[k].make, COMMON[k].reason) for k in (
        "wrong-type-array", "nan-logprob", "negative-token-id", "token-id-at-vocab",
        "prompt-id-above-vocab", "no-rollouts", "malformed-msgpack", "other-message-type")},
}
SCORED_HOSTILE: dict[str, Case] = {
    **HOSTILE,
    **{k: (SCORED_ONLY[k].make, SCORED_ONLY[k].reason) for k in (
        "nan-reward", "inf-reward", "inf-advantage", "inf-reward-part", "wrong-type-scalar")},
    "overflowing-reward": (_mutated(_huge_f32(("rew",))), r"\.rew: contains NaN or inf"),
}


def _empty_completion(gid: str) -> Any:
    """A valid group whose second completion has no tokens (the engine returned none)."""
    g = make_group(gid, version=VERSION)
    r = g.rollouts[1]
    r.completion_ids, r.logprobs = r.completion_ids[:0], r.logprobs[:0]
    r.versions, r.mask, r.text, r.finish_reason = r.versions[:0], r.mask[:0], "", "length"
    return g


@pytest.fixture(params=["redis", "cluster"])
def bus_url(request: pytest.FixtureRequest) -> Iterator[tuple[str, bool, int]]:
    """(url, cluster, partitions): one Redis with one lane, or the 3-master cluster with
    three lanes, one per master."""
    if request.param == "redis":
        yield request.getfixturevalue("redis_server").url, False, 1
    else:
        yield request.getfixturevalue("redis_cluster").url, True, 3


def _cfg(url: str, cluster: bool, partitions: int, run: str, out: Path, model: Path
         ) -> Config:
    return load_config(None, [
        f"run.name={run}", f"run.output_dir={out}", f"bus.redis_url={url}",
        f"bus.cluster={str(cluster).lower()}", f"bus.partitions={partitions}",
        "bus.block_ms=20", f"bus.max_message_bytes={MAX_BYTES}", f"model.path={model}",
        "model.init=''", "trainer.groups_per_step=64", "trainer.max_staleness=1",
        "archive.enabled=true", "archive.file_s=3600"])


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="sluice")


async def _admit_emit(bus: Bus, ledger: Ledger, groups: list[Callable[[str], Any]]
                      ) -> list[str]:
    """Admit one cursor per group and append it as a generator does (EMIT under its
    lease), writing the generator's ledger lines; returns the group ids."""
    got = await bus.admit_many(64, "generator/g", 60_000, len(groups))
    assert len(got.cursors) == len(groups)
    gids = []
    for c, make in zip(got.cursors, groups, strict=True):
        gid = f"0:{c}"
        ledger.write("admitted", gid, cursor=c, gate_wait_s=0.0)
        (new_id,) = await bus.emit_many([(c, encode(make(gid)), f"emit:{c}")], "generator/g")
        assert new_id
        ledger.write("emitted", gid, cursor=c, id=new_id)
        gids.append(gid)
    return gids


Sent = dict[tuple[str, str], tuple[str, dict[bytes, bytes]]]


async def _hostile(bus: Bus, name: str, cases: dict[str, Case], claim: str) -> Sent:
    """XADD every case straight onto stream ``name`` (its lanes in turn, as a writer
    that bypasses the scripts would); (stream key, entry id) -> (case, fields)."""
    sent: Sent = {}
    streams = bus.lanes.streams(name)
    for i, (case, (make, _reason)) in enumerate(cases.items()):
        fields = make(name, claim)
        stream = streams[i % len(streams)]
        sent[(stream, (await bus.r.xadd(stream, fields)).decode())] = (case, fields)
    return sent


async def _lag(bus: Bus, name: str, group: str) -> int:
    view = (await bus.stream_stats([], [(name, group)]))[1][(name, group)]
    return int(view.lag or 0)


async def _dlq(bus: Bus) -> dict[tuple[str, str], dict[bytes, bytes]]:
    """Every lane's dlq, by (source stream, source entry id): ids of different lanes'
    streams (on different masters) can be equal."""
    out: dict[tuple[str, str], dict[bytes, bytes]] = {}
    for stream in bus.lanes.streams("dlq"):
        for _i, f in await bus.r.xrange(stream):
            out[(f[b"src"].decode(), f[b"src_id"].decode())] = f
    return out


def _check_dlq(dlq: dict[tuple[str, str], dict[bytes, bytes]],
               sent: Sent, cases: dict[str, Case], role: str) -> None:
    for where, (case, fields) in sent.items():
        d = dlq.get(where)
        assert d is not None, f"{case} ({where}) not in the dlq"
        reason = d[b"reason"].decode()
        assert re.search(cases[case][1], reason), f"{case}: {reason!r}"
        assert d[b"role"].startswith(role.encode())
        assert int(d[b"nfields"]) == len(fields), case
        assert int(d[b"nbytes"]) == sum(len(k) + len(v) for k, v in fields.items()), case
        kept = {k[len(b"orig:"):]: v for k, v in d.items() if k.startswith(b"orig:")}
        assert sum(len(k) + len(v) for k, v in d.items()) <= DLQ_MAX_BYTES + 1024, case
        if int(d[b"nbytes"]) <= DLQ_MAX_BYTES // 2 and len(fields) <= 8:
            assert kept == fields and d[b"truncated"] == b"0", case  # small: whole
        else:
            assert d[b"truncated"] == b"1", case
            assert all(fields[k].startswith(v) for k, v in kept.items()), case


async def _cleanup(bus: Bus, run: str) -> None:
    """Delete the run's keys (the servers are shared by the session: 100 MB entries)."""
    async for key in bus.r.scan_iter(match=f"{RUN_PREFIX}{run}*"):
        await bus.r.delete(key)


def test_hostile_entries_cost_one_entry_each_and_the_books_balance(
        bus_url: tuple[str, bool, int], run_name: str, tmp_path: Path,
        tiny_model_dir: Path) -> None:
    url, cluster, partitions = bus_url
    cfg = _cfg(url, cluster, partitions, run_name, tmp_path, tiny_model_dir)
    t0 = time.monotonic()

    async def go() -> None:
        bus = Bus.connect(url, run_name, cluster=cluster, partitions=partitions)
        try:
            await pipeline(bus)
        finally:
            await _cleanup(bus, run_name)
            await bus.close()

    async def pipeline(bus: Bus) -> None:
        for k in bus.lanes.keys:
            await bus.ensure_group(k.rollouts, SCORERS_GROUP)
            for g in (TRAINERS_GROUP, ARCHIVERS_GROUP):
                await bus.ensure_group(k.scored, g)
        await bus.set_version(VERSION)
        gen = Ledger.for_role(tmp_path, "generator", "g")
        scorer = Scorer(cfg, "s1")

        async def score_all() -> None:
            while entries := await bus.read_lanes("rollouts", SCORERS_GROUP, scorer.consumer,
                                                  count=8, block_ms=10):
                await scorer.process(bus, entries)  # any exception fails the test

        # rollouts: good, every hostile kind (some claiming the first good group), good
        first = await _admit_emit(bus, gen, [lambda g: make_group(g, version=VERSION)])
        bad_rollouts = await _hostile(bus, "rollouts", HOSTILE, first[0])
        late = await _admit_emit(bus, gen, [lambda g: make_group(g, version=VERSION),
                                            _empty_completion])
        await score_all()
        assert scorer.counts["scored"] == 3 and scorer.counts["dead"] == len(HOSTILE), \
            scorer.counts
        assert await _lag(bus, "rollouts", SCORERS_GROUP) == 0
        # scored: the hand-offs, every hostile kind, then one more good group
        bad_scored = await _hostile(bus, "scored", SCORED_HOSTILE, first[0])
        last = await _admit_emit(bus, gen, [lambda g: make_group(g, version=VERSION)])
        await score_all()
        good = first + late + last

        # the trainer's reader: everything read, the good groups buffered (none stale)
        reader = Reader(cfg, "trainer-0", "trainer/trainer-0", limits(cfg),
                        Ledger.for_role(tmp_path, "trainer", "trainer-0"))
        buf: list[Any] = []
        deadline = time.monotonic() + 60
        while await _lag(bus, "scored", TRAINERS_GROUP) and time.monotonic() < deadline:
            buf = await reader.collect(bus, asyncio.Event(), buf, wait_s=0.5, version=VERSION)
        assert sorted(sg.group.group_id for _e, sg in buf) == sorted(good), reader.counts
        assert reader.counts["dead"] == len(SCORED_HOSTILE) and reader.counts["stale"] == 0
        await reader.retire_trained(bus, buf, step=1, trained_at=VERSION)

        # the archiver: every bad entry skipped, every good one held for its file
        arch = Archiver(cfg, "archiver-0")
        while entries := await bus.read_lanes("scored", ARCHIVERS_GROUP, arch.consumer,
                                              count=8, block_ms=10):
            await arch.take(bus, entries)
        assert sorted(h.gid for h in arch.held) == sorted(good)
        assert arch.counts["skipped"] == len(SCORED_HOSTILE)
        await arch.flush(bus)

        # the control stream: bad entries skipped, the good announcement and end seen
        good_w = WeightsPublished(version=VERSION + 1, step=3, uri="file:///w",
                                  format="safetensors", sha256="0" * 64, nbytes=1, t=1.0)
        for make, _reason in HOSTILE.values():
            await bus.r.xadd(bus.keys.control, make("control", first[0]))
        await bus.r.xadd(bus.keys.control, {FIELD: encode(good_w)})
        await bus.r.xadd(bus.keys.control, {FIELD: encode(RunFinished("done", 2.0))})
        seen = await asyncio.wait_for(_watch_to_end(bus), 60)
        assert seen == [good_w, RunFinished("done", 2.0)]
        assert await control.latest(bus) == good_w
        assert await control.finished(bus) == RunFinished("done", 2.0)

        # the dlq: every bad entry once, with its reason, bounded
        dlq = await _dlq(bus)
        assert len(dlq) == len(HOSTILE) + len(SCORED_HOSTILE)
        _check_dlq(dlq, bad_rollouts, HOSTILE, "scorer/")
        _check_dlq(dlq, bad_scored, SCORED_HOSTILE, "trainer/")

        # the books: nothing retired for an undecodable entry, all of them counted apart
        state = await bus.state()
        assert state["cursor"] == len(good) and state["retired"] == len(good), state
        assert state["retired:trained"] == len(good) and not state.get("retired:dead")
        assert state["undecodable"] == len(HOSTILE) + len(SCORED_HOSTILE), state
        snap = await snapshot(bus)
        assert snap["conservation"]["balanced"], snap["conservation"]
        assert snap["conservation"]["undecodable"] == state["undecodable"]
        rows = read_ledgers(tmp_path)
        rep = audit(tmp_path, live=await live_view(bus, pending_intents(rows)), rows=rows,
                    num_generations=4, drained=True, archive=True)
        assert rep.ok, rep.summary()
        assert rep.undecodable == state["undecodable"] and rep.trained == len(good)

    arun(go())
    assert time.monotonic() - t0 < 120


async def _watch_to_end(bus: Bus) -> list[Any]:
    """What `control.watch` (every watcher's loop) yields up to the end-of-run marker."""
    seen: list[Any] = []
    async with aclosing(control.watch(bus, from_id="0", block_ms=10)) as msgs:
        async for m in msgs:
            seen.append(m)
            if isinstance(m, RunFinished):
                break
    return seen


# ---------------------------------------------------------------- each defect on its own


def test_dead_letter_of_a_poison_entry_is_one_bounded_record(redis_server: Any,
                                                             run_name: str) -> None:
    """An entry of 10,000 fields, one of them 100 MB, dead-letters in one call (the old
    script copied every field into ARGV and ``unpack``ed them: "too many results to
    unpack", an error no retry fixes) into a record of at most `DLQ_MAX_BYTES`."""
    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        k = bus.keys
        try:
            await bus.ensure_group(k.rollouts, SCORERS_GROUP)
            fields = _many_fields(True)("rollouts", "0:1")
            fields[b"f00001"] = b"y" * BIG_BYTES
            await bus.r.xadd(k.rollouts, fields)
            (e,) = await bus.read_group(k.rollouts, SCORERS_GROUP, "s", count=1, block_ms=10)
            assert await bus.dead_letter(k.rollouts, SCORERS_GROUP, e, reason="decode: x",
                                         role="scorer/s", retire=False, op="dead:1")
            ((_i, d),) = await bus.r.xrange(k.dlq)
            assert int(d[b"nfields"]) == MANY_FIELDS and d[b"truncated"] == b"1"
            assert sum(len(a) + len(b) for a, b in d.items()) <= DLQ_MAX_BYTES + 1024
            assert await bus.r.xpending(k.rollouts, SCORERS_GROUP) == \
                {"pending": 0, "min": None, "max": None, "consumers": []}
        finally:
            await _cleanup(bus, run_name)
            await bus.close()

    arun(go())


def test_an_undecodable_entry_claiming_a_group_in_flight_retires_nothing(
        redis_server: Any, run_name: str, tmp_path: Path, tiny_model_dir: Path) -> None:
    """A forged ``gid`` on an entry that does not decode is not believed: the entry is
    dead-lettered and counted ``undecodable``, the group it names stays in flight and
    retires once, when its real entry is trained; ``retired`` never runs ahead."""
    cfg = _cfg(redis_server.url, False, 1, run_name, tmp_path, tiny_model_dir)

    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        k = bus.keys
        try:
            await bus.ensure_group(k.scored, TRAINERS_GROUP)
            await bus.r.hincrby(k.state, "cursor", 1)  # "0:1" admitted, in flight
            await bus.r.xadd(k.scored, _forged("scored", "0:1"))
            reader = Reader(cfg, "trainer-0", "trainer/trainer-0", limits(cfg),
                            Ledger.for_role(tmp_path, "trainer", "trainer-0"))
            buf = await reader.collect(bus, asyncio.Event(), [], wait_s=0.5, version=VERSION)
            assert buf == [] and reader.counts["dead"] == 1
            state = await bus.state()
            assert state.get("retired", 0) == 0 and state["undecodable"] == 1, state
        finally:
            await _cleanup(bus, run_name)
            await bus.close()

    arun(go())
