"""`sluice status` rendering of a vLLM generator's engine health."""

from __future__ import annotations

from rich.console import Console

from sluice.monitor import render_status


def test_status_shows_servers_in_rotation_caps_and_an_unhealthy_generator() -> None:
    snap = {"t": 100.0, "state": {"version": 3},
            "conservation": {"cursor": 10, "retired": 4, "in_flight": 6, "generating": 2,
                             "balanced": True, "by_reason": {"trained": 4}},
            "lengths": {}, "groups": {},
            "workers": {"generator/g0": {
                "pid": 1, "t": 99.0, "version": 3, "healthy": False, "groups": 8,
                "engine": {"healthy": False, "servers_up": 1, "servers": 2, "retries": 5,
                           "caps": {"http://a": 128, "http://b": 160}}}}}
    console = Console(record=True, width=200)
    console.print(render_status(snap, window=16))
    text = console.export_text()
    assert "servers 1/2" in text and " NO " in text and "groups 8" in text
    console = Console(record=True, width=80)  # an alert shows whatever the width
    console.print(render_status(snap, window=16))
    assert "servers 1/2" in console.export_text()
    console = Console(record=True, width=200)
    console.print(render_status(snap, window=16, wide=True))
    assert "servers 1/2 caps 128,160 retries 5" in console.export_text()


def test_lease_summary_counts_per_owner_with_the_oldest_deadline() -> None:
    from sluice.monitor import lease_summary

    raw = {b"3": b"generator/g0|10500", b"4": b"generator/g0|12000",
           b"5": b"generator/g1|9000", b"6": b"garbage"}
    got = lease_summary(raw, now_ms=10_000)
    assert got["generator/g0"] == {"count": 2, "oldest_deadline_s": 0.5}
    assert got["generator/g1"] == {"count": 1, "oldest_deadline_s": -1.0}  # expired
    assert got["?"] == {"count": 1, "oldest_deadline_s": None}


def test_status_lists_metrics_urls_and_leases() -> None:
    snap = {"t": 100.0, "state": {"version": 1},
            "conservation": {"cursor": 2, "retired": 0, "in_flight": 2, "generating": 2,
                             "balanced": True, "by_reason": {}},
            "lengths": {}, "groups": {},
            "workers": {"trainer/trainer-0": {"pid": 1, "t": 99.5, "healthy": True,
                                              "metrics": "http://127.0.0.1:9101/metrics"},
                        "scorer/s0": {"pid": 2, "t": 99.5, "healthy": True}},
            "leases": {"generator/g0": {"count": 2, "oldest_deadline_s": 41.5},
                       "generator/g1": {"count": 1, "oldest_deadline_s": -3.0}}}
    console = Console(record=True, width=240)
    console.print(render_status(snap, window=16))
    text = console.export_text()
    assert "http://127.0.0.1:9101/metrics" in text
    assert "generator/g0" in text and "41.5s" in text and "EXPIRED 3.0s ago" in text
