"""sluice up's restart policy (sluice.restarts): backoff and giving up, by hand."""

from __future__ import annotations

from sluice.restarts import RestartPolicy


def test_backoff_doubles_per_crash_and_the_role_is_given_up_after_max_restarts() -> None:
    p = RestartPolicy(max_restarts=3, window_s=100, backoff_s=1, backoff_max_s=3)
    assert [p.on_crash("scorer-0", t) for t in (0, 1, 2)] == [1, 2, 3]  # capped at 3
    assert p.on_crash("generator-0", 3) == 1  # per role
    assert p.on_crash("scorer-0", 4) is None  # a fourth crash within 100 s: give up
    assert p.count("scorer-0") == 4


def test_crashes_outside_the_window_are_forgotten() -> None:
    p = RestartPolicy(max_restarts=1, window_s=10, backoff_s=2)
    assert p.on_crash("trainer-0", 0) == 2
    assert p.on_crash("trainer-0", 11) == 2  # the first one is older than the window
    assert p.on_crash("trainer-0", 12) is None


def test_zero_restarts_stops_at_the_first_crash() -> None:
    assert RestartPolicy(max_restarts=0).on_crash("evaluator", 0) is None
