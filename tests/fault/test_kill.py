"""kill -9 each role at its worst moment, restart it, and check the whole history.

Real redis-server (AOF), real `sluice` processes, kills by PID; after recovery every test
stops the pipeline with SIGTERM and runs the history checker (`pipeline.bus.audit`), which
must find no loss, no duplicate, no stale training and no counter drift.
"""

from __future__ import annotations

import pytest

from pipeline.bus.keys import SCORERS_GROUP, TRAINERS_GROUP
from tests.fault.harness import GROUPS_PER_STEP, Pipeline
from tests.helpers import wait_for

pytestmark = pytest.mark.fault


def test_scorer_killed_between_read_and_ack_three_times(pipeline: Pipeline) -> None:
    with pipeline as p:
        p.start("train", "trainer-0")
        p.start("generate", "g0")
        p.start("score", "s0")
        p.wait_trained(8)
        reclaimed_before = p.worker("scorer/s0").get("reclaimed", 0)
        doomed: list[str] = []
        orphans: set[bytes] = set()  # entries left pending on a killed scorer
        for i in range(3):  # a scorer whose reward hangs: it reads, never acks; kill it
            name = f"doomed{i}"
            p.start("score", name, "scoring.rewards=[{fn='tests.helpers:hang_reward'}]")
            wait_for(lambda n=name: p.pending_on("rollouts", SCORERS_GROUP, n) > 0, 60,
                     lambda n=name: f"{n} to hold a group\n{p.logs()}")
            p.kill9(name)
            doomed.append(name)
            orphans |= p.pending_ids("rollouts", SCORERS_GROUP, name)
        assert orphans, "each killed scorer held a group"
        before = p.trained()

        # The survivor reclaims what the killed scorers held only once it has been idle
        # for claim_idle_ms, however fast the rest of the pipeline trains: wait for that
        # (nothing left pending on a killed scorer, every orphan handed on and acked, and
        # s0's heartbeat counting the reclaims), not for a number of trained groups.
        def still_held() -> dict[str, int]:
            return {n: c for n in doomed
                    if (c := p.pending_on("rollouts", SCORERS_GROUP, n))}

        def reclaimed() -> int:
            return int(p.worker("scorer/s0").get("reclaimed", 0))

        wait_for(lambda: not still_held()
                 and not orphans & p.pending_ids("rollouts", SCORERS_GROUP)
                 and reclaimed() > reclaimed_before, 120,
                 lambda: (f"the survivor s0 to reclaim and hand on the killed scorers' groups: "
                          f"pending on killed scorers {still_held()}, orphans still pending "
                          f"{sorted(orphans & p.pending_ids('rollouts', SCORERS_GROUP))}"
                          f", s0 reclaimed {reclaimed()} (was {reclaimed_before})\n"
                          f"{p.logs()}"))
        p.wait_trained(before + 16)
        p.stop_all()
        report = p.assert_clean(min_trained=before + 16)
        assert report.retired["dead"] == 0


def test_generator_killed_mid_group_is_taken_over(pipeline: Pipeline) -> None:
    with pipeline as p:
        p.start("train", "trainer-0")
        p.start("score", "s0")
        # long completions: the doomed generator spends seconds inside each batch
        p.start("generate", "doomed", "generation.max_new_tokens=300")

        def holds_lease() -> bool:
            return "generator/doomed" in p.lease_owners().values()

        wait_for(holds_lease, 120, lambda: f"the doomed generator to admit a group\n{p.logs()}")
        p.kill9("doomed")
        orphans = {c for c, owner in p.lease_owners().items() if owner == "generator/doomed"}
        assert orphans, "killed mid-group: its admitted groups are still leased to it"
        p.start("generate", "g1")  # the replacement takes the expired leases over
        wait_for(lambda: "generator/doomed" not in p.lease_owners().values(), 60,
                 lambda: f"the orphaned leases to be taken over\n{p.logs()}")
        # the heartbeat is refreshed every heartbeat_s: it lags the leases in Redis
        wait_for(lambda: p.worker("generator/g1").get("taken_over", 0) >= len(orphans), 30,
                 lambda: (f"g1's heartbeat to count {len(orphans)} groups taken over "
                          f"(it says {p.worker('generator/g1').get('taken_over')})\n"
                          f"{p.logs()}"))
        p.wait_trained(p.trained() + 8)
        p.stop_all()
        report = p.assert_clean(min_trained=8)
        assert report.taken_over >= len(orphans)
        assert report.retired["dead"] == 0


def test_trainer_killed_mid_step_resumes_and_never_goes_back(pipeline: Pipeline) -> None:
    with pipeline as p:
        p.start("train", "trainer-0")
        p.start("generate", "g0")
        p.start("score", "s0")
        p.wait_trained(40)  # past a checkpoint (save_steps = 5)

        def holding_a_step() -> bool:  # read a whole step's groups, not yet acked them
            return p.pending_on("scored", TRAINERS_GROUP, "trainer-0") >= GROUPS_PER_STEP

        wait_for(holding_a_step, 60, lambda: f"the trainer to hold a step\n{p.logs()}", 0.005)
        p.kill9("trainer-0")
        held = p.pending_ids("scored", TRAINERS_GROUP, "trainer-0")
        version_before = p.state()["version"]
        announced_before = p.control_length()
        assert held
        p.start("train", "trainer-0")  # same name: it drains its own pending entries
        p.wait_trained(p.trained() + 16)
        assert p.state()["version"] > version_before  # never backwards; re-announced
        assert p.control_length() > announced_before
        still = p.pending_ids("scored", TRAINERS_GROUP)
        assert not still & held, "the restarted trainer drained what it held"
        assert "resumed from step" in p.text("trainer-0"), p.log("trainer-0")
        p.stop_all()
        p.assert_clean(min_trained=56)
