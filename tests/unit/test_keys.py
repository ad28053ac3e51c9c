"""pipeline.bus.keys: one hash tag per run, validated run names, known streams only."""

from __future__ import annotations

import re

import pytest

from pipeline.bus.keys import (
    GROUP_ROLE,
    HEARTBEAT_ROLES,
    OP_ROLES,
    SCORERS_GROUP,
    TRAINERS_GROUP,
    Keys,
)

ALL = ("rollouts", "scored", "control", "dlq", "state")


def _hash_tag(key: str) -> str:
    """The part Redis Cluster hashes: between the first '{' and the next '}'."""
    m = re.search(r"\{([^}]*)\}", key)
    assert m, f"{key!r} has no hash tag"
    return m.group(1)


@pytest.mark.parametrize("run", ["copy", "a", "Run_1.v-2", "x" * 64])
def test_every_key_shares_the_run_hash_tag(run: str) -> None:
    k = Keys(run)
    keys = [getattr(k, name) for name in ALL] + [k.heartbeats(r) for r in HEARTBEAT_ROLES]
    assert all(_hash_tag(key) == run for key in keys)
    assert all(key.startswith(f"sluice:{{{run}}}:") for key in keys)
    assert len(set(keys)) == len(keys)


def test_key_names_are_stable() -> None:
    k = Keys("copy")
    assert k.rollouts == "sluice:{copy}:rollouts"
    assert k.dlq == "sluice:{copy}:dlq"
    assert k.state == "sluice:{copy}:state"


def test_different_runs_do_not_share_keys() -> None:
    a, b = Keys("a"), Keys("b")
    assert not {getattr(a, n) for n in ALL} & {getattr(b, n) for n in ALL}


@pytest.mark.parametrize(
    "run", ["", "a b", "a{b", "a}b", "a:b", "a/b", "x" * 65, "ü", "a\n"],
    ids=["empty", "space", "brace-open", "brace-close", "colon", "slash", "65", "unicode",
         "newline"],
)
def test_invalid_run_names_are_rejected(run: str) -> None:
    with pytest.raises(ValueError, match="run name"):
        Keys(run)


@pytest.mark.parametrize("name", ["rollouts", "scored", "control", "dlq"])
def test_stream_maps_short_names_to_the_stream_keys(name: str) -> None:
    k = Keys("r")
    assert k.stream(name) == getattr(k, name)


@pytest.mark.parametrize("name", ["state", "workers", "", "Rollouts", "rollouts:x"])
def test_stream_rejects_unknown_names(name: str) -> None:
    with pytest.raises(ValueError, match="unknown stream"):
        Keys("r").stream(name)


def test_op_keys_are_namespaced_by_the_role_that_owns_the_call() -> None:
    k = Keys("copy")
    assert k.op("trainer", "trained:trainer-0:1:1-0") == \
        "sluice:{copy}:op:trainer:trained:trainer-0:1:1-0"
    assert _hash_tag(k.op("scorer", "x")) == "copy"
    assert k.op("generator", "*") == "sluice:{copy}:op:generator:*"
    assert {GROUP_ROLE[g] for g in (SCORERS_GROUP, TRAINERS_GROUP)} <= set(OP_ROLES)
    for role in ("monitor", "evaluator", "admin", "", "trainer:x"):
        with pytest.raises(ValueError, match="op keys belong to"):
            k.op(role, "x")


def test_each_role_heartbeats_into_its_own_hash() -> None:
    k = Keys("r")
    assert k.heartbeat_key("scorer/s0") == k.heartbeats("scorer") == "sluice:{r}:workers:scorer"
    assert len({k.heartbeats(r) for r in HEARTBEAT_ROLES}) == len(HEARTBEAT_ROLES)
    with pytest.raises(ValueError, match="heartbeats belong"):
        k.heartbeat_key("monitor/m")


@pytest.mark.parametrize("run", ["..", ".", ".x", "-x", "a/b", ""])
def test_run_names_that_could_name_a_path_are_refused(run: str) -> None:
    with pytest.raises(ValueError, match="run name"):
        Keys(run)
