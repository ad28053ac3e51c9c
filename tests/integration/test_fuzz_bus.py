"""Fuzzing the consumers through Redis: thousands of random and mutated entries.

tests/unit/test_codec.py fuzzes `decode` alone. This drives the real consumers over a
real stream: the scorer's `Scorer.process` on ``rollouts`` and the trainer's
`Trainer.collect` on ``scored``, with every entry one of: a valid message, random bytes,
a byte-mutated valid encoding, a structurally mutated map (fields replaced, deleted or
added, with values of any msgpack type: NaN, inf, huge ints, nested containers, …), a
targeted poisoning (NaN / inf in an array, an id at the vocabulary size, a ragged array,
another schema or type, an oversize payload), or an odd entry (no ``m`` field).

The property, per batch: no exception escapes the consumer; each entry is accounted for
exactly once (dead-lettered, handed on, filtered; for the trainer: accepted, stale,
duplicate); nothing is left pending or undelivered; the ``state`` counters equal those
counts; and what the scorer hands on decodes as a `ScoredGroup` (the trainer would
accept it), what the trainer accepts it can train on (one real optimizer step per batch;
for every step's groups the batch and the logit indexing the loss uses).

Hypothesis draws one seed per batch and the batch is expanded from it with
`random.Random`: drawing each of ~1,000 entries through hypothesis would cost more than
the Redis round trips, while a failing seed still shrinks and replays exactly.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.bus.client import Bus
from pipeline.bus.codec import FIELD, DecodeError, decode_entry, encode
from pipeline.bus.keys import SCORERS_GROUP, TRAINERS_GROUP
from pipeline.bus.schema import SCHEMA_VERSION, Rollout, RolloutGroup, ScoredGroup
from pipeline.config import Config, load_config
from pipeline.model import VOCAB_SIZE
from pipeline.runtime import limits as run_limits
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun
from tests.helpers import key_paths, value_at
from trainer.batch import build_batch, completion_logits
from trainer.trainer import Trainer
from workers.scorer import Scorer

pytestmark = pytest.mark.integration

BATCH = 1000  # entries per hypothesis example
EXAMPLES = 5  # examples per consumer: >= 5,000 entries each
MAX_BYTES = 8192  # bus.max_message_bytes: honest fuzz groups stay well below
FLOAT_KEYS = ("lp", "rew", "adv")
INT_KEYS = ("ids", "ver", "pids", "cand", "ncand")

FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))


# ---------------------------------------------------------------- valid messages


def _group(rng: random.Random, gid: str) -> RolloutGroup:
    """A valid group of the copy task: varied or (one in five) all-equal completions,
    some with candidate sets, token versions v0 or v0 + 1 for a v0 in 0..6."""
    answer = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 4)))
    equal = rng.random() < 0.2
    v0 = rng.randint(0, 6)  # the group's oldest version: the trainer's staleness test
    rollouts = []
    for _ in range(rng.randint(2, 4)):
        text = answer if equal else "".join(rng.choice("0123456789")
                                             for _ in range(rng.randint(0, 5)))
        stop = equal or rng.random() < 0.7
        ids = np.array([4 + int(c) for c in text] + ([1] if stop else []), dtype=np.int32)
        n = len(ids)
        cand = counts = None
        if n and rng.random() < 0.2:
            sets = [sorted({int(t), *rng.sample(range(VOCAB_SIZE), rng.randint(0, 3))})
                    for t in ids]
            cand = np.array([x for s in sets for x in s], dtype=np.int32)
            counts = np.array([len(s) for s in sets], dtype=np.int32)
        rollouts.append(Rollout(
            completion_ids=ids,
            logprobs=np.array([-rng.uniform(0, 5) for _ in range(n)], dtype=np.float32),
            versions=np.array(sorted(rng.randint(v0, v0 + 1) for _ in range(n)),
                              dtype=np.int32),
            mask=np.array([rng.random() < 0.9 for _ in range(n)], dtype=np.uint8),
            finish_reason="stop" if stop else "length", text=text,
            candidate_ids=cand, candidate_counts=counts))
    epoch, idx = gid.split(":")
    return RolloutGroup(group_id=gid, prompt_index=int(idx), epoch=int(epoch),
                        prompt={"text": answer + "=", "answer": answer},
                        prompt_ids=np.array([4 + int(c) for c in answer] + [66],
                                            dtype=np.int32),
                        generator="fuzz", t_admit=time.time(), t_done=time.time(),
                        rollouts=rollouts)


def _scored(rng: random.Random, gid: str) -> ScoredGroup:
    g = _group(rng, gid)
    n = len(g.rollouts)
    rewards = np.array([rng.uniform(-2, 2) for _ in range(n)], dtype=np.float32)
    part = rewards.copy()
    part[rng.randrange(n)] = np.nan if rng.random() < 0.3 else part[0]  # NaN = None
    return ScoredGroup(group=g.for_training(), rewards=rewards, reward_parts={"copy_reward": part},
                       advantages=(rewards - rewards.mean()).astype(np.float32),
                       scorer="fuzz", t_scored=time.time())


# ---------------------------------------------------------------- mutations

_EDGE_INTS = (0, 1, -1, 2, VOCAB_SIZE - 1, VOCAB_SIZE, 2**31 - 1, 2**31, -(2**31) - 1,
              2**63 - 1, -(2**63), 2**64 - 1)
_EDGE_FLOATS = (math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, -5e-324, 1e-3, 0.5, 1.0)


def _value(rng: random.Random, depth: int = 0) -> Any:
    """Any msgpack value, biased towards what breaks validators."""
    kind = rng.randrange(12 if depth < 2 else 10)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice(_EDGE_INTS) if rng.random() < 0.5 else rng.randint(-1000, 1000)
    if kind == 3:
        return rng.choice(_EDGE_FLOATS) if rng.random() < 0.5 else rng.uniform(-10, 10)
    if kind == 4:
        return "".join(rng.choice("ab0:=\u00e9\u2028\x00 ") for _ in range(rng.randint(0, 8)))
    if kind == 5:
        return rng.randbytes(rng.randint(0, 40))
    if kind == 6:
        with np.errstate(over="ignore"):  # 1e308 becomes inf in float32: one more edge
            return np.array([rng.choice(_EDGE_FLOATS) for _ in range(rng.randint(0, 6))],
                            dtype="<f8").astype("<f4").tobytes()
    if kind == 7:
        return np.array([rng.choice(_EDGE_INTS[:9]) for _ in range(rng.randint(0, 6))],
                        dtype="<i8").astype("<i4").tobytes()
    if kind == 8:
        return rng.randbytes(rng.choice((3, 5, 7)))  # no dtype divides it
    if kind == 9:
        return ""
    if kind == 10:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    keys: tuple[Any, ...] = ("gid", "ids", "lp", "x", "text", "schema", 0)  # 0: not a str
    return {rng.choice(keys): _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _structural(rng: random.Random, m: dict[str, Any]) -> None:
    """1-3 edits of the decoded map: replace, delete or add a field anywhere."""
    for _ in range(rng.randint(1, 3)):
        paths = key_paths(m)
        op = rng.choice(("replace", "replace", "delete", "add"))
        if op == "add" or not paths:
            parents = [()] + [p for p in paths if isinstance(value_at(m, p), dict)]
            key = rng.choice(("gid", "zz", "ro", "rew", "cand"))
            value_at(m, rng.choice(parents))[key] = _value(rng)
            continue
        path = rng.choice(paths)
        parent = value_at(m, path[:-1])
        if op == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = _value(rng)


def _poison(rng: random.Random, m: dict[str, Any]) -> None:
    """One targeted edit of an array or envelope field: the bad values a generic mutation
    rarely hits (NaN, an id at the vocabulary size, an empty prompt, a payload one byte
    over the limit's order, another schema), with some that stay valid (a shorter group)."""
    arrays = [p for p in key_paths(m)
              if isinstance(p[-1], str) and isinstance(value_at(m, p), bytes)]
    choice = rng.randrange(6)
    if choice == 0 and arrays:
        path = rng.choice(arrays)
        key = path[-1] if path[-1] in FLOAT_KEYS + INT_KEYS + ("mask",) else "parts"
        raw = value_at(m, path)
        if key in INT_KEYS and len(raw) >= 4:
            a = np.frombuffer(raw, "<i4").copy()
            a[rng.randrange(len(a))] = rng.choice((VOCAB_SIZE, -1, 2**31 - 1))
            value_at(m, path[:-1])[path[-1]] = a.tobytes()
        elif len(raw) >= 4:
            a = np.frombuffer(raw[: len(raw) // 4 * 4], "<f4").copy()
            a[rng.randrange(len(a))] = rng.choice((math.nan, math.inf, -math.inf, 0.5))
            value_at(m, path[:-1])[path[-1]] = a.tobytes()
    elif choice == 1 and arrays:  # one element short or long, or none at all
        path = ("pids",) if "pids" in m and rng.random() < 0.3 else rng.choice(arrays)
        raw = value_at(m, path)
        value_at(m, path[:-1])[path[-1]] = rng.choice((raw[:-4], raw + b"\0" * 4, b""))
    elif choice == 2:
        m["schema"] = rng.choice((0, SCHEMA_VERSION + 1, float(SCHEMA_VERSION),
                                  str(SCHEMA_VERSION), True, None))
    elif choice == 3:
        m["type"] = rng.choice(("rollout", "scored", "weights", "finished", "x"))
    elif choice == 4:
        m.setdefault("prompt", {})
        if isinstance(m["prompt"], dict):
            m["prompt"]["pad"] = "x" * MAX_BYTES  # oversize
    else:
        m["ro"] = m.get("ro", [])[: rng.randint(0, 1)] if isinstance(m.get("ro"), list) \
            else []


def _bytes_mutated(rng: random.Random, payload: bytes) -> bytes:
    buf = bytearray(payload)
    for _ in range(rng.randint(1, 4)):
        if not buf:
            break
        i = rng.randrange(len(buf))
        op = rng.randrange(5)
        if op == 0:
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1:
            buf[i] = rng.randrange(256)
        elif op == 2:
            buf[i:i] = rng.randbytes(rng.randint(1, 8))
        elif op == 3:
            del buf[i]
        else:
            del buf[i:]
    return bytes(buf)


def make_batch(seed: int, n: int, valid: Callable[[random.Random, str], Any],
               gids: int) -> list[dict[bytes, bytes]]:
    """``n`` entry field maps of every kind, reproducibly from ``seed``; group ids are
    drawn from ``gids`` values, so a batch holds duplicates of valid groups too."""
    rng = random.Random(seed)
    out: list[dict[bytes, bytes]] = []
    for _ in range(n):
        msg = valid(rng, f"{rng.randrange(3)}:{rng.randrange(gids)}")
        kind = rng.random()
        if kind < 0.25:
            payload = encode(msg)
        elif kind < 0.35:
            payload = rng.randbytes(rng.randint(0, 300))
        elif kind < 0.55:
            payload = _bytes_mutated(rng, encode(msg))
        else:
            m = msgpack.unpackb(encode(msg), raw=False)
            (_structural if kind < 0.85 else _poison)(rng, m)
            payload = msgpack.packb(m, use_bin_type=True)
        r = rng.random()
        if r < 0.02:
            out.append({b"x": payload})  # no m field
        elif r < 0.04:
            out.append({FIELD: payload, b"extra": b"ignored"})
        else:
            out.append({FIELD: payload})
    return out


# ---------------------------------------------------------------- plumbing


def _cfg(redis_server: EmbeddedRedis, out: Path, model: Path, *extra: str) -> Config:
    return load_config(None, [
        f"run.output_dir={out}", f"bus.redis_url={redis_server.url}", "bus.block_ms=10",
        f"bus.max_message_bytes={MAX_BYTES}", "bus.max_deliveries=1",
        f"model.path={model}", "model.init=''", *extra])


async def _send(bus: Bus, stream: str, entries: list[dict[bytes, bytes]]) -> list[str]:
    ids: list[str] = []
    for i in range(0, len(entries), 500):
        pipe = bus.r.pipeline(transaction=False)
        for fields in entries[i:i + 500]:
            pipe.xadd(stream, fields)
        ids += [x.decode() for x in await pipe.execute()]
    return ids


async def _settled(bus: Bus, stream: str, group: str, sent: list[str]
                   ) -> tuple[list[dict[bytes, bytes]], dict[str, int]]:
    """The dlq, after checking nothing is pending or undelivered and each dead-lettered
    entry is one of ours, once; and the ``state`` counters."""
    (info,) = await bus.r.xinfo_groups(stream)
    assert info["lag"] == 0 and info["pending"] == 0, info
    dlq = [f for _i, f in await bus.r.xrange(bus.keys.dlq)]
    src_ids = [f[b"src_id"].decode() for f in dlq]
    assert len(set(src_ids)) == len(src_ids) and set(src_ids) <= set(sent)
    assert all(f[b"reason"] for f in dlq)
    return dlq, await bus.state()


def _admitted_dead(dlq: list[dict[bytes, bytes]]) -> int:
    """Dead-lettered entries that decoded (a reward that raised): those retire ``dead``.
    The others did not decode: counted ``undecodable``, never retired, whatever group id
    they claim (`pipeline.bus.inbound`)."""
    return sum(not f[b"reason"].startswith(b"decode: ") for f in dlq)


TOTALS: dict[str, int] = {"scorer": 0, "trainer": 0}
OUTCOMES: dict[str, dict[str, int]] = {"scorer": {}, "trainer": {}}


def _tally(role: str, **counts: int) -> None:
    for k, v in counts.items():
        OUTCOMES[role][k] = OUTCOMES[role].get(k, 0) + v


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    """Every rejected entry logs a warning; thousands of captured records cost seconds."""
    caplog.set_level(logging.ERROR, logger="sluice")


# ---------------------------------------------------------------- the scorer


def test_scorer_accounts_for_every_fuzzed_rollouts_entry(
        redis_server: EmbeddedRedis, tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = _cfg(redis_server, tmp_path, tiny_model_dir, "scoring.read_count=32")
    limits = run_limits(cfg)

    @FUZZ
    @given(seed=st.integers(0, 2**32 - 1))
    def check(seed: int) -> None:
        run = f"fz{seed:x}{time.monotonic_ns() % 10**6}"
        entries = make_batch(seed, BATCH, _group, gids=10**6)

        async def go() -> None:
            bus = Bus.connect(cfg.redis_url, run)
            k = bus.keys
            try:
                await bus.ensure_group(k.rollouts, SCORERS_GROUP)
                sent = await _send(bus, k.rollouts, entries)
                scorer = Scorer(cfg, "fuzz")
                while batch := await bus.read_group(k.rollouts, SCORERS_GROUP,
                                                    scorer.consumer, count=32, block_ms=10):
                    await scorer.process(bus, batch)  # any exception fails the property
                dlq, state = await _settled(bus, k.rollouts, SCORERS_GROUP, sent)
                handed = [f for _i, f in await bus.r.xrange(k.scored)]
                c = scorer.counts
                assert c["dead"] + c["scored"] + c["filtered"] == len(sent), c
                assert c["dead"] == len(dlq) and c["scored"] == len(handed)
                assert state.get("retired:filtered", 0) == c["filtered"]
                assert state.get("retired:dead", 0) == _admitted_dead(dlq)
                assert state.get("undecodable", 0) == len(dlq) - _admitted_dead(dlq)
                assert state.get("retired", 0) == c["filtered"] + _admitted_dead(dlq)
                for f in handed:  # what the scorer emits, the trainer accepts
                    assert isinstance(decode_entry(f, limits, expect=ScoredGroup),
                                      ScoredGroup)
                TOTALS["scorer"] += len(sent)
                _tally("scorer", dead=c["dead"], handed_on=c["scored"],
                       filtered=c["filtered"])
            finally:
                await bus.close()

        arun(go())

    t0 = time.monotonic()
    check()
    print(f"\nscorer: {TOTALS['scorer']} fuzzed entries in {time.monotonic() - t0:.1f} s: "
          f"{OUTCOMES['scorer']}")
    assert TOTALS["scorer"] >= 5000


# ---------------------------------------------------------------- the trainer


def test_trainer_accounts_for_every_fuzzed_scored_entry(
        redis_server: EmbeddedRedis, tmp_path: Path, tiny_model_dir: Path) -> None:
    tr = Trainer(_cfg(redis_server, tmp_path, tiny_model_dir, "trainer.groups_per_step=64",
                      "trainer.max_staleness=1"))

    @FUZZ
    @given(seed=st.integers(0, 2**32 - 1))
    def check(seed: int) -> None:
        run = f"fz{seed:x}{time.monotonic_ns() % 10**6}"
        # few group ids: duplicates within a step and of groups trained steps before
        entries = make_batch(seed, BATCH, _scored, gids=300)
        tr.reader.counts = dict.fromkeys(tr.reader.counts, 0)
        tr.reader.trained.clear()
        tr.state.version = 5  # max_staleness 1: tokens of versions < 4 are stale

        async def go() -> None:
            bus = Bus.connect(tr.cfg.redis_url, run)
            k = bus.keys
            try:
                await bus.ensure_group(k.scored, TRAINERS_GROUP)
                sent = await _send(bus, k.scored, entries)
                stop = asyncio.Event()

                async def stop_when_all_read() -> None:
                    # collect processes every entry it read before it looks at `stop`
                    while (await bus.r.xinfo_groups(k.scored))[0]["lag"]:
                        await asyncio.sleep(0.02)
                    stop.set()

                watcher = asyncio.create_task(stop_when_all_read())
                trained = steps = 0
                while not stop.is_set():
                    buf = await tr.collect(bus, stop)
                    if not buf:
                        continue
                    groups = [sg for _i, sg in buf]
                    if not steps:  # one real optimizer step per batch (a small one) …
                        tr.train_step(groups[:8])
                    batch = build_batch(groups, tr.pad_id)  # … and for every buffer the
                    logits = torch.zeros(*batch.input_ids.shape, VOCAB_SIZE)  # indexing
                    completion_logits(logits, batch)  # of the step, without the model
                    steps += 1
                    done = await bus.retire(k.scored, TRAINERS_GROUP, [i for i, _ in buf],
                                            "trained", op=f"fz:{run}:{buf[0][0]}")
                    assert len(done) == len(buf)
                    trained += len(buf)
                    tr.reader.trained.update(dict.fromkeys(g.group.group_id for g in groups))
                await watcher
                dlq, state = await _settled(bus, k.scored, TRAINERS_GROUP, sent)
                c = tr.counts
                assert trained + c["dead"] + c["stale"] + c["duplicates"] == len(sent), c
                assert c["dead"] == len(dlq)
                assert state.get("retired:trained", 0) == trained
                assert state.get("retired:stale", 0) == c["stale"]
                assert state.get("retired:dead", 0) == _admitted_dead(dlq)
                assert state.get("undecodable", 0) == len(dlq) - _admitted_dead(dlq)
                assert state.get("retired", 0) == trained + c["stale"] + _admitted_dead(dlq)
                TOTALS["trainer"] += len(sent)
                _tally("trainer", dead=c["dead"], accepted=trained, stale=c["stale"],
                       duplicates=c["duplicates"])
            finally:
                await bus.close()

        arun(go())

    t0 = time.monotonic()
    check()
    print(f"\ntrainer: {TOTALS['trainer']} fuzzed entries in {time.monotonic() - t0:.1f} s: "
          f"{OUTCOMES['trainer']}")
    assert TOTALS["trainer"] >= 5000


def test_fuzz_batches_hold_every_kind_of_entry() -> None:
    """The generator is not degenerate: a batch has valid messages and each rejection
    class the property is meant to exercise."""
    from pipeline.bus.schema import Limits

    limits = Limits(vocab_size=VOCAB_SIZE, max_message_bytes=MAX_BYTES)
    reasons: list[str] = []
    valid = 0
    for fields in make_batch(7, BATCH, _group, gids=10**6):
        try:
            decode_entry(fields, limits, expect=RolloutGroup)
            valid += 1
        except DecodeError as e:
            reasons.append(str(e))
    text = "\n".join(reasons)
    assert valid >= BATCH // 5
    for what in ("malformed msgpack", "unknown schema version", "expected", "length mismatch",
                 "NaN or inf", "token id outside", "exceeds", "missing field", "no b'm' field",
                 "not a multiple of"):
        assert what in text, what
