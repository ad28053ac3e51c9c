"""Redis key names of one run.

Every key of a run shares the hash tag ``{run}`` so a Lua script or MULTI block that
touches several of them lands on one Redis Cluster slot. Nothing else in sluice builds
key strings by hand.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_RUN_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

SCORERS_GROUP = "scorers"
TRAINERS_GROUP = "trainers"
RETIRE_REASONS = ("trained", "filtered", "stale", "dead")

OP_ROLES = ("generator", "scorer", "trainer")
"""The roles that run idempotent scripts, each in its own op namespace (`Keys.op`): the
ACL (deploy/redis/users.acl) lets each role's user read and write only its own, so a
compromised role cannot plant a stored result that makes another role's call look done."""

GROUP_ROLE = {SCORERS_GROUP: "scorer", TRAINERS_GROUP: "trainer"}
"""The role that consumes for each consumer group: it owns the op keys of the scripts that
ack that group's entries (retire, hand-off, dead-letter)."""


@dataclass(frozen=True)
class Keys:
    """The key names of run ``run``; construct with a validated run name."""

    run: str

    def __post_init__(self) -> None:
        if not _RUN_NAME.fullmatch(self.run):
            raise ValueError(
                f"run name {self.run!r} must be 1-64 characters of letters, digits, '_', '.', '-'"
            )

    @property
    def prefix(self) -> str:
        return f"sluice:{{{self.run}}}"

    @property
    def rollouts(self) -> str:
        return f"{self.prefix}:rollouts"

    @property
    def scored(self) -> str:
        return f"{self.prefix}:scored"

    @property
    def control(self) -> str:
        return f"{self.prefix}:control"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}:dlq"

    @property
    def state(self) -> str:
        return f"{self.prefix}:state"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    @property
    def leases(self) -> str:
        """Hash cursor -> "owner|deadline_ms" of admitted groups not yet appended."""
        return f"{self.prefix}:leases"

    @property
    def trainer_lock(self) -> str:
        """String ``job id`` with a TTL: the one trainer job allowed to train this run."""
        return f"{self.prefix}:trainer"

    def op(self, role: str, op_id: str) -> str:
        """Result of one idempotent script call of ``role`` (one of `OP_ROLES`), kept
        `pipeline.bus.scripts.OP_TTL_S` seconds: ``…:op:<role>:<op id>``. Namespaced by role
        so that each ACL user is granted only its own role's results."""
        if role not in OP_ROLES:
            raise ValueError(f"op keys belong to one of {OP_ROLES}, not {role!r}")
        return f"{self.prefix}:op:{role}:{op_id}"

    def op_pattern(self, role: str) -> str:
        """The glob of ``role``'s op keys (what its ACL user is granted)."""
        return self.op(role, "*")

    def stream(self, name: str) -> str:
        """Full key of a stream given its short name (``rollouts``, ``scored``, …)."""
        if name not in ("rollouts", "scored", "control", "dlq"):
            raise ValueError(f"unknown stream {name!r}; expected rollouts, scored, control or dlq")
        return f"{self.prefix}:{name}"
