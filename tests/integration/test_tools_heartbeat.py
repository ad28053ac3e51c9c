"""Per-tool counters from a generator's heartbeat to the trainer's step row, on a real
redis-server: real tool calls (`workers.environments.tools`, through ``load_rollout`` as
the generator builds it) counted, written by the roles' `Heartbeat` through
`Bus.heartbeat`, read back by the trainer's own `Trainer.rollout_series` (``heartbeats_of``
into `RolloutMeter`), then shown by the trainer's /metrics and tracker names."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from pipeline.bus.client import Bus
from pipeline.config import Config, MetricsConfig
from pipeline.metrics import RoleMetrics
from pipeline.rollout_meter import RolloutMeter
from pipeline.runtime import Heartbeat
from pipeline.tracking import trainer_metrics
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun
from tests.helpers import loopback_listener
from tests.helpers import metric_value as value
from tests.helpers import scrape_metrics as scrape
from tests.tool_model import TOOL
from trainer.trainer import Trainer
from workers.environments.tools import ToolCall
from workers.hooks import RolloutFn, load_rollout, tool_stats

pytestmark = pytest.mark.integration
BROKEN = "tests.integration.test_tools_heartbeat:broken"


def broken(x: int) -> int:
    """Always raises.

    Args:
        x: Ignored.
    """
    raise RuntimeError(f"no luck with {x}")


def _rollout() -> RolloutFn:
    """One generator process's rollout function with its tools (a fresh ToolStats)."""
    cfg = Config.model_validate({"model": {"path": "unused", "init": ""},
                                 "environment": {"tools": [TOOL, BROKEN], "max_turns": 3}})
    rollout = load_rollout(cfg)
    assert rollout is not None
    return rollout


def _call(rollout: RolloutFn, *calls: ToolCall) -> None:
    box = rollout.runner.factory  # type: ignore[attr-defined]
    asyncio.run(_gather(box, calls))


async def _gather(box: Any, calls: tuple[ToolCall, ...]) -> None:
    await asyncio.gather(*(box.run(c) for c in calls))


def _port() -> int:
    s = loopback_listener()
    port = s.getsockname()[1]
    s.close()
    return int(port)


def test_tool_counters_ride_the_heartbeat_into_the_trainers_row(
        redis_server: EmbeddedRedis, run_name: str) -> None:
    good, bad = ToolCall("add", {"a": 2, "b": 3}), ToolCall("add", {"a": 2})
    g0, g1 = _rollout(), _rollout()
    done = {"generator/g0": 0, "generator/g1": 0}  # completions, as Generator.info has them
    fresh, resumed = RolloutMeter(), RolloutMeter(resumed=True)

    async def beat_and_read(*wids: str) -> tuple[dict[str, float], dict[str, float]]:
        bus = Bus.connect(redis_server.url, run_name)
        try:
            for wid in wids:
                rollout = g0 if wid.endswith("g0") else g1
                info = lambda r=rollout, w=wid: {  # noqa: E731
                    "completions": done[w], "tools": tool_stats(r)}
                await Heartbeat(bus, wid, 1.0, info).beat()
            return (await Trainer.rollout_series(SimpleNamespace(rollout_meter=fresh), bus),
                    await Trainer.rollout_series(SimpleNamespace(rollout_meter=resumed), bus))
        finally:
            await bus.close()

    # g0 ran 3 episodes before the trainer's first read: 2 good calls, 1 failed
    _call(g0, good, good, bad)
    done["generator/g0"] = 3
    first, base = arun(beat_and_read("generator/g0"))
    assert (first["tools/add/calls"], first["tools/add/failures"]) == (3, 1)
    assert first["tools/call_frequency"] == 1.0
    assert first["tools/failure_frequency"] == pytest.approx(1 / 3)
    assert 0 < first["tools/add/latency_s"] < 1
    assert (base["tools/add/calls"], base["tools/add/failures"]) == (0, 0)  # a baseline

    # then g0 calls twice more and a second generator joins with a failing tool
    _call(g0, good, good)
    done["generator/g0"] = 5
    _call(g1, ToolCall("broken", {"x": 1}), good)
    done["generator/g1"] = 1
    second, after = arun(beat_and_read("generator/g0", "generator/g1"))
    # a resumed trainer takes g1's first beat as its baseline too: g0's 2 calls only
    assert (after["tools/add/calls"], after["tools/broken/calls"]) == (2, 0)
    assert (second["tools/add/calls"], second["tools/add/failures"]) == (3, 0)
    assert (second["tools/broken/calls"], second["tools/broken/failures"]) == (1, 1)
    assert second["tools/call_frequency"] == pytest.approx(4 / 3)  # 4 calls, 3 completions
    assert second["tools/failure_frequency"] == pytest.approx(1 / 4)

    # a step without calls: the series stay, at 0
    third, _ = arun(beat_and_read("generator/g0", "generator/g1"))
    assert third["tools/add/calls"] == 0 and third["tools/broken/calls"] == 0
    assert "tools/add/latency_s" not in third and "tools/call_frequency" not in third

    # the trainer's /metrics and tracker names (TRL's for the two it has)
    m = RoleMetrics("trainer", "trainer/t0")
    m.serve(MetricsConfig(port=_port()))
    assert m.url is not None
    try:
        for row in (first, second, third):  # the counters sum the steps' deltas
            m.step({"step": 2, "version": 2, "step_time_s": 0.1, "rollout_wait_s": 0.1,
                    **row}, [0])
        summed = scrape(m.url)
        m.step({"step": 2, "version": 2, "step_time_s": 0.1, "rollout_wait_s": 0.1,
                **second}, [0])
        samples = scrape(m.url)
    finally:
        m.close()
    for tool, kind, total in (("add", "calls", 6), ("add", "failures", 1),
                              ("broken", "calls", 1), ("broken", "failures", 1)):
        assert total == sum(r.get(f"tools/{tool}/{kind}", 0) for r in (first, second, third))
        assert value(summed, f"sluice_batch_tool_{kind}_total", tool=tool) == total
    assert value(samples, "sluice_batch_figure", metric="tools/add/calls") == 3
    assert value(samples, "sluice_batch_figure", metric="tools/broken/failures") == 1
    assert value(samples, "sluice_batch_figure",
                 metric="tools/failure_frequency") == pytest.approx(0.25)
    tracked = trainer_metrics({"step": 2, **second})
    assert tracked["tools/call_frequency"] == pytest.approx(4 / 3)
    assert tracked["tools/add/calls"] == 3 and not any(k.startswith("sluice/tools")
                                                       for k in tracked)
