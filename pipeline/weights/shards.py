"""Full weights as an HF folder: sharded safetensors behind ``model.safetensors.index.json``.

The format helpers of the `file` transport (`pipeline.weights.file`, whose docstring
describes the layout) and of deltas (`pipeline.weights.delta`): what to publish
(`publishable`), how tensors fill shards (`plan_shards`, `sharded_files`) and how an HF
folder is read back (`read_full`). Pure functions over tensors and directories; nothing
here touches a store.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from pipeline.weights.base import WeightSource
from pipeline.weights.store import INDEX, WeightError

SINGLE_FILE = "model.safetensors"  # an unsharded HF folder (a model directory itself)
DEFAULT_MAX_SHARD_BYTES = 2 * 2**30
# The safetensors header's metadata: one key, so the file's bytes are a function of the
# tensors alone. safetensors writes ``__metadata__`` from a hash map whose order is seeded
# per process, so two keys came out in either order and the same tensors published by two
# processes (a run and its replay) had different sha256s. "format": "pt" is what
# transformers and peft require of a safetensors checkpoint; the version is in the
# manifest, not here.
HEADER_PT = {"format": "pt"}
HEADER_DELTA = {"format": "delta"}


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
        yield name, save(tensors, metadata=HEADER_PT)
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
