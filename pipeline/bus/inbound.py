"""What every consumer of the bus does first with an entry it read (`triage`).

Every entry a consumer reads is settled in exactly one place (docs/design.md, "Delivery").
Three outcomes are the same for every consumer, so they are decided here, before the role
looks at the message:

- deleted while pending (no fields): acknowledged, nothing else; there is no group to
  retire (whoever deleted the entry settled it);
- delivered more than ``max_deliveries`` times: dead-lettered, so an entry the role keeps
  failing on (a reward that raises, a step that raises, a crash mid-entry) cannot
  crash-loop it;
- undecodable: dead-lettered with the decoder's reason.

Dead-lettering belongs to the role (its op id, ledger line and counters), so the role
passes it in; the scorer and the trainer's reader both go through here. The role is
told the group id only of an entry that decodes: the ``gid`` of one that does not is
whatever its writer put there, and believing it let a forged entry retire a group that
is still in flight (``retired`` drifting past ``cursor - in_flight``). Such an entry is
dead-lettered with no group (`pipeline.bus.client.Bus.dead_letter` counts it
``undecodable``). An entry delivered too often is decoded for that alone: one that
decodes is a real group that keeps failing, and retires ``dead``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from pipeline.bus.client import Bus
from pipeline.bus.codec import DecodeError, decode_entry
from pipeline.bus.replies import Entry
from pipeline.bus.schema import Limits, RolloutGroup, ScoredGroup

M = TypeVar("M")

DeadLetter = Callable[[Entry, str, str | None], Awaitable[None]]
"""The role's dead-letter of one entry with a reason and the group id it decoded to
(the role retires that group ``dead``), or None: it did not decode (never retired)."""


def decoded_group_id(msg: object) -> str | None:
    """The group id of a decoded message (None for one that is not a group)."""
    if isinstance(msg, RolloutGroup):
        return msg.group_id
    if isinstance(msg, ScoredGroup):
        return msg.group.group_id
    return None


async def triage(bus: Bus, e: Entry, group: str, *, stream: str, expect: type[M],
                 limits: Limits, max_deliveries: int, dead_letter: DeadLetter,
                 too_many: str = "delivered {n} times") -> M | None:
    """The entry's message if the role is to act on it, else None once it is settled
    here (acked or dead-lettered, module docstring). ``stream`` is the lane read when
    the entry does not say (an entry built by hand); ``too_many`` is the role's reason
    for an entry delivered too often (``{n}``: its delivery count)."""
    e.stream = e.stream or stream
    if e.fields is None:
        await bus.retrying(lambda: bus.ack(e.stream, group, e.id), "ack")
        return None
    if e.deliveries > max_deliveries:
        try:
            gid = decoded_group_id(decode_entry(e.fields, limits, expect=expect))
        except DecodeError:
            gid = None
        await dead_letter(e, too_many.format(n=e.deliveries), gid)
        return None
    try:
        msg = decode_entry(e.fields, limits, expect=expect)
    except DecodeError as err:
        await dead_letter(e, f"decode: {err}", None)
        return None
    assert isinstance(msg, expect)
    return msg
