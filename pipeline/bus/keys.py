"""Redis key names of one run.

Every key of a run shares the hash tag ``{run}`` so a Lua script or MULTI block that
touches several of them lands on one Redis Cluster slot. Nothing else in sluice builds
key strings by hand.

Partitions (`bus.partitions` = P > 1) split the bus into P *lanes*, each a self-contained
copy of the keys the delivery scripts touch together — ``rollouts``, ``scored``, ``dlq``,
``state`` (cursor and retirement counters, and a mirror of the weight version), ``leases``
and the op keys — under its own hash tag, so every script still touches one slot while
Redis Cluster spreads the lanes over its masters. What stays global, under ``{run}``: the
weight version and the partition count (``state``), ``control``, the heartbeats
(``workers:<role>``) and the trainer lock, all written by one role or by plain commands.
With P = 1 the one lane *is* ``{run}``: the keys of a run are the same as before
partitions existed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

RUN_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$"
"""A run name (``run.name``): 1-64 letters, digits, ``_``, ``.``, ``-``, not starting with
``.`` or ``-``. It becomes part of Redis keys and of file and folder names (tracker runs,
deploy renders), so it can never be ``.``/``..``, hold a ``/``, be hidden or look like a
command-line option. `pipeline.config.RunConfig` uses this same pattern."""
_RUN_NAME = re.compile(RUN_NAME_PATTERN)

SCORERS_GROUP = "scorers"
TRAINERS_GROUP = "trainers"
ARCHIVERS_GROUP = "archivers"
"""The archiver's consumer group on ``scored`` (only when ``archive.enabled``): the janitor
trims only what every group acknowledged, so `scored` keeps what the archive still needs."""
RETIRE_REASONS = ("trained", "filtered", "stale", "dead")

OP_ROLES = ("generator", "scorer", "trainer")
"""The roles that run idempotent scripts, each in its own op namespace (`Keys.op`): the
ACL (deploy/redis/users.acl) lets each role's user read and write only its own, so a
compromised role cannot plant a stored result that makes another role's call look done."""

HEARTBEAT_ROLES = ("generator", "scorer", "trainer", "evaluator", "archiver")
"""The roles that heartbeat, each into its own hash (`Keys.heartbeats`), writable only by
that role's ACL user; readers (`Bus.workers`) merge them."""

GROUP_ROLE = {SCORERS_GROUP: "scorer", TRAINERS_GROUP: "trainer"}
"""The role that consumes for each consumer group: it owns the op keys of the scripts that
ack that group's entries (retire, hand-off, dead-letter)."""


LANE_SEP = "~"
"""Separates a run name from a lane number in a lane's hash tag (``{copy~2}``); run names
cannot contain it, so ``sluice:{RUN~*}`` names exactly the lanes of RUN (the ACL uses it)."""


def lane_tags(run: str, partitions: int) -> list[str]:
    """The hash tag of each of ``partitions`` lanes of ``run``.

    Lane i takes the first of ``run``, ``run~1``, ``run~2``, … not taken by an earlier lane
    whose slot lies in the i-th of ``partitions`` equal ranges of the 16384 slots. A cluster
    made by ``redis-cli --cluster create`` gives each master one such equal, contiguous
    range, so with as many masters as partitions each lane lands on its own master (a
    resharded cluster may put two lanes on one master: still correct, less spread). A pure
    function of the name and P: every role computes the same lanes without asking Redis.
    With P = 1 the one tag is ``run`` itself."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    span = REDIS_CLUSTER_HASH_SLOTS / partitions
    tags: list[str] = []
    for lane in range(partitions):
        k = 0
        while True:
            tag = run if k == 0 else f"{run}{LANE_SEP}{k}"
            if tag not in tags and int(key_slot(f"{{{tag}}}".encode()) // span) == lane:
                break
            k += 1
        tags.append(tag)
    return tags


@dataclass(frozen=True)
class Keys:
    """The key names of run ``run`` (its global keys); `lanes` gives those of each
    partition. Construct with a validated run name; ``tag`` (default: the run name) is
    the hash tag of a lane, from `lane_tags`."""

    run: str
    tag: str = ""

    def __post_init__(self) -> None:
        if not _RUN_NAME.fullmatch(self.run):
            raise ValueError(
                f"run name {self.run!r} must be 1-64 characters of letters, digits, '_', '.', "
                "'-', not starting with '.' or '-'"
            )
        if self.tag == self.run:  # the run's own tag: the same keys, equal to Keys(run)
            object.__setattr__(self, "tag", "")
        if self.tag and not re.fullmatch(
                re.escape(self.run + LANE_SEP) + r"[0-9]+", self.tag):
            raise ValueError(f"lane tag {self.tag!r} is not one of run {self.run!r}")

    @property
    def prefix(self) -> str:
        return f"sluice:{{{self.tag or self.run}}}"

    def lanes(self, partitions: int) -> list[Keys]:
        """The keys of each of ``partitions`` lanes (`lane_tags`); lane 0 of one partition
        is the run's own keys."""
        return [Keys(self.run, tag) for tag in lane_tags(self.run, partitions)]

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

    def heartbeats(self, role: str) -> str:
        """Hash ``role/id`` -> JSON heartbeat of the workers of one role (one of
        `HEARTBEAT_ROLES`): ``…:workers:<role>``. One key per role so that each ACL user
        may write only its own role's heartbeats (a compromised scorer cannot fake or
        erase the trainer's, which `sluice up` and `sluice status` act on)."""
        if role not in HEARTBEAT_ROLES:
            raise ValueError(f"heartbeats belong to one of {HEARTBEAT_ROLES}, not {role!r}")
        return f"{self.prefix}:workers:{role}"

    def heartbeat_key(self, wid: str) -> str:
        """The heartbeat hash of worker ``wid`` (``role/id``, `pipeline.bus.client.worker_id`)."""
        return self.heartbeats(wid.partition("/")[0])

    @property
    def leases(self) -> str:
        """Hash cursor -> "owner|deadline_ms" of admitted groups not yet appended."""
        return f"{self.prefix}:leases"

    @property
    def skipped(self) -> str:
        """Hash epoch -> how many of the epoch's cursors (of this lane) the prompt filter
        skipped, counted by the SKIP script with the retirement itself (exactly once per
        cursor): when the lanes' counts of an epoch sum to the dataset's size, the filter
        rejected the whole epoch (`workers.prompt_filter`). One small field per epoch."""
        return f"{self.prefix}:skipped"

    @property
    def loop(self) -> str:
        """Hash row index -> JSON value: the rollout loop's shared per-prompt state
        (`pipeline.bus.loop_state`), global (plain commands only, no script touches it).
        At most one field per dataset row, each at most `LOOP_VALUE_MAX_BYTES`."""
        return f"{self.prefix}:loop"

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

    def stream(self, name: str) -> str:
        """Full key of a stream given its short name (``rollouts``, ``scored``, …)."""
        if name not in ("rollouts", "scored", "control", "dlq"):
            raise ValueError(f"unknown stream {name!r}; expected rollouts, scored, control or dlq")
        return f"{self.prefix}:{name}"
