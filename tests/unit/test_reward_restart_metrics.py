"""``reward_restarts`` (reward processes killed after a call outlived
``scoring.reward_timeout_s``, or lost) reaches Prometheus from the heartbeats of the two
roles that keep a reward process: the scorer and the evaluator (`pipeline.metrics.SYNCED`)."""

from __future__ import annotations

import pytest

from pipeline.metrics import RoleMetrics
from tests.helpers import metric_value as value


@pytest.mark.parametrize(("role", "metric"), [("scorer", "sluice_sample_reward_restarts_total"),
                                              ("evaluator", "sluice_eval_reward_restarts_total")])
def test_reward_restarts_of_the_heartbeat_is_a_counter(role: str, metric: str) -> None:
    m = RoleMetrics(role, f"{role}/x")

    def samples() -> dict:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in m.registry.collect() for s in fam.samples}

    m.sync({"reward_restarts": 1, "reward_errors": 2})
    assert value(samples(), metric) == 1
    m.sync({"reward_restarts": 3, "reward_errors": 2})
    assert value(samples(), metric) == 3
