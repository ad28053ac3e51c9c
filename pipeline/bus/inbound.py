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
passes it in; the scorer and the trainer's reader both go through here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from pipeline.bus.client import Bus, Entry
from pipeline.bus.codec import DecodeError, decode_entry
from pipeline.bus.schema import Limits

M = TypeVar("M")

DeadLetter = Callable[[Entry, str], Awaitable[None]]
"""The role's dead-letter of one entry with a reason (it retires the entry's group)."""


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
        await dead_letter(e, too_many.format(n=e.deliveries))
        return None
    try:
        msg = decode_entry(e.fields, limits, expect=expect)
    except DecodeError as err:
        await dead_letter(e, f"decode: {err}")
        return None
    assert isinstance(msg, expect)
    return msg
