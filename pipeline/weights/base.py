"""The weight-transport contract: how version N gets from the trainer to the engines.

Two halves, so that neither role imports the other (docs/design.md, "Weights"):

- trainer side, `WeightTransport.publish`: make ``version`` loadable by every engine and
  return its announcement (`WeightsPublished`), which the trainer then puts on
  ``control``;
- engine side, `WeightTransport.receive`: check an announced version and return the
  directory that an engine's ``load_weights(path, version, format)`` reads.

Implementations: `file` (full weights, sharded safetensors, optionally deltas between
full versions), `lora` (a peft adapter), `nccl` (a push to vLLM servers, with `file` as
the store engines fall back to). Every
transport leaves each version in the run's `WeightStore`, so an engine that missed a
push, or restarted, reloads it from there.

Invariants every implementation keeps (``tests/unit/test_transports.py`` checks each):
1. Complete or absent: a version becomes visible whole (written under a temporary name,
   renamed into place), and `publish` returns only after that, so an announcement never
   names a half-written version. Republishing a version replaces it.
2. Verified before use: `receive` returns only a directory inside the store whose every
   file hashes (streamed) to its manifest entry, whose manifest hashes to the announced
   sha256 (`pipeline.weights.store.table_sha256`) and which holds no unlisted file;
   anything else raises `WeightError` and changes nothing. From an s3:// store that
   directory is the version's copy in the local cache, downloaded and then verified
   there (`pipeline.weights.s3`); a delta's is its rebuilt full state in the cache,
   returned only once that state's sha256 is the announced one
   (`pipeline.weights.delta`).
3. Off the event loop: both halves do their disk and hashing work in a worker thread, so
   heartbeats, lease renewals and in-flight decoding keep running during a big write
   or check.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import torch

from pipeline.bus.schema import WeightsPublished
from pipeline.weights.store import WeightStore

WeightSource = Mapping[str, torch.Tensor] | torch.nn.Module
"""What the trainer publishes: a full state dict (keys as ``model.state_dict()``) or the
model itself (the `lora` transport needs the peft model)."""


class WeightTransport(ABC):
    name: ClassVar[str]  # the config's name: "file" | "lora" | "nccl"
    format: ClassVar[str]  # the announcements' format: "safetensors" | "lora"

    def __init__(self, store: WeightStore) -> None:
        self.store = store
        self.stats: dict[str, float] = {}  # last publish: seconds, bytes (metrics)

    async def start(self) -> None:
        """Connect before the first publish (`nccl`: join the servers' group)."""
        return None

    async def close(self) -> None:
        """Release what `start` set up."""
        return None

    async def publish(self, source: WeightSource, *, version: int,
                      step: int) -> WeightsPublished:
        """Trainer side: make ``version`` loadable (invariant 1) and return its
        announcement. ``source`` must not change until this returns."""
        return await asyncio.to_thread(self.write, source, version=version, step=step)

    @abstractmethod
    def write(self, source: WeightSource, *, version: int, step: int) -> WeightsPublished:
        """The blocking part of `publish`: write ``version`` into the store."""

    async def receive(self, msg: WeightsPublished) -> Path:
        """Engine side: the verified directory of an announced version (invariant 2)."""
        return await asyncio.to_thread(self.store.verify, msg)
