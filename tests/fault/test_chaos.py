"""Random kill -9 of random roles at random moments, each restarted under its own name,
then the whole history checked: the way message systems are tested.

``SLUICE_CHAOS_FAULTS`` sets how many kills (default 8, the CI run; 80 with
``SLUICE_FAULTS=full``); ``SLUICE_CHAOS_SEED`` the seed (default 0). A kill can land
anywhere: inside a Redis call, between a call and its ledger line, mid-step, mid-batch.
The checker resolves calls cut off that way from the results the scripts stored in Redis.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from tests.fault.harness import Pipeline
from tests.helpers import wait_for

pytestmark = pytest.mark.fault

ROLES = {"trainer-0": "train", "g0": "generate", "g1": "generate", "s0": "score",
         "s1": "score"}
# a window three times the default: generators are busy (holding leases) most of the
# time instead of waiting at a closed gate, and more groups go stale
WIDE = "trainer.admission_window=24"
LEASE_MS = 3000  # generation.lease_s of the harness config


def test_random_kills_of_every_role_lose_and_duplicate_nothing(tmp_path, tiny_model_dir
                                                               ) -> None:
    chaos(Pipeline(tmp_path, tiny_model_dir))


def test_random_kills_on_a_redis_cluster_in_three_lanes(tmp_path, tiny_model_dir,
                                                        redis_cluster) -> None:
    """The same on the session's 3-master Redis Cluster with `bus.partitions = 3`: every
    lane on its own master, the kills landing in any lane's scripts."""
    chaos(Pipeline(tmp_path, tiny_model_dir, run="chaoslanes", cluster=redis_cluster,
                   partitions=3))


def chaos(pipeline: Pipeline) -> None:
    full = os.environ.get("SLUICE_FAULTS") == "full"
    faults = int(os.environ.get("SLUICE_CHAOS_FAULTS", "80" if full else "8"))
    rng = random.Random(int(os.environ.get("SLUICE_CHAOS_SEED", "0")))
    with pipeline as p:
        started: dict[str, float] = {}
        for name, role in ROLES.items():
            started[name] = time.time()
            p.start(role, name, WIDE)
        p.wait_trained(8)
        killed: dict[str, int] = dict.fromkeys(ROLES, 0)
        for _ in range(faults):
            time.sleep(rng.uniform(0.5, 4.0))
            name = rng.choice(list(ROLES))
            p.kill9(name)
            killed[name] += 1
            started[name] = time.time()
            p.start(ROLES[name], name, WIDE)
        # Wait for what the pipeline's stop relies on, not for a fixed time: every role
        # restarted after its last kill is up (one stopped while still importing dies by
        # SIGTERM), and every lease a killed generator held has expired and moved to a live
        # generator. Once every role is back, a lease whose deadline is later than now +
        # lease_s was granted or renewed since by a live process; a killed incarnation's
        # lease, left in Redis, would strand its group when the pipeline stops.
        p.wait_up(started)
        sec, usec = p.r.time()
        after_kills_ms = sec * 1000 + usec // 1000

        def dead_leases() -> dict[int, int]:
            return {c: d for c, d in p.lease_deadlines().items()
                    if d <= after_kills_ms + LEASE_MS}

        wait_for(lambda: not dead_leases(), 60,
                 lambda: f"the killed generators' leases to be taken over (cursor: deadline "
                         f"ms {dead_leases()}, all killed by {after_kills_ms})\n{p.logs()}", 0.2)
        trained = p.trained()
        p.wait_trained(trained + 16, timeout_s=180)
        p.stop_all()
        report = p.assert_clean(min_trained=trained + 16)
        print(f"[chaos] kills per role {killed}; {report.summary()}")
