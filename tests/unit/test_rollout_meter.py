"""`RolloutMeter`: TRL's rollout/* series from generator heartbeats, by hand."""

from __future__ import annotations

import pytest

from pipeline.rollout_meter import RolloutMeter


def beat(t: float, tokens: int, inflight: dict[str, int] | None = None,
         caps: dict[str, int] | None = None) -> dict[str, object]:
    engine = {"healthy": True} if inflight is None else {
        "healthy": True, "inflight": inflight, "caps": caps or {}}
    return {"t": t, "tokens": tokens, "engine": engine}


def test_concurrency_sums_servers_and_generators_rate_needs_two_beats() -> None:
    m = RolloutMeter()
    first = m.update({"generator/a": beat(10.0, 100, {"u1": 3, "u2": 5}, {"u1": 8, "u2": 8}),
                      "generator/b": beat(11.0, 50, {"u3": 2}, {"u3": 4})})
    assert first == {"rollout/concurrency": 10, "rollout/concurrency_cap": 20}
    second = m.update({"generator/a": beat(12.0, 300, {"u1": 0, "u2": 1}, {"u1": 8, "u2": 8}),
                       "generator/b": beat(15.0, 450, {"u3": 4}, {"u3": 4})})
    # a: 200 tokens in 2 s; b: 400 in 4 s
    assert second["rollout/generated_tok_s"] == pytest.approx(100.0 + 100.0)
    assert second["rollout/concurrency"] == 5


def test_the_rate_spans_the_window_so_group_sized_jumps_average_out() -> None:
    m = RolloutMeter(window_s=10.0)
    m.update({"generator/a": beat(0.0, 0)})
    # a group of 100 tokens lands every 4 s; beats every 2 s see the count stand still
    rates = []
    for t, tokens in ((2, 0), (4, 100), (6, 100), (8, 200), (10, 200), (12, 300), (14, 300)):
        rates.append(m.update({"generator/a": beat(float(t), tokens)})
                     ["rollout/generated_tok_s"])
    assert rates[0] == 0.0 and rates[1] == pytest.approx(25.0)
    # the window starts at the newest beat at or before t - 10
    assert rates[5] == pytest.approx((300 - 0) / (12 - 2))  # at 12 s: from the 2 s beat
    assert rates[6] == pytest.approx((300 - 100) / (14 - 4))  # at 14 s: from the 4 s beat
    assert all(r > 0 for r in rates[1:])  # never back to 0 between groups


def test_restarts_departures_idle_and_repeated_beats() -> None:
    m = RolloutMeter()
    m.update({"generator/a": beat(10.0, 100), "generator/b": beat(10.0, 900)})
    out = m.update({"generator/a": beat(12.0, 300), "generator/b": beat(12.0, 900)})
    assert out == {"rollout/generated_tok_s": 100.0 + 0.0}  # b alive but idle: 0
    out = m.update({"generator/a": beat(12.0, 300),  # no new beat: same rate
                    "generator/b": beat(20.0, 40),   # restarted: no rate until its next
                    "generator/c": beat(20.0, 500)})  # first sight: not yet
    assert out == {"rollout/generated_tok_s": 100.0}
    out = m.update({"generator/b": beat(30.0, 140), "generator/c": beat(25.0, 1000)})
    # a is gone (its beat expired): forgotten
    assert out["rollout/generated_tok_s"] == pytest.approx(10.0 + 100.0)


def test_in_process_engine_reports_rate_only_and_junk_is_skipped() -> None:
    m = RolloutMeter()
    assert m.update({"generator/a": beat(1.0, 0), "generator/x": {"t": "soon"}}) == {}
    assert m.update({"generator/a": beat(3.0, 64)}) == {"rollout/generated_tok_s": 32.0}
