"""The weight version a resuming trainer may trust: ``state.version`` checked against
``control``.

``state`` is a hash every writing role's user may ``HSET`` (the admission, lease and
retirement scripts write it, and Redis checks a script's commands against its caller's
ACL), so a compromised generator or scorer can write any ``version`` there, in the global
hash or in a lane's mirror. ``control`` is written by the trainer's user only (the ACL,
deploy/redis/users.acl), and `pipeline.bus.control.announce` appends a version's
announcement there *before* it moves ``state.version``. So a ``version`` above the newest
announcement on ``control`` was never set by a trainer: it is forged (or left by a
tool). `verified_version` returns the version the trainer can vouch for and writes it
back over every forged copy, naming what it found, so that neither the trainer (which
resumes at the version after it) nor the generators (which read it from their lane
through ADMIT) act on a forged one.
"""

from __future__ import annotations

import logging

from pipeline.bus import control
from pipeline.bus.client import Bus

log = logging.getLogger("sluice.version_check")


class ForgedVersion(RuntimeError):
    """Raised by `verified_version` with ``repair=False`` when a version is forged."""


async def verified_version(bus: Bus, *, repair: bool = True) -> int:
    """The run's weight version as a trainer may trust it on resume: the global
    ``state.version`` when the newest announcement on ``control`` backs it (is at least
    as new), else that announcement's version (-1: none). Any ``state`` hash (global or a
    lane's mirror) holding a version above it is logged with its key and value and, with
    ``repair`` (the default), set back to it (0 when nothing was announced yet: what
    ADMIT reads for "no version"); without ``repair``, `ForgedVersion` is raised.

    Call it as the trainer (the run's owner, holding the trainer lock): it writes
    ``state`` with plain HSET, and only the trainer's ACL user may run this check's reads
    of ``control`` and its writes together."""
    msg = await control.latest(bus)
    announced = msg.version if msg is not None else -1
    forged: dict[str, int] = {}
    versions: dict[str, int] = {}
    for key in bus.lanes.state_keys():
        raw = await bus.r.hget(key, "version")
        if raw is None:
            continue
        versions[key] = int(raw)
        if int(raw) > announced:
            forged[key] = int(raw)
    if forged:
        found = ", ".join(f"{k} version={v}" for k, v in forged.items())
        text = (f"state.version not backed by control: {found}, but the newest weight "
                f"announcement on control is version {announced}; a role other than the "
                "trainer wrote it (every writing role may write `state`)")
        if not repair:
            raise ForgedVersion(text)
        fixed = max(announced, 0)
        log.error("%s: not trusted, reset to %d", text, fixed)
        for key in forged:
            await bus.r.hset(key, "version", fixed)
            versions[key] = fixed
    return versions.get(bus.lanes.state_keys()[0], -1)  # now <= max(announced, 0)
