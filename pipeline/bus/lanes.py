"""The partitions of a run's bus (`bus.partitions`), as pure arithmetic.

A run with P partitions has P *lanes* (`pipeline.bus.keys.lane_tags`): each its own
``rollouts``, ``scored``, ``dlq``, ``state`` counters, ``leases`` and op keys under one hash
tag, so each Lua script still touches one slot. Roles above the bus see one sequence of
*global cursors*: lane ``i``'s local cursor ``c`` is global cursor ``c * P + i``. Global
cursors are unique across lanes, so a group id derived from one (``epoch:prompt_index``)
is unique too, and a generator's leases, ledger and prompt order need not know lanes
exist. With P = 1 the global cursor is the local one.

The admission window W is shared out: lane ``i`` admits while its in-flight count is below
``W // P`` (+1 for the first ``W % P`` lanes), so the lanes together never hold more than W
groups, the bound that keeps Redis memory and staleness in check (docs/design.md §4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.bus.keys import Keys

COUNTERS = ("cursor", "retired", "generating", "undecodable")
"""State fields that are per lane and add up over lanes (with ``retired:<reason>``);
``undecodable`` counts dead-lettered entries that did not decode, apart from the books."""


@dataclass(frozen=True)
class Lanes:
    """The lanes of one run: ``run`` is the run's global `Keys`."""

    run: Keys
    partitions: int = 1
    keys: list[Keys] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", self.run.lanes(self.partitions))

    def split(self, cursor: int) -> tuple[Keys, int]:
        """The lane of a global cursor and its cursor within that lane."""
        return self.keys[cursor % self.partitions], cursor // self.partitions

    def join(self, lane: int, local: int) -> int:
        """The global cursor of lane ``lane``'s cursor ``local``."""
        return local * self.partitions + lane

    def window(self, window: int, lane: int) -> int:
        """Lane ``lane``'s share of an admission window of ``window`` groups."""
        return window // self.partitions + (1 if lane < window % self.partitions else 0)

    def streams(self, name: str) -> list[str]:
        """Every lane's key of stream ``name`` (``rollouts``, ``scored`` or ``dlq``)."""
        return [k.stream(name) for k in self.keys]

    def of_stream(self, stream: str) -> Keys:
        """The lane owning the stream key ``stream`` (the run's keys for a global one)."""
        for k in self.keys:
            if stream in (k.rollouts, k.scored, k.dlq):
                return k
        return self.run

    def state_keys(self) -> list[str]:
        """Every distinct ``state`` hash: the run's global one (version, partitions) and
        each lane's (its counters; a lane may share the global hash's tag and key)."""
        return list(dict.fromkeys([self.run.state, *(k.state for k in self.keys)]))


def add_states(global_state: dict[str, int], lane_states: list[dict[str, int]]
               ) -> dict[str, int]:
    """The run's state as one hash: the counters (`COUNTERS`, ``retired:<reason>``) summed
    over lanes, every other field (``version``, ``partitions``) from the global hash."""
    out = {k: v for k, v in global_state.items()
           if k not in COUNTERS and not k.startswith("retired:")}
    for st in lane_states:
        for k, v in st.items():
            if k in COUNTERS or k.startswith("retired:"):
                out[k] = out.get(k, 0) + int(v)
    return out
