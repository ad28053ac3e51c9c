"""The `nccl` transport: each version pushed to the vLLM servers over NCCL
(`pipeline.weights.nccl.NCCLWeightSync`), then written to the file store and announced
by the `file` transport it falls back to. Module doc of `pipeline.weights.nccl`: the
orchestration, its ordering invariants and why a failed push never stops the run."""

from __future__ import annotations

import logging
from pathlib import Path

from pipeline.bus.schema import WeightsPublished
from pipeline.weights.base import WeightSource, WeightTransport
from pipeline.weights.file import FileTransport
from pipeline.weights.nccl import NCCLWeightSync
from pipeline.weights.nccl_binding import NCCLBindingError, planned_update_info
from pipeline.weights.shards import serving_items

log = logging.getLogger("sluice.nccl")


class NCCLTransport(WeightTransport):
    """Push each version to the vLLM servers over NCCL, then publish it with ``fallback``
    (whose store generators verify and reload from). `start` joins the group.

    Invariants: `start` and `publish` never raise for an NCCL failure or timeout (the
    sync bounds them, module docstring); every version is in the store and announced
    whatever happened to its push; ``fallbacks`` counts the versions published without
    a completed push (also ``stats["weight_fallbacks"]``, cumulative)."""

    name = "nccl"
    format = "safetensors"

    def __init__(self, sync: NCCLWeightSync, fallback: FileTransport) -> None:
        super().__init__(fallback.store)
        self.sync, self.fallback = sync, fallback
        self.fallbacks = 0
        self._told_unusable = False

    async def start(self) -> None:
        """Join the servers' group. A join that fails or times out leaves the sync
        broken: every version then goes through the file store (logged, counted). One
        that cannot work as installed (`NCCLBindingError`) stops the trainer instead."""
        try:
            await self.sync.init()
        except NCCLBindingError:
            raise
        except Exception as e:
            self.sync.broken = self.sync.broken or f"joining the group failed: {e!r}"
            log.error("NCCL weight-transfer group not formed (%s); every version goes "
                      "through the file store", e)
            self._told_unusable = True

    async def close(self) -> None:
        await self.sync.close()
        await self.fallback.close()

    async def publish(self, source: WeightSource, *, version: int,
                      step: int) -> WeightsPublished:
        stats: dict[str, float] = {}
        pushed = False
        if self.sync.group is not None and not self.sync.broken:
            try:
                # what the store gets, cast one tensor at a time as it is sent: the
                # GPU never holds a second, serving-dtype copy of the model
                src = self.fallback.serving_source(source)
                info = planned_update_info(src, self.fallback.dtype)
                stats["nccl_pause_s"] = await self.sync.push(
                    serving_items(src, self.fallback.dtype), version, info=info)
                pushed = True
            except Exception as e:  # the store + announcement below still carry it
                log.error("NCCL weight push of v%d failed, it goes through the file store: "
                          "%s", version, e)
                self._told_unusable = bool(self.sync.broken)
        elif not self._told_unusable:
            log.warning("NCCL weight sync unusable (%s): v%d and later versions go through "
                        "the file store", self.sync.broken or "no group", version)
            self._told_unusable = True
        if not pushed:
            self.fallbacks += 1
        msg = await self.fallback.publish(source, version=version, step=step)
        self.stats = {**self.fallback.stats, **stats, "weight_fallbacks": float(self.fallbacks)}
        return msg

    def write(self, source: WeightSource, *, version: int, step: int) -> WeightsPublished:
        return self.fallback.write(source, version=version, step=step)

    async def receive(self, msg: WeightsPublished) -> Path:
        """The file store's side (a delta rebuilt there): servers that missed a push."""
        return await self.fallback.receive(msg)
