"""The `file` transport: full weights as sharded safetensors with an HF-style index.

A version directory holds ``model-00001-of-0000N.safetensors`` … and
``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes of all tensors},
"weight_map": {tensor name: shard}}``), the layout ``save_pretrained`` writes and both
vLLM (``collective_rpc reload_weights`` with the directory as ``weights_path``) and
transformers read. Tensors fill shards in state-dict order; a shard closes before the
tensor that would take it past ``max_shard_bytes`` (one tensor larger than that gets a
shard of its own). A small model gets one shard, still behind an index.

Each shard is serialised to bytes in memory (``safetensors.torch.save``), hashed and
written (`WeightStore.commit`): the trainer never re-reads a file to hash it, and holds
at most one shard's bytes (plus its CPU copy, for GPU tensors) at a time. Tensors are
cast to the serving dtype one at a time and moved to the CPU as they are cast
(`FileTransport.serving_items`): the GPU holds one cast tensor beyond the live model,
not a second copy of it in the serving dtype.

Tied embeddings (``tie_word_embeddings``: ``lm_head.weight`` *is*
``model.embed_tokens.weight``): a tensor sharing storage with an earlier one is
published as its own copy (safetensors refuses shared storage). HF's ``save_pretrained``
drops the alias instead, but then vLLM-CPU keeps serving the OLD lm_head after a reload:
its packed lm_head GEMM weights are rebuilt only when the checkpoint names
``lm_head.weight`` (measured on vllm-cpu 0.32; ``tests/vllm/test_tied.py``). With the
copy, vLLM reloads both and transformers' load copies both into the one tied tensor.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from pipeline.bus.schema import WeightsPublished
from pipeline.weights.base import WeightSource, WeightTransport
from pipeline.weights.delta import FORMAT as DELTA_FORMAT
from pipeline.weights.delta import DeltaPublisher, Rebuilder
from pipeline.weights.shards import (
    DEFAULT_MAX_SHARD_BYTES,
    SINGLE_FILE,
    aliases,
    nbytes,
    plan_shards,
    publishable,
    read_full,
    serving_items,
    serving_sizes,
    shard_name,
    sharded_files,
    streamed_shards,
)
from pipeline.weights.store import WeightStore

__all__ = ["DEFAULT_MAX_SHARD_BYTES", "SINGLE_FILE", "FileTransport", "aliases", "nbytes",
           "plan_shards", "publishable", "read_full", "serving_items", "shard_name",
           "sharded_files"]


class FileTransport(WeightTransport):
    """Full weights through the store (the default transport); with ``full_every`` > 1
    a full version every ``full_every`` versions and deltas between them
    (`pipeline.weights.delta`). Any instance receives both kinds: a delta is rebuilt into
    a full directory under ``cache_dir`` (default: ``weights-cache`` beside the store's
    directory) and returned only once its state hash matches the announcement."""

    name = "file"
    format = "safetensors"

    def __init__(self, root: str | Path | WeightStore, *, keep: int = 4,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 dtype: torch.dtype | None = None, full_every: int = 1,
                 cache_dir: str | Path | None = None) -> None:
        """``root``: the store's directory, or a store (`pipeline.weights.open_store`;
        ``keep`` is then the store's own). ``dtype``: the serving dtype versions are
        written in (`publishable`); None keeps each tensor's own."""
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
        store = root if isinstance(root, WeightStore) else WeightStore(root, keep=keep)
        super().__init__(store)
        self.max_shard_bytes = max_shard_bytes
        self.dtype = dtype
        self.deltas = DeltaPublisher(full_every) if full_every > 1 else None
        cache = Path(cache_dir) if cache_dir is not None else store.root.parent / "weights-cache"
        self.rebuilder = Rebuilder(store, cache, max_shard_bytes)

    def write(self, source: WeightSource, *, version: int, step: int) -> WeightsPublished:
        t0 = time.perf_counter()
        if self.deltas is not None:
            msg = self.deltas.write(self.store, source, dtype=self.dtype, version=version,
                                    step=step, max_shard_bytes=self.max_shard_bytes)
        else:  # streamed: one cast tensor on the GPU at a time (`serving_items`)
            src = self.serving_source(source)
            msg = self.store.commit(streamed_shards(
                serving_items(src, self.dtype), serving_sizes(src, self.dtype),
                version=version, max_shard_bytes=self.max_shard_bytes),
                fmt=self.format, version=version, step=step)
        self.stats = {"publish_s": time.perf_counter() - t0, "publish_bytes": msg.nbytes}
        if self.deltas is not None:
            self.stats["publish_delta"] = float(msg.format == DELTA_FORMAT)
        return msg

    def serving_source(self, source: WeightSource) -> WeightSource:
        """What a full version of ``source`` is made of before the serving cast: the
        source itself. Subclasses that publish something derived from it
        (`MergedLoraTransport`: the merged adapter) override this alone, so `write`,
        `serving_items` and `serving_state` all carry the same tensors."""
        return source

    def serving_items(self, source: WeightSource) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors a full version of ``source`` holds, as engines load them (names,
        shapes, serving dtype), one at a time on the model's device (`serving_items` of
        `pipeline.weights.shards`): a consumer that sends or moves each one and drops it
        holds one cast tensor at a time. `write` streams these into shards; a push to the
        engines (the `nccl` transport) should iterate them too rather than take
        `serving_state`, so the push and the store carry the same tensors."""
        return serving_items(self.serving_source(source), self.dtype)

    def serving_state(self, source: WeightSource) -> dict[str, torch.Tensor]:
        """`serving_items` all at once (every cast tensor alive together, on the model's
        device: a second copy of the model in the serving dtype)."""
        return dict(self.serving_items(source))

    async def receive(self, msg: WeightsPublished) -> Path:
        return await asyncio.to_thread(self.fetch, msg)

    def fetch(self, msg: WeightsPublished) -> Path:
        """The blocking part of `receive`: a full version's verified directory, or a
        delta's rebuilt one (`Rebuilder.rebuild`)."""
        if msg.format == DELTA_FORMAT:
            return self.rebuilder.rebuild(msg)
        path = self.store.verify(msg)
        self.rebuilder.received(msg, path)
        return path

    async def close(self) -> None:
        self.rebuilder.close()

    def load(self, msg: WeightsPublished) -> dict[str, torch.Tensor]:
        """An announced version's tensors, verified (a delta: rebuilt; blocking)."""
        return read_full(self.fetch(msg))
