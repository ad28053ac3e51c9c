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
at most one shard's bytes (plus its CPU copy, for GPU tensors) at a time.

Tied embeddings (``tie_word_embeddings``: ``lm_head.weight`` *is*
``model.embed_tokens.weight``): a tensor sharing storage with an earlier one is
published as its own copy (safetensors refuses shared storage). HF's ``save_pretrained``
drops the alias instead, but then vLLM-CPU keeps serving the OLD lm_head after a reload:
its packed lm_head GEMM weights are rebuilt only when the checkpoint names
``lm_head.weight`` (measured on vllm-cpu 0.32; ``tests/vllm/test_tied.py``). With the
copy, vLLM reloads both and transformers' load copies both into the one tied tensor.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from pipeline.bus.schema import WeightsPublished
from pipeline.weights.base import WeightSource, WeightTransport
from pipeline.weights.store import INDEX, WeightError, WeightStore

SINGLE_FILE = "model.safetensors"  # an unsharded HF folder (a model directory itself)
DEFAULT_MAX_SHARD_BYTES = 2 * 2**30


def shard_name(i: int, n: int) -> str:
    """HF's shard file name, 1-based: ``model-00001-of-00003.safetensors``."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def aliases(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``{name: earlier name}`` for every tensor sharing storage with an earlier one
    (``lm_head.weight`` -> ``model.embed_tokens.weight`` when embeddings are tied)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, t in state.items():
        if t.numel() == 0 or t.device.type == "meta":
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in first:
            out[name] = first[ptr]
        else:
            first[ptr] = name
    return out


def publishable(source: WeightSource, dtype: torch.dtype | None = None
                ) -> dict[str, torch.Tensor]:
    """The tensors to publish, keyed as ``model.state_dict()`` and detached; an alias
    (tied embeddings) becomes its own copy (see the module docstring). With ``dtype``
    (the serving dtype, ``model.dtype``) floating-point tensors are cast to it: engines
    compute in that dtype anyway, so float32 master weights would only double the bytes
    written, hashed and read per version."""
    state = source.state_dict() if isinstance(source, torch.nn.Module) else dict(source)
    copies = aliases(state)
    out = {k: t.detach().clone() if k in copies else t.detach() for k, t in state.items()}
    if dtype is not None:
        out = {k: t.to(dtype) if t.is_floating_point() else t for k, t in out.items()}
    return out


def plan_shards(state: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names per shard, in order; never empty (an empty state is one empty shard)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        if shards[-1] and size + nbytes(t) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes(t)
    return shards


def sharded_files(state: Mapping[str, torch.Tensor], *, version: int,
                  max_shard_bytes: int) -> Iterator[tuple[str, bytes]]:
    """(file name, bytes) of each shard, then of the index; lazily, one shard at a time."""
    plan = plan_shards(state, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for i, names in enumerate(plan, start=1):
        name = shard_name(i, len(plan))
        tensors = {k: state[k].to("cpu").contiguous() for k in names}
        # "format": "pt" is what transformers requires of a safetensors checkpoint
        yield name, save(tensors, metadata={"format": "pt", "version": str(version)})
        weight_map.update(dict.fromkeys(names, name))
    index = {"metadata": {"total_size": sum(nbytes(t) for t in state.values())},
             "weight_map": weight_map}
    yield INDEX, json.dumps(index, indent=2).encode()


def read_full(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder (sharded behind an index, or one
    ``model.safetensors``) as CPU tensors. Each shard must hold exactly the tensors the
    index maps to it. Raises `WeightError` (layout) or safetensors' error (bytes)."""
    index = directory / INDEX
    if not index.is_file():
        if (directory / SINGLE_FILE).is_file():
            return load_file(str(directory / SINGLE_FILE), device="cpu")
        raise WeightError(f"{directory} has neither {INDEX} nor {SINGLE_FILE}")
    try:
        weight_map: dict[str, str] = json.loads(index.read_bytes())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightError(f"unreadable {index}: {e}") from e
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        if not isinstance(shard, str) or Path(shard).name != shard:
            raise WeightError(f"{index} names a shard outside its directory: {shard!r}")
        part = load_file(str(directory / shard), device="cpu")
        want = {k for k, s in weight_map.items() if s == shard}
        if set(part) != want:
            raise WeightError(f"{shard} holds {len(part)} tensors, the index maps "
                              f"{len(want)} to it")
        state.update(part)
    return state


class FileTransport(WeightTransport):
    """Full weights through the shared store (the default transport)."""

    name = "file"
    format = "safetensors"

    def __init__(self, root: str | Path, *, keep: int = 4,
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                 dtype: torch.dtype | None = None) -> None:
        """``dtype``: the serving dtype versions are written in (`publishable`); None
        keeps each tensor's own."""
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
        super().__init__(WeightStore(root, keep=keep))
        self.max_shard_bytes = max_shard_bytes
        self.dtype = dtype

    def write(self, source: WeightSource, *, version: int, step: int) -> WeightsPublished:
        t0 = time.perf_counter()
        state = publishable(source, self.dtype)
        msg = self.store.commit(sharded_files(state, version=version,
                                              max_shard_bytes=self.max_shard_bytes),
                                fmt=self.format, version=version, step=step)
        self.stats = {"publish_s": time.perf_counter() - t0, "publish_bytes": msg.nbytes}
        return msg

    def load(self, msg: WeightsPublished) -> dict[str, torch.Tensor]:
        """An announced version's tensors, after `WeightStore.verify` (blocking)."""
        return read_full(self.store.verify(msg))
