"""Scorer behaviour on good, equal-reward and malformed groups (real Redis, in-process)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import numpy as np
import pytest

from pipeline.bus import Bus
from pipeline.codec import decode_entry, encode
from pipeline.config import load_config
from pipeline.embedded import EmbeddedRedis
from pipeline.keys import SCORERS_GROUP
from pipeline.monitor import snapshot
from pipeline.schema import ScoredGroup
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
    payloads = [
        encode(make_group("0:1", texts=("123", "12", "1", "9"))),  # varied -> scored
        b"\xc1\xc1 not msgpack",  # garbage, no group id -> dlq, not retired
        msgpack.packb({**nan_lp, "gid": "0:3"}),  # NaN logprob -> dlq, retired dead
        msgpack.packb(bad_schema),  # unknown schema -> dlq, retired dead
        encode(make_group("0:2", texts=("123", "123", "123", "123"))),  # equal: filter/train
    ]

    async def go() -> dict:
        bus = Bus.connect(redis_server.url, run_name)
        k = bus.keys
        await bus.ensure_group(k.rollouts, SCORERS_GROUP)
        # four admitted groups (the garbage entry was never admitted)
        cursors = [await bus.admit(100, "g") for _ in range(4)]
        for p in payloads:
            if p.startswith(b"\xc1"):
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
    assert c["by_reason"] == {"trained": 0, "filtered": 0 if flat else 1, "stale": 0, "dead": 2}
    # 4 admitted: 1 (filter) or 2 (train) wait in `scored`, 1 filtered (filter), 2 dead
    assert c["cursor"] == 4 and c["in_flight"] == (2 if flat else 1) and c["balanced"]
