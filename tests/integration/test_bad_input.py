"""Bad input on the real bus: every kind is dead-lettered with its reason, never blocks.

docs/design.md §6 and docs/wire-format.md: decoding validates types, lengths and ranges;
whatever fails goes to ``dlq`` with the reason and is acknowledged, so it can neither
block a consumer nor come back. A group id it may name is not believed (it did not
decode: a forged one would make ``retired`` drift): it is counted ``undecodable``, apart
from the books, and retires nothing, so ``cursor == retired + in_flight`` still holds
(tests/integration/test_hostile_input.py sends them all at once). Each case below
puts one bad entry between two good ones and checks all of that through a real redis-
server, for the scorer (entries on ``rollouts``) and the trainer (entries on
``scored``): the good entry after the bad one is still handed on, which is what "the
process keeps going" means for a consumer that processes a stream in order."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from pipeline.bus.client import Bus
from pipeline.bus.codec import FIELD, decode_entry, encode
from pipeline.bus.keys import SCORERS_GROUP, TRAINERS_GROUP
from pipeline.bus.schema import SCHEMA_VERSION, ScoredGroup
from pipeline.config import Config, load_config
from pipeline.model import VOCAB_SIZE
from sluice.embedded import EmbeddedRedis
from sluice.monitor import snapshot
from tests.conftest import arun
from tests.helpers import make_group, wait_for_async
from trainer.trainer import Trainer
from workers.scorer import Scorer
from workers.tasks.rewards import copy_reward

pytestmark = pytest.mark.integration

MAX_BYTES = 4096  # bus.max_message_bytes of these runs: an honest group is ~600 bytes


def _cfg(redis_server: EmbeddedRedis, run_name: str, out: Path, model: Path,
         *extra: str) -> Config:
    return load_config(None, [
        f"run.name={run_name}", f"run.output_dir={out}", f"bus.redis_url={redis_server.url}",
        "bus.block_ms=50", f"bus.max_message_bytes={MAX_BYTES}", f"model.path={model}",
        "model.init=''", "trainer.groups_per_step=2", "trainer.max_staleness=1", *extra])


def _scored(gid: str, version: int = 0) -> ScoredGroup:
    g = make_group(gid, version=version)
    rewards = np.array([1.0, 0.5, 0.25, 0.0], dtype=np.float32)
    adv = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-4)
    return ScoredGroup(group=g.for_training(),
                       rewards=rewards, reward_parts={"copy_reward": rewards},
                       advantages=adv.astype(np.float32), scorer="t", t_scored=0.0)


def _valid_map(stream: str, gid: str) -> dict[str, Any]:
    """The honest encoding of a group (rollouts) or scored group (scored), as a dict."""
    msg = make_group(gid) if stream == "rollouts" else _scored(gid)
    return msgpack.unpackb(encode(msg), raw=False)


def _f32(*xs: float) -> bytes:
    return np.asarray(xs, dtype="<f4").tobytes()


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(m: dict[str, Any]) -> None:
        node = m
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value(node[path[-1]]) if callable(value) else value
    return mutate


def _poison(path: tuple[Any, ...], index: int, bad: float | int, dtype: str
            ) -> Callable[[dict[str, Any]], None]:
    """Replace one element of a raw little-endian array field."""
    def put(raw: bytes) -> bytes:
        a = np.frombuffer(raw, dtype=dtype).copy()
        a[index] = bad
        return a.tobytes()
    return _set(path, put)


@dataclass(frozen=True)
class Bad:
    """One kind of bad entry: how to make its fields, and the dlq reason it must get.

    ``admitted``: the entry carries a readable group id, a claim to be an admitted group;
    not believed (the entry does not decode), so it never moves the books either way.
    """

    make: Callable[[str, str], dict[bytes, bytes]]  # (stream, gid) -> entry fields
    reason: str  # regex the dlq reason must match
    admitted: bool = True


def _mutated(*mutations: Callable[[dict[str, Any]], None]) -> Callable[[str, str],
                                                                       dict[bytes, bytes]]:
    def make(stream: str, gid: str) -> dict[bytes, bytes]:
        m = _valid_map(stream, gid)
        for mutate in mutations:
            mutate(m)
        return {FIELD: msgpack.packb(m, use_bin_type=True)}
    return make


def _raw(payload: bytes) -> Callable[[str, str], dict[bytes, bytes]]:
    return lambda stream, gid: {FIELD: payload}


def _truncated(stream: str, gid: str) -> dict[bytes, bytes]:
    return {FIELD: msgpack.packb(_valid_map(stream, gid), use_bin_type=True)[:-9]}


def _oversize(stream: str, gid: str) -> dict[bytes, bytes]:
    m = _valid_map(stream, gid)
    if stream == "rollouts":
        m["prompt"]["padding"] = "x" * MAX_BYTES  # valid in every way but its size
    else:  # a scored entry carries no prompt: a long scorer name instead
        m["scorer"] = "x" * MAX_BYTES
    return {FIELD: msgpack.packb(m, use_bin_type=True)}


def _other_type(stream: str, gid: str) -> dict[bytes, bytes]:
    """A valid message of the other stream's type (a rollout on scored, or vice versa)."""
    return {FIELD: encode(_scored(gid) if stream == "rollouts" else make_group(gid))}


COMMON: dict[str, Bad] = {
    "malformed-msgpack": Bad(_raw(b"\xc1\xc1 not msgpack"), r"^decode: malformed msgpack",
                             admitted=False),
    "truncated-msgpack": Bad(_truncated, r"^decode: malformed msgpack", admitted=False),
    "not-a-map": Bad(_raw(msgpack.packb([1, 2, 3])), r"message is list, not a map",
                     admitted=False),
    "no-m-field": Bad(lambda stream, gid: {b"x": encode(make_group(gid))},
                      r"stream entry has no b'm' field", admitted=False),
    "unknown-schema": Bad(_mutated(_set(("schema",), SCHEMA_VERSION + 1)),
                          rf"unknown schema version {SCHEMA_VERSION + 1} "
                          rf"\(expected {SCHEMA_VERSION}\)"),
    "float-schema": Bad(_mutated(_set(("schema",), float(SCHEMA_VERSION))),
                        rf"unknown schema version {SCHEMA_VERSION}\.0"),
    "unknown-type": Bad(_mutated(_set(("type",), "rolout")), r"unknown message type 'rolout'"),
    "other-message-type": Bad(_other_type, r"expected a \w+ message, got \w+"),
    "wrong-type-array": Bad(_mutated(_set(("ro", 0, "ids"), [5, 6, 1])),
                            r"ro\[0\]\.ids: expected bytes, got list"),
    "mismatched-lengths": Bad(_mutated(_set(("ro", 1, "lp"), lambda raw: raw[:-4])),
                              r"ro\[1\]: length mismatch ids=\d+ lp=\d+"),
    "ragged-bytes": Bad(_mutated(_set(("ro", 0, "ver"), lambda raw: raw + b"\x00")),
                        r"ro\[0\]\.ver: \d+ bytes is not a multiple of 4"),
    "nan-logprob": Bad(_mutated(_poison(("ro", 0, "lp"), 1, np.nan, "<f4")),
                       r"ro\[0\]\.lp: contains NaN or inf"),
    "inf-logprob": Bad(_mutated(_poison(("ro", 2, "lp"), 0, -np.inf, "<f4")),
                       r"ro\[2\]\.lp: contains NaN or inf"),
    "positive-logprob": Bad(_mutated(_poison(("ro", 0, "lp"), 0, 0.5, "<f4")),
                            r"ro\[0\]\.lp: a log-probability above 0"),
    "token-id-at-vocab": Bad(_mutated(_poison(("ro", 0, "ids"), 0, VOCAB_SIZE, "<i4")),
                             rf"ro\[0\]\.ids: token id outside \[0, {VOCAB_SIZE}\)"),
    "negative-token-id": Bad(_mutated(_poison(("ro", 3, "ids"), 0, -1, "<i4")),
                             rf"ro\[3\]\.ids: token id outside \[0, {VOCAB_SIZE}\)"),
    "prompt-id-above-vocab": Bad(_mutated(_poison(("pids",), 0, 2**31 - 1, "<i4")),
                                 rf"\.pids: token id outside \[0, {VOCAB_SIZE}\)"),
    "empty-prompt": Bad(_mutated(_set(("pids",), b"")), r"\.pids: empty prompt"),
    "negative-version": Bad(_mutated(_poison(("ro", 0, "ver"), 0, -3, "<i4")),
                            r"ro\[0\]\.ver: negative version"),
    "no-rollouts": Bad(_mutated(_set(("ro",), [])), r": no rollouts"),
    "oversize": Bad(_oversize, rf"payload of \d+ bytes exceeds {MAX_BYTES}"),
}

# the group's metadata (prompt index, epoch, generator, times) travels on rollouts only
ROLLOUT_ONLY: dict[str, Bad] = {
    "wrong-type-scalar": Bad(_mutated(_set(("pidx",), "3")),
                             r"group \S+\.pidx: expected int, got str"),
    "wrong-type-bool": Bad(_mutated(_set(("epoch",), True)), r"epoch: expected .*got bool"),
    "missing-field": Bad(_mutated(lambda m: m.pop("t_done")), r"missing field 't_done'"),
    "nan-timestamp": Bad(_mutated(_set(("t_admit",), float("nan"))), r"t_admit: not finite"),
}

SCORED_ONLY: dict[str, Bad] = {
    "wrong-type-scalar": Bad(_mutated(_set(("scorer",), 3)),
                             r"group \S+\.scorer: expected str, got int"),
    "wrong-type-bool": Bad(_mutated(_set(("t_scored",), True)),
                           r"t_scored: expected .*got bool"),
    "missing-field": Bad(_mutated(lambda m: m.pop("clip")), r"missing field 'clip'"),
    "nan-timestamp": Bad(_mutated(_set(("t_scored",), float("nan"))), r"t_scored: not finite"),
    "clip-not-a-flag": Bad(_mutated(_set(("clip",), bytes([0, 2, 0, 0]))),
                           r"\.clip: expected 4 values of 0 or 1"),
    "clip-length-mismatch": Bad(_mutated(_set(("clip",), bytes(3))),
                                r"\.clip: expected 4 values of 0 or 1"),
    "nan-reward": Bad(_mutated(_poison(("rew",), 2, np.nan, "<f4")),
                      r"\.rew: contains NaN or inf"),
    "inf-reward": Bad(_mutated(_poison(("rew",), 0, np.inf, "<f4")),
                      r"\.rew: contains NaN or inf"),
    "inf-advantage": Bad(_mutated(_poison(("adv",), 3, -np.inf, "<f4")),
                         r"\.adv: contains NaN or inf"),
    "inf-reward-part": Bad(_mutated(_poison(("parts", "copy_reward"), 1, np.inf, "<f4")),
                           r"\.parts\.copy_reward: contains inf"),
    "rewards-length-mismatch": Bad(_mutated(_set(("rew",), _f32(1.0, 0.0, 0.5))),
                                   r"\.rew: 3 values for 4 rollouts"),
    "advantages-length-mismatch": Bad(_mutated(_set(("adv",), _f32(*range(5)))),
                                      r"\.adv: 5 values for 4 rollouts"),
    "reward-part-not-bytes": Bad(_mutated(_set(("parts", "copy_reward"), [1.0, 0.0])),
                                 r"\.parts: expected str -> bytes"),
}

ROLLOUT_CASES = {**COMMON, **ROLLOUT_ONLY}
SCORED_CASES = {**COMMON, **SCORED_ONLY}


async def _put(bus: Bus, stream: str, fields: dict[bytes, bytes], admitted: bool) -> str:
    """Append an entry; an admitted one first moves the admission cursor, as the gate and
    a generator's emit do together, so the run's conservation equation covers it."""
    if admitted:
        await bus.r.hincrby(bus.keys.state, "cursor", 1)
    return (await bus.r.xadd(stream, fields)).decode()  # type: ignore[no-any-return]


async def _dlq(bus: Bus) -> list[dict[bytes, bytes]]:
    return [f for _i, f in await bus.r.xrange(bus.keys.dlq)]


async def _pending_ids(bus: Bus, stream: str, group: str) -> list[str]:
    rows = await bus.r.xpending_range(stream, group, min="-", max="+", count=100)
    return [r["message_id"].decode() for r in rows]


def _check_dead_letter(dlq: list[dict[bytes, bytes]], bad: Bad, bad_id: str, src: str,
                       role: str, fields: dict[bytes, bytes]) -> None:
    assert len(dlq) == 1, dlq
    (d,) = dlq
    reason = d[b"reason"].decode()
    assert re.search(bad.reason, reason), f"dlq reason {reason!r} !~ {bad.reason!r}"
    assert d[b"src"] == src.encode() and d[b"src_id"] == bad_id.encode()
    assert d[b"role"] == role.encode()
    assert {k[len(b"orig:"):]: v for k, v in d.items() if k.startswith(b"orig:")} == fields


def _expected_state(bad: Bad, **retired: int) -> dict[str, int]:
    """The ``retired*`` and ``undecodable`` counters of ``state`` after the good entries
    retired as ``retired`` says and the bad one was dead-lettered: counted
    ``undecodable``, never retired, whatever group id it claims."""
    total = sum(retired.values())
    return {**({"retired": total} if total else {}),
            **{f"retired:{k}": v for k, v in retired.items() if v}, "undecodable": 1}


# ---------------------------------------------------------------- scorer (rollouts)


@pytest.mark.parametrize("kind", list(ROLLOUT_CASES))
def test_scorer_dead_letters_bad_rollout_acks_retires_and_keeps_going(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path, tiny_model_dir: Path,
        kind: str) -> None:
    bad = ROLLOUT_CASES[kind]
    cfg = _cfg(redis_server, run_name, tmp_path, tiny_model_dir)

    async def go() -> None:
        bus = Bus.connect(cfg.redis_url, run_name)
        k = bus.keys
        try:
            await bus.ensure_group(k.rollouts, SCORERS_GROUP)
            await bus.ensure_group(k.scored, TRAINERS_GROUP)  # hand-offs count as in flight
            fields = bad.make("rollouts", "0:5")
            await _put(bus, k.rollouts, {FIELD: encode(make_group("0:1"))}, True)
            bad_id = await _put(bus, k.rollouts, fields, False)  # a claim, not admitted
            await _put(bus, k.rollouts, {FIELD: encode(make_group("0:2"))}, True)
            scorer = Scorer(cfg, "s1")
            while entries := await bus.read_group(k.rollouts, SCORERS_GROUP, scorer.consumer,
                                                  count=2, block_ms=10):
                await scorer.process(bus, entries)  # one read ends on the bad entry
            _check_dead_letter(await _dlq(bus), bad, bad_id, k.rollouts, "scorer/s1", fields)
            assert await _pending_ids(bus, k.rollouts, SCORERS_GROUP) == []
            handed = [decode_entry(f) for _i, f in await bus.r.xrange(k.scored)]
            assert [g.group.group_id for g in handed] == ["0:1", "0:2"]  # type: ignore[union-attr]
            assert scorer.counts["dead"] == 1 and scorer.counts["scored"] == 2
            state = await bus.state()
            assert {s: v for s, v in state.items()
                    if s.startswith("retired") or s == "undecodable"} == \
                _expected_state(bad)
            assert (await snapshot(bus))["conservation"]["balanced"]
        finally:
            await bus.close()

    arun(go())


def failing_reward(*, completions: list[str], fail: list[Any] | None = None,
                   **columns: Any) -> list[float | None]:
    """The copy reward, except that it raises on any call that includes a completion
    whose prompt has the column ``fail`` set (the scorer then retries group by group)."""
    if any(fail or []):
        raise RuntimeError("reward backend unavailable")
    return copy_reward(completions=completions, **columns)


def test_group_whose_reward_keeps_failing_is_dead_lettered_after_max_deliveries(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path,
        tiny_model_dir: Path) -> None:
    """Through the scorer's own run loop: each failure leaves the entry pending, the loop
    reclaims it after ``claim_idle_ms``, and on delivery ``max_deliveries`` it goes to the
    dlq with the function's error; the healthy group behind it is scored meanwhile."""
    cfg = _cfg(redis_server, run_name, tmp_path, tiny_model_dir, "bus.max_deliveries=3",
               "bus.claim_idle_ms=100",
               f"scoring.rewards=[{{fn='{__name__}:failing_reward'}}]")
    doomed = make_group("0:1")
    doomed.prompt["fail"] = True

    async def go() -> None:
        bus = Bus.connect(cfg.redis_url, run_name)
        k = bus.keys
        try:
            await bus.ensure_group(k.rollouts, SCORERS_GROUP)
            bad_id = await _put(bus, k.rollouts, {FIELD: encode(doomed)}, True)
            await _put(bus, k.rollouts, {FIELD: encode(make_group("0:2"))}, True)
            scorer = Scorer(cfg, "s1")
            stop = asyncio.Event()
            task = asyncio.create_task(scorer.run(stop))
            try:
                await wait_for_async(lambda: bus.r.xlen(k.dlq), 60,
                                     lambda: f"the failing group in the dlq: {scorer.counts}")
            finally:
                stop.set()
            await asyncio.wait_for(task, 10)
            (d,) = await _dlq(bus)
            assert d[b"src_id"] == bad_id.encode()
            assert d[b"reason"].decode() == ("reward: reward function 'failing_reward': "
                                             "raised RuntimeError('reward backend unavailable')")
            assert scorer.counts["reward_errors"] == 3 and scorer.counts["dead"] == 1
            assert scorer.counts["scored"] == 1 and scorer.counts["reclaimed"] >= 2
            assert await _pending_ids(bus, k.rollouts, SCORERS_GROUP) == []
            assert (await bus.state())["retired:dead"] == 1
            assert (await snapshot(bus))["conservation"]["balanced"]
        finally:
            await bus.close()

    arun(go())


def test_entry_delivered_more_than_max_deliveries_is_dead_lettered_unprocessed(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path,
        tiny_model_dir: Path) -> None:
    """An entry whose scorers keep dying on it (a poison pill that kills the process rather
    than raising) is reclaimed again and again; past ``max_deliveries`` it is dead-lettered
    without being decoded or scored once more."""
    cfg = _cfg(redis_server, run_name, tmp_path, tiny_model_dir, "bus.max_deliveries=2")

    async def go() -> None:
        bus = Bus.connect(cfg.redis_url, run_name)
        k = bus.keys
        try:
            await bus.ensure_group(k.rollouts, SCORERS_GROUP)
            eid = await _put(bus, k.rollouts, {FIELD: encode(make_group("0:1"))}, True)
            await bus.read_group(k.rollouts, SCORERS_GROUP, "dies", count=1, block_ms=10)
            await bus.reclaim(k.rollouts, SCORERS_GROUP, "dies-too", min_idle_ms=0, count=1)
            scorer = Scorer(cfg, "s1")
            entries = await bus.reclaim(k.rollouts, SCORERS_GROUP, scorer.consumer,
                                        min_idle_ms=0, count=1)
            assert [(e.id, e.deliveries) for e in entries] == [(eid, 3)]
            await scorer.process(bus, entries)
            (d,) = await _dlq(bus)
            assert d[b"reason"] == b"delivered 3 times" and d[b"src_id"] == eid.encode()
            assert await bus.r.xlen(k.scored) == 0
            assert await _pending_ids(bus, k.rollouts, SCORERS_GROUP) == []
            assert (await bus.state())["retired:dead"] == 1
        finally:
            await bus.close()

    arun(go())


# ---------------------------------------------------------------- trainer (scored)


@pytest.fixture(scope="module")
def trainer(redis_server: EmbeddedRedis, tiny_model_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trainer]:
    """One trainer (model, optimizer) for the module; each test resets what it reads."""
    out = tmp_path_factory.mktemp("trainer")
    yield Trainer(_cfg(redis_server, "unused", out, tiny_model_dir))


def _reset(tr: Trainer) -> Trainer:
    tr.reader.counts = dict.fromkeys(tr.reader.counts, 0)
    tr.reader.trained.clear()
    tr.state.version = 0
    return tr


@pytest.mark.parametrize("kind", list(SCORED_CASES))
def test_trainer_dead_letters_bad_scored_entry_acks_retires_and_keeps_going(
        redis_server: EmbeddedRedis, run_name: str, trainer: Trainer, kind: str) -> None:
    bad = SCORED_CASES[kind]
    tr = _reset(trainer)

    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        k = bus.keys
        try:
            await bus.ensure_group(k.scored, TRAINERS_GROUP)
            fields = bad.make("scored", "0:5")
            first = await _put(bus, k.scored, {FIELD: encode(_scored("0:1"))}, True)
            bad_id = await _put(bus, k.scored, fields, False)  # a claim, not admitted
            good = [first, await _put(bus, k.scored, {FIELD: encode(_scored("0:2"))}, True)]
            buf = await asyncio.wait_for(tr.collect(bus, asyncio.Event()), 10)
            assert [(i, sg.group.group_id) for i, sg in buf] == list(zip(good, ["0:1", "0:2"],
                                                                         strict=True))
            _check_dead_letter(await _dlq(bus), bad, bad_id, k.scored, "trainer/trainer-0",
                               fields)
            # the bad entry is acked; the good ones stay pending until their step is taken
            assert await _pending_ids(bus, k.scored, TRAINERS_GROUP) == good
            assert tr.counts["dead"] == 1
            await bus.retire(k.scored, TRAINERS_GROUP, good, "trained",  # as after a step
                             op=f"trained:{run_name}")
            assert await _pending_ids(bus, k.scored, TRAINERS_GROUP) == []
            state = await bus.state()
            assert {s: v for s, v in state.items()
                    if s.startswith("retired") or s == "undecodable"} == \
                _expected_state(bad, trained=2)
            assert (await snapshot(bus))["conservation"]["balanced"]
        finally:
            await bus.close()

    arun(go())


def test_trainer_acks_deleted_entries_and_retires_stale_and_duplicate_groups_once(
        redis_server: EmbeddedRedis, run_name: str, trainer: Trainer) -> None:
    """The trainer's other outcomes for an entry it cannot train: a duplicate group id is
    acked without retiring (its first copy retires), a stale group retires ``stale``, an
    entry deleted while pending is acked; none of them reaches the dlq. Read as a
    restarted trainer does: its own pending entries first."""
    tr = _reset(trainer)
    tr.state.version = 3  # max_staleness 1: version 1 is stale, 2 is not

    async def go() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        k = bus.keys
        try:
            await bus.ensure_group(k.scored, TRAINERS_GROUP)
            ids = [await bus.xadd(k.scored, encode(_scored(gid, v)))
                   for gid, v in (("0:1", 2), ("0:1", 2), ("0:2", 1), ("0:3", 2), ("0:4", 2))]
            # the previous incarnation read all five, then died; one was deleted meanwhile
            await bus.read_group(k.scored, TRAINERS_GROUP, tr.consumer, count=5, block_ms=10)
            await bus.r.xdel(k.scored, ids[3])
        finally:
            await bus.close()
        bus = Bus.connect(redis_server.url, run_name)  # the restart: backlog from id 0
        try:
            buf = await asyncio.wait_for(tr.collect(bus, asyncio.Event()), 10)
            assert [i for i, _ in buf] == [ids[0], ids[4]]
            assert {k: v for k, v in tr.counts.items() if v} == {"stale": 1, "duplicates": 1}
            assert await _pending_ids(bus, k.scored, TRAINERS_GROUP) == [ids[0], ids[4]]
            assert await bus.r.xlen(k.dlq) == 0
            assert await bus.state() == {"retired": 1, "retired:stale": 1}
        finally:
            await bus.close()

    arun(go())
