"""Redis restarted and Redis down; the trainer stalled; scorers scaled up and down.

Each test runs a real pipeline (`tests.fault.harness`), injects the fault, lets it recover
and runs the history checker over everything that happened.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.bus.keys import SCORERS_GROUP
from sluice.embedded import EmbeddedCluster
from tests.fault.harness import GROUPS_PER_STEP, Pipeline

pytestmark = pytest.mark.fault

ROLES = ("trainer-0", "g0", "s0", "s1")
# How long the trainer stays stopped: 60 s with SLUICE_FAULTS=full, 30 s in the default
# (CI) run, which keeps the suite inside its time budget; both sample flatness every 5 s.
STALL_S = 60 if os.environ.get("SLUICE_FAULTS") == "full" else 30


def start_all(p: Pipeline) -> None:
    p.start("train", "trainer-0")
    p.start("generate", "g0")
    p.start("score", "s0")
    p.start("score", "s1")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime, stime in clock ticks (USER_HZ)


PREFIXES = ("trainer/", "generator/", "scorer/s0", "scorer/s1")
# How many times Redis is stopped and started again in a row after the long outage. Each
# restart of a cluster is a window (about 2 s: a restarted master refuses writes until it
# has seen its peers) in which nodes answer CLUSTERDOWN and redis-py's cluster client
# closes every connection while the role's other coroutines are using them: the race that
# once crashed a scorer in CI with an error redis-py did not classify
# (`pipeline.bus.transient`). With the code before that fix, 16 flaps crashed a role in
# most runs (docs/guarantees.md, "Outages"); a plain Redis has no such window and is
# flapped less.
FLAPS = {"cluster": 16, "redis": 3}


def reconnects(p: Pipeline) -> dict[str, int]:
    """Each role's reconnect count, as its latest heartbeat says."""
    return {pre: int(p.worker(pre).get("reconnects", 0)) for pre in PREFIXES}


def check_back(p: Pipeline, since: float, more_than: dict[str, int] | None = None) -> None:
    """Every role is back: a heartbeat written after ``since`` (``time.time()``, this
    machine's clock, as the roles' are) saying healthy and, with ``more_than``, a reconnect
    count above it (the role met the outage and counted its recovery). A quick restart
    may pass unseen by a role (redis-py's own retries bridge it), so only an outage long
    enough to defeat them asserts ``more_than``. A role that crashed meanwhile fails the
    wait at once, named."""
    def back(pre: str) -> bool:
        w = p.worker(pre)
        return bool(w) and w["healthy"] and w["t"] > since and (
            more_than is None or w.get("reconnects", 0) > more_than[pre])

    for prefix in PREFIXES:
        p.wait(lambda pre=prefix: back(pre), 30,
               lambda pre=prefix: f"{pre} to report itself back (healthy, a heartbeat after "
                                  f"the restart{', a reconnect counted' if more_than else ''})"
                                  f"\n{p.logs()}")


def test_redis_restarted_then_down_ten_seconds(tmp_path, tiny_model_dir) -> None:
    """Two outages of one run: a clean restart (AOF: streams, groups, pending entries and
    counters survive), then Redis down for 10 s (no role exits or spins; work resumes)."""
    restart_then_outage(Pipeline(tmp_path, tiny_model_dir))


def test_redis_cluster_restarted_then_down_ten_seconds(tmp_path, tiny_model_dir) -> None:
    """The same on a 3-master Redis Cluster of the test's own (AOF on), the bus in 3
    lanes: every node restarted, then every node down for 10 s."""
    with EmbeddedCluster(tmp_path / "cluster", masters=3, appendonly=True) as cluster:
        restart_then_outage(Pipeline(tmp_path, tiny_model_dir, run="outage",
                                     cluster=cluster, partitions=3))


def restart_then_outage(pipeline: Pipeline) -> None:
    """A clean restart, a 10 s outage, then quick restarts in a row (`FLAPS`); every role
    survives each, and the whole history audits clean."""
    with pipeline as p:
        start_all(p)
        p.wait_trained(16)
        groups = p.group_names("rollouts")
        p.stop_redis()  # SHUTDOWN: the AOF is flushed; nothing acknowledged is lost
        p.faults += 1
        p.start_redis()
        state = p.state()
        assert state["cursor"] > 0 and state["retired:trained"] >= 16
        assert p.group_names("rollouts") == groups
        assert p.consumers("scored", "trainers")  # the trainer's pending list
        check_back(p, since=time.time())
        p.wait_trained(state["retired:trained"] + 16)

        before = reconnects(p)
        p.stop_redis()
        p.faults += 1
        time.sleep(1)  # let every role notice
        used = {n: cpu_s(p.procs[n].pid) for n in ROLES}
        time.sleep(10)
        spent = {n: cpu_s(p.procs[n].pid) - used[n] for n in ROLES}
        p.check_alive("while Redis was down for 10 s")
        p.start_redis()
        # waiting with capped backoff, not spinning: well under a core-second per second
        assert max(spent.values()) < 3.0, spent
        check_back(p, since=time.time(), more_than=before)
        for name in ROLES:  # each met the 10 s outage and said so, then said it was over
            assert "redis unavailable" in p.text(name) and "reachable again" in p.text(name), \
                p.log(name)
        p.wait_trained(p.trained() + 16)

        for _ in range(FLAPS["cluster" if p.cluster else "redis"]):
            p.stop_redis()
            p.faults += 1
            time.sleep(0.5)
            p.start_redis()
            p.check_alive("while Redis was restarted again and again")
        check_back(p, since=time.time())
        p.wait_trained(p.trained() + 16)
        p.stop_all()
        p.assert_clean(min_trained=64)


def test_trainer_stalled_generators_stop_at_the_window_memory_flat(pipeline: Pipeline
                                                                   ) -> None:
    window = 2 * GROUPS_PER_STEP  # (max_staleness + 1) * groups_per_step
    with pipeline as p:
        start_all(p)
        p.wait_trained(16)
        p.procs["trainer-0"].send_signal(19)  # SIGSTOP: alive, holding its work, silent
        stalled_at = time.monotonic()
        p.faults += 1
        try:
            def sample() -> dict[str, int]:
                st = p.state()
                return {"cursor": st["cursor"], "in_flight": st["cursor"] - st["retired"],
                        "rollouts": p.length("rollouts"), "scored": p.length("scored"),
                        "memory": p.memory_bytes()}

            def settled() -> dict[str, Any]:
                """Where the stalled pipeline must come to rest, whatever the machine's
                speed: the window full, no group being generated, every rollout scored and
                handed on (or filtered), and the generator reporting its gate closed."""
                st = p.state()
                group = p.group("rollouts", SCORERS_GROUP)
                return {"in_flight": st["cursor"] - st["retired"],
                        "generating": st.get("generating", 0),
                        "leases": len(p.lease_owners()), "pending": group["pending"],
                        "undelivered": group["undelivered"],
                        "gate_closed": p.worker("generator/g0").get("gate_closed")}

            at_rest = {"in_flight": window, "generating": 0, "leases": 0, "pending": 0,
                       "undelivered": False, "gate_closed": True}
            p.wait(lambda: settled() == at_rest, 60,
                   lambda: f"the stalled pipeline to come to rest {at_rest} (it is at "
                           f"{settled()})\n{p.logs()}", 0.2)
            first = sample()
            samples: list[dict[str, int]] = []
            # flat for the rest of the stall, and for at least 5 s x (STALL_S - 10) // 5
            while (len(samples) < (STALL_S - 10) // 5
                   or time.monotonic() - stalled_at < STALL_S):
                time.sleep(5)
                samples.append(sample())
                assert samples[-1]["in_flight"] <= window, samples[-1]
            last = samples[-1]
            assert last["cursor"] == first["cursor"], "nothing admitted while stalled"
            assert last["rollouts"] == first["rollouts"] and last["scored"] == first["scored"]
            assert max(s["memory"] for s in samples) - first["memory"] < 256 * 1024, samples
            assert p.worker("generator/g0")["gate_closed"]
        finally:
            p.procs["trainer-0"].send_signal(18)  # SIGCONT
        p.wait_trained(p.trained() + 16)
        p.stop_all()
        p.assert_clean(min_trained=32)


def test_scorers_scaled_2_4_1_with_sigterm(pipeline: Pipeline) -> None:
    with pipeline as p:
        start_all(p)
        p.wait_trained(8)
        p.start("score", "s2")
        p.start("score", "s3")
        p.faults += 2

        def names() -> set[str]:
            return p.consumers("rollouts", SCORERS_GROUP)

        p.wait(lambda: {"s0", "s1", "s2", "s3"} <= names(), 60, f"4 scorers\n{p.logs()}")
        p.wait_trained(p.trained() + 16)
        for n in ("s1", "s2", "s3"):  # scale down to one, each with SIGTERM
            assert p.stop(n) == 0, p.log(n)
            p.faults += 1
            assert "left the group: yes" in p.log(n), p.log(n)
            assert n not in names(), "a stopped scorer with nothing pending leaves the group"
        p.wait_trained(p.trained() + 16)
        assert names() == {"s0"}
        p.stop_all()
        p.assert_clean(min_trained=40)
