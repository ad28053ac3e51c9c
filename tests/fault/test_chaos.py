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

pytestmark = pytest.mark.fault

ROLES = {"trainer-0": "train", "g0": "generate", "g1": "generate", "s0": "score",
         "s1": "score"}
# a window three times the default: generators are busy (holding leases) most of the
# time instead of waiting at a closed gate, and more groups go stale
WIDE = "trainer.admission_window=24"


def test_random_kills_of_every_role_lose_and_duplicate_nothing(tmp_path, tiny_model_dir
                                                               ) -> None:
    full = os.environ.get("SLUICE_FAULTS") == "full"
    faults = int(os.environ.get("SLUICE_CHAOS_FAULTS", "80" if full else "8"))
    rng = random.Random(int(os.environ.get("SLUICE_CHAOS_SEED", "0")))
    with Pipeline(tmp_path, tiny_model_dir) as p:
        for name, role in ROLES.items():
            p.start(role, name, WIDE)
        p.wait_trained(8)
        killed: dict[str, int] = dict.fromkeys(ROLES, 0)
        for _ in range(faults):
            time.sleep(rng.uniform(0.5, 4.0))
            name = rng.choice(list(ROLES))
            p.kill9(name)
            killed[name] += 1
            p.start(ROLES[name], name, WIDE)
        time.sleep(4)  # past the last killed generator's leases (lease_s = 3)
        trained = p.trained()
        p.wait_trained(trained + 16, timeout_s=180)
        p.stop_all()
        report = p.assert_clean(min_trained=trained + 16)
        print(f"[chaos] kills per role {killed}; {report.summary()}")
