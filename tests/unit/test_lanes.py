"""Partitions of the bus as pure arithmetic: lane tags, global cursors, window shares,
summed state, and the ACL patterns that cover a run's lanes."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from pipeline.bus.keys import Keys, lane_tags
from pipeline.bus.lanes import Lanes, add_states
from sluice.acl import with_lanes


@pytest.mark.parametrize("run", ["copy", "e2e", "t0123456789", "a.b-c_d"])
@pytest.mark.parametrize("partitions", [1, 2, 3, 5, 8])
def test_lane_tags_are_distinct_and_each_in_its_own_slot_range(run: str,
                                                                partitions: int) -> None:
    tags = lane_tags(run, partitions)
    assert len(set(tags)) == partitions
    span = 16384 / partitions
    assert [int(key_slot(f"{{{t}}}".encode()) // span) for t in tags] == list(range(partitions))
    assert all(t == run or t.startswith(run + "~") for t in tags)
    assert tags == lane_tags(run, partitions)  # every role computes the same


def test_one_partition_is_the_run_itself() -> None:
    assert lane_tags("copy", 1) == ["copy"]
    assert Keys("copy").lanes(1) == [Keys("copy")]
    assert Keys("copy").lanes(1)[0].rollouts == "sluice:{copy}:rollouts"
    with pytest.raises(ValueError, match="lane tag"):
        Keys("copy", "other~1")


def test_global_cursors_round_trip_and_never_collide() -> None:
    lanes = Lanes(Keys("copy"), 3)
    seen = set()
    for lane in range(3):
        for local in range(50):
            g = lanes.join(lane, local)
            assert lanes.split(g) == (lanes.keys[lane], local)
            seen.add(g)
    assert seen == set(range(150))
    assert Lanes(Keys("copy"), 1).split(7) == (Keys("copy"), 7)


@pytest.mark.parametrize(("window", "partitions"), [(16, 3), (3, 3), (17, 4), (16, 1)])
def test_window_shares_add_up_and_each_lane_gets_one(window: int, partitions: int) -> None:
    lanes = Lanes(Keys("r"), partitions)
    shares = [lanes.window(window, i) for i in range(partitions)]
    assert sum(shares) == window and min(shares) >= 1 and max(shares) - min(shares) <= 1


def test_streams_belong_to_their_lane() -> None:
    lanes = Lanes(Keys("copy"), 3)
    for k in lanes.keys:
        assert lanes.of_stream(k.scored) == k and lanes.of_stream(k.dlq) == k
    assert lanes.of_stream(Keys("copy").control) == Keys("copy")
    assert len(lanes.streams("rollouts")) == 3


def test_state_sums_counters_of_lanes_and_keeps_the_global_version() -> None:
    glob = {"version": 7, "partitions": 3}
    lanes = [{"cursor": 5, "retired": 3, "retired:trained": 3, "generating": 1, "version": 7},
             {"cursor": 4, "retired": 4, "retired:stale": 1, "retired:trained": 3}]
    got = add_states(glob, lanes)
    assert got == {"version": 7, "partitions": 3, "cursor": 9, "retired": 7,
                   "retired:trained": 6, "retired:stale": 1, "generating": 1}
    # one partition: the global hash is the lane's, counted once
    one = {"version": 2, "cursor": 4, "retired": 4}
    assert add_states(one, [one]) == one


def test_acl_patterns_cover_the_lanes_of_one_run_only() -> None:
    line = "user x (~sluice:{copy}:rollouts %W~sluice:{copy}:scored +xadd)"
    got = with_lanes(line, "sluice:{copy}")
    assert "~sluice:{copy~*}:rollouts" in got and "%W~sluice:{copy~*}:scored" in got
    assert "~sluice:{copy}:rollouts" in got
    assert with_lanes("user x (~sluice:{*}:rollouts)", "sluice:{*}") == \
        "user x (~sluice:{*}:rollouts)"
