"""`sluice status` rendering of a vLLM generator's engine health."""

from __future__ import annotations

from rich.console import Console

from pipeline.ops.monitor import render_status


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
    assert "servers_up=1/2 caps=128,160 retries=5" in text
    assert "NO" in text and "groups=8" in text
