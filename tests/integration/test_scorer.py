"""Scorer behaviour on good, equal-reward and malformed groups (real Redis, in-process)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from pipeline.bus.client import Bus
from pipeline.bus.codec import decode_entry, encode
from pipeline.bus.keys import SCORERS_GROUP
from pipeline.bus.schema import ScoredGroup
from pipeline.config import ConfigError, load_config
from sluice.embedded import EmbeddedRedis
from sluice.monitor import snapshot
from tests.conftest import arun
from tests.helpers import make_group, wait_for_async
from workers.scorer import Scorer

pytestmark = pytest.mark.integration


def _valid_map() -> dict:
    return msgpack.unpackb(encode(make_group("0:3")), raw=False)


@pytest.mark.parametrize("zero_variance", ["filter", "train"])
def test_scorer_scores_filters_and_dead_letters_without_stopping(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path, zero_variance: str) -> None:
    cfg = load_config(None, [f"run.name={run_name}", f"run.output_dir={tmp_path}",
                             f"bus.redis_url={redis_server.url}", "bus.block_ms=50",
                             f"scoring.zero_variance={zero_variance}"])
    nan_lp = _valid_map()
    nan_lp["ro"][0]["lp"] = np.full(4, np.nan, dtype="<f4").tobytes()
    bad_schema = {**_valid_map(), "schema": 99}
    bad_schema["gid"] = "0:4"
    # An entry that does not decode retires nothing, whatever group id it names (a
    # forged one would make `retired` drift): it is dead-lettered and counted
    # `undecodable`. So the three undecodable entries are appended outside the gate, as
    # a writer that admitted nothing: honest producers never append what their consumer
    # rejects (`test_group_its_consumer_would_reject_is_abandoned_dead_not_emitted`).
    payloads = [
        encode(make_group("0:1", texts=("123", "12", "1", "9"))),  # varied -> scored
        b"\xc1\xc1 not msgpack",  # garbage, no group id -> dlq, undecodable
        msgpack.packb({**nan_lp, "gid": "0:3"}),  # NaN logprob -> dlq, undecodable
        msgpack.packb(bad_schema),  # unknown schema -> dlq, undecodable
        encode(make_group("0:2", texts=("123", "123", "123", "123"))),  # equal: filter/train
    ]

    async def go() -> dict:
        bus = Bus.connect(redis_server.url, run_name)
        k = bus.keys
        await bus.ensure_group(k.rollouts, SCORERS_GROUP)
        # two admitted groups (the undecodable entries were never admitted)
        cursors = [await bus.admit(100, "g") for _ in range(2)]
        for i, p in enumerate(payloads):
            if i in (1, 2, 3):
                await bus.xadd(k.rollouts, p)
            else:
                assert await bus.emit(p, cursor=cursors.pop(0), owner="g")
        scorer = Scorer(cfg, "s1")
        stop = asyncio.Event()
        task = asyncio.create_task(scorer.run(stop))

        async def all_read_and_acked() -> bool:
            return (await bus.r.xinfo_groups(k.rollouts))[0]["lag"] == 0 and \
                (await bus.r.xpending(k.rollouts, SCORERS_GROUP))["pending"] == 0

        try:
            await wait_for_async(all_read_and_acked, 60,
                                 lambda: f"the scorer to settle every entry: {scorer.counts}")
        finally:
            stop.set()
        await asyncio.wait_for(task, 10)
        snap = await snapshot(bus)
        snap["scored_entries"] = await bus.r.xrange(k.scored)
        snap["dlq_entries"] = await bus.r.xrange(k.dlq)
        await bus.close()
        return snap

    snap = arun(go())
    scored = [decode_entry(f) for _, f in snap["scored_entries"]]
    flat = zero_variance == "train"  # the equal group is handed on at advantage exactly 0
    assert sorted(s.group.group_id for s in scored) == ["0:1", *(["0:2"] if flat else [])]  # type: ignore[union-attr]
    if flat:
        sg2 = next(s for s in scored if s.group.group_id == "0:2")  # type: ignore[union-attr]
        assert isinstance(sg2, ScoredGroup) and not sg2.advantages.any()
    sg = next(s for s in scored if s.group.group_id == "0:1")  # type: ignore[union-attr]
    assert isinstance(sg, ScoredGroup)
    # copy rewards of "123","12","1","9" vs answer "123" (+eos): 1, 2/4, 1/4, 0
    np.testing.assert_allclose(sg.rewards, [1.0, 0.5, 0.25, 0.0], atol=1e-6)
    r = np.array([1.0, 0.5, 0.25, 0.0])
    np.testing.assert_allclose(sg.advantages, (r - r.mean()) / (r.std(ddof=1) + 1e-4), atol=1e-5)
    reasons = [f[b"reason"].decode() for _, f in snap["dlq_entries"]]
    assert len(reasons) == 3
    assert any("malformed msgpack" in x for x in reasons)
    assert any("NaN" in x for x in reasons)
    assert any("schema" in x for x in reasons)
    c = snap["conservation"]
    assert c["by_reason"] == {"trained": 0, "filtered": 0 if flat else 1, "stale": 0, "dead": 0}
    assert c["undecodable"] == 3  # counted apart from the books
    # 2 admitted: 1 (filter) or 2 (train) wait in `scored`, 1 filtered (filter)
    assert c["cursor"] == 2 and c["in_flight"] == (2 if flat else 1) and c["balanced"]


CALLS_ENV = "SLUICE_TEST_REWARD_CALLS"  # a file: a line per `target_reward` call, its size
# (the scorer calls its rewards in its reward process, which inherits the environment)


def _calls(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[[], list[int]]:
    """Record `target_reward`'s batch sizes from now on; returns their reader."""
    path = tmp_path / "reward-calls"
    monkeypatch.setenv(CALLS_ENV, str(path))
    return lambda: [int(x) for x in path.read_text().split()] if path.exists() else []


def target_reward(*, completions: list[Any], target: list[str], **kwargs: Any) -> list[float]:
    """A keyword-only user reward reading the dataset column ``target``; raises on a call
    that includes a completion whose target is ``boom``."""
    if os.environ.get(CALLS_ENV):
        with open(os.environ[CALLS_ENV], "a") as f:
            f.write(f"{len(completions)}\n")
    if "boom" in target:
        raise RuntimeError("boom")
    return [float(c[0]["content"].endswith(t)) for c, t in zip(completions, target, strict=True)]


CONV = [{"role": "system", "content": "Think, then answer in \\boxed{}."},
        {"role": "user", "content": "What is one third?"}]


def _conv_group(gid: str, target: str, texts: tuple[str, ...]) -> Any:
    g = make_group(gid, texts=tuple("1" * (i + 1) for i in range(len(texts))))
    for r, t in zip(g.rollouts, texts, strict=True):
        r.text = t
    g.prompt = {"text": CONV, "solution": "\\frac{1}{3}", "target": target, "tags": ["q", None]}
    return g


def _hf_config(tmp_path: Path, run_name: str, url: str, *sets: str) -> Any:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": CONV, "solution": "\\frac{1}{3}",
                                        "target": "}", "tags": ["q", None]}) + "\n"
                            for _ in range(3)))
    return load_config(None, [
        f"run.name={run_name}", f"run.output_dir={tmp_path}", f"bus.redis_url={url}",
        "bus.block_ms=50", "task.name=hf", f"task.dataset={data}",
        "scoring.rewards=[{fn='trl.rewards:accuracy_reward'}, "
        "{fn='trl.rewards:think_format_reward'}, "
        f"{{fn='{__name__}:target_reward'}}]", *sets])


async def _score_all(cfg: Any, url: str, run_name: str, groups: list[Any],
                     prepare: Callable[[Scorer], None] | None = None) -> tuple[Any, Any]:
    """Append ``groups`` to ``rollouts``, run a scorer (``prepare``d, if given) until every
    entry is settled; (the scorer, (decoded ``scored`` entries, ``dlq`` entries))."""
    bus = Bus.connect(url, run_name)
    await bus.ensure_group(bus.keys.rollouts, SCORERS_GROUP)
    for g in groups:
        assert await bus.emit(encode(g), cursor=await bus.admit(100, "g"), owner="g")
    scorer = Scorer(cfg, "s1")
    if prepare is not None:
        prepare(scorer)
    stop = asyncio.Event()
    task = asyncio.create_task(scorer.run(stop))

    async def settled() -> bool:
        return (await bus.r.xinfo_groups(bus.keys.rollouts))[0]["lag"] == 0 and \
            (await bus.r.xpending(bus.keys.rollouts, SCORERS_GROUP))["pending"] == 0

    try:
        await wait_for_async(settled, 60, lambda: f"every entry settled: {scorer.counts}")
    finally:
        stop.set()
    await asyncio.wait_for(task, 10)
    out = ([decode_entry(f) for _, f in await bus.r.xrange(bus.keys.scored)],
           await bus.r.xrange(bus.keys.dlq))
    await bus.close()
    return scorer, out


def test_trl_rewards_and_a_keyword_only_user_reward_run_unchanged_in_one_batch(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL's own reward functions get conversational completions, the dataset's columns
    under their own names, and one call per function covers the whole read."""
    cfg = _hf_config(tmp_path, run_name, redis_server.url)
    texts = ("<think>a third</think> \\boxed{\\frac{1}{3}}", "\\boxed{\\frac{1}{2}}",
             "<think>hm</think> no", "\\boxed{1/3}")
    calls = _calls(monkeypatch, tmp_path)
    scorer, (scored, dlq) = arun(_score_all(cfg, redis_server.url, run_name,
                                            [_conv_group("0:1", "}", texts),
                                             _conv_group("0:2", "no", texts)]))
    assert not dlq and scorer.counts["reward_errors"] == 0
    assert calls() == [2, 8]  # the start-up probe (2 dummy completions), then one batch of 8
    by_gid = {s.group.group_id: s for s in scored}
    assert sorted(by_gid) == ["0:1", "0:2"]
    parts = by_gid["0:1"].reward_parts
    np.testing.assert_array_equal(parts["accuracy_reward"], [1, 0, 0, 1])
    np.testing.assert_array_equal(parts["think_format_reward"], [1, 0, 1, 0])
    np.testing.assert_array_equal(parts["target_reward"], [1, 1, 0, 1])
    np.testing.assert_array_equal(by_gid["0:2"].reward_parts["target_reward"], [0, 0, 1, 0])
    # the conversation reached the rewards over `rollouts`; `scored` carries no prompt
    assert not hasattr(by_gid["0:1"].group, "prompt")


def test_a_failing_batch_is_retried_per_group_so_one_bad_group_sinks_alone(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _hf_config(tmp_path, run_name, redis_server.url, "bus.max_deliveries=1")
    texts = ("\\boxed{\\frac{1}{3}}", "x", "y", "z")
    calls = _calls(monkeypatch, tmp_path)
    scorer, (scored, dlq) = arun(_score_all(cfg, redis_server.url, run_name,
                                            [_conv_group("0:1", "}", texts),
                                             _conv_group("0:2", "boom", texts),
                                             _conv_group("0:3", "z", texts)]))
    assert calls() == [2, 12, 4, 4, 4]  # probe, batch, then per group (one round trip)
    assert sorted(s.group.group_id for s in scored) == ["0:1", "0:3"]
    (dead,) = dlq
    assert "raised RuntimeError('boom')" in dead[1][b"reason"].decode()
    assert scorer.counts["reward_errors"] == 1 and scorer.counts["dead"] == 1


def test_scorer_stops_at_start_when_a_reward_cannot_be_called(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.name={run_name}", f"run.output_dir={tmp_path}",
                             f"bus.redis_url={redis_server.url}",
                             f"scoring.rewards=[{{fn='{__name__}:target_reward'}}]"])
    with pytest.raises(ConfigError, match=(
            r"scoring.rewards.0.fn 'tests.integration.test_scorer:target_reward': TypeError: "
            r"target_reward\(\) missing 1 required keyword-only argument: 'target'")):
        arun(Scorer(cfg, "s1").run(asyncio.Event()))


def huge_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """A user reward whose value for the completion ``9`` is finite in float64 but not in
    float32, the width of the `scored` wire format: 1e39."""
    return [1e39 if c == "9" else float(len(c)) for c in completions]


def test_scorer_dead_letters_a_group_the_trainer_would_reject_instead_of_handing_it_off(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path) -> None:
    """A scored group whose encoding the trainer's decoder rejects (a reward that is inf in
    float32) is not handed off (the trainer would dead-letter it as undecodable, which
    retires nothing, and the group would hold a slot of the window for good): the scorer
    dead-letters its (decodable) `rollouts` entry with the decoder's reason, which retires
    it ``dead``; the other group of the read is handed off and decodes with the limits the
    trainer uses."""
    import redis

    from pipeline.bus.keys import Keys
    from pipeline.runtime import limits

    cfg = load_config(None, [f"run.name={run_name}", f"run.output_dir={tmp_path}",
                             f"bus.redis_url={redis_server.url}", "bus.block_ms=50",
                             f"scoring.rewards=[{{fn='{__name__}:huge_reward'}}]"])
    scorer, (scored, dlq) = arun(_score_all(cfg, redis_server.url, run_name, [
        make_group("0:1", texts=("123", "12", "1", "9")),
        make_group("0:2", texts=("123", "12", "1", "0"))]))
    assert [s.group.group_id for s in scored] == ["0:2"]
    r = redis.Redis.from_url(redis_server.url)
    keys = Keys(run_name)
    for _id, f in r.xrange(keys.scored):
        decode_entry(f, limits(cfg), expect=ScoredGroup)
    (dead,) = dlq
    reason = dead[1][b"reason"].decode()
    assert "group 0:1" in reason and "inf" in reason, reason
    state = {k.decode(): int(v) for k, v in r.hgetall(keys.state).items()}
    assert state["retired:dead"] == 1 and state["retired"] == 1, state
    assert state.get("undecodable", 0) == 0 and scorer.counts["dead"] == 1
