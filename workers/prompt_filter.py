"""The generator's prompt filter: which admitted prompts are generated, and the stop when
the filter rejects a whole epoch.

The filter is ``generation.rollout_loop``'s ``filter_prompt(row_index, row, epoch)``
(`workers.rollout_loop`: its per-row state is fetched for the batch first, and what it
assigns written after) or the one-argument ``generation.filter_prompt(row)``. A filter
that raises keeps its prompt and says why in the log (a bug in it must not empty the
run).

A whole epoch rejected: every skip is counted per epoch by the SKIP script that retires
the group (`pipeline.bus.admission.AdmissionWrites.skip`: exactly once per cursor, by
whichever generator held it), so after its skips a generator reads the epoch's count,
every lane summed; when it equals the dataset's size, no prompt of that epoch was kept
and none of a later one will be either unless the filter's state changes, which only
generated groups can do. Nothing is left to train on: the generator raises
`FilterRejectedEpoch` (a `pipeline.runtime.RoleFatal`), the CLI prints it and exits
`FATAL_EXIT_CODE`, and `sluice up` ends the run at once with the message instead of
restarting the generator into the same wall.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from pipeline.bus.client import Bus
from pipeline.config import Config
from pipeline.runtime import RoleFatal
from workers.hooks import load_filter
from workers.rollout_loop import RolloutLoop, load_loop

log = logging.getLogger("sluice.generator")


class FilterRejectedEpoch(RoleFatal):
    """The prompt filter rejected every prompt of an epoch (module docstring)."""


class PromptFilter:
    """The configured filter of one generator (``active`` False: none)."""

    def __init__(self, cfg: Config, num_prompts: int):
        self.loop: RolloutLoop | None = load_loop(cfg, "generator")
        self.hook: Callable[[dict[str, Any]], Any] | None = load_filter(cfg)
        self.num_prompts = num_prompts
        self.what = ("generation.rollout_loop's filter_prompt" if self.loop is not None
                     else "generation.filter_prompt")

    @property
    def active(self) -> bool:
        return self.loop is not None or self.hook is not None

    async def keep(self, bus: Bus, items: list[tuple[int, int, dict[str, Any]]]
                   ) -> list[bool]:
        """Per ``(epoch, row_index, row)``, whether the filter keeps it; a loop's state
        for these rows is read before (one HMGET) and what it assigned written after."""
        if self.loop is not None:
            rows = [i for _e, i, _r in items]
            self.loop.state.load(await bus.retrying(lambda: bus.loop_read(rows),
                                                    "read rollout loop state"))
        out = []
        for epoch, idx, row in items:
            try:
                if self.loop is not None:
                    wanted = bool(self.loop.filter_prompt(idx, row, epoch))
                else:
                    assert self.hook is not None
                    wanted = bool(self.hook(row))
            except Exception as e:
                log.warning("%s raised on prompt %d (kept): %r", self.what, idx, e)
                wanted = True
            out.append(wanted)
        if self.loop is not None:
            writes = self.loop.state.take_writes()
            if writes:
                await bus.retrying(lambda: bus.loop_write(writes), "write rollout loop state")
        return out

    async def check_epochs(self, bus: Bus, epochs: set[int]) -> None:
        """`FilterRejectedEpoch` when the filter has skipped every prompt of one of
        ``epochs`` (those this generator just skipped prompts of)."""
        for epoch in sorted(epochs):
            n = await bus.retrying(lambda e=epoch: bus.skipped_in_epoch(e), "skipped count")
            if n >= self.num_prompts:
                raise FilterRejectedEpoch(
                    f"{self.what} rejected all {self.num_prompts} prompts of epoch {epoch}: "
                    "no group is left to generate, so the run cannot go on. Make the "
                    "filter keep some prompts (a curriculum: keep those it has no "
                    "statistics for yet, or widen its thresholds).")
