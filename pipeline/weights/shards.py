"""Full weights as an HF folder: sharded safetensors behind ``model.safetensors.index.json``.

The format helpers of the `file` transport (`pipeline.weights.file`, whose docstring
describes the layout) and of deltas (`pipeline.weights.delta`): what to publish
(`publishable`, streamed: `serving_items`), how tensors fill shards (`plan_shards`,
`sharded_files`, `streamed_shards`) and how an HF
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


def serving_items(source: WeightSource, dtype: torch.dtype | None = None
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors to publish (`publishable`), one at a time, in state-dict order, each
    on its own device: a tensor is cast to ``dtype`` only when it is reached, so a
    consumer that moves each one off the GPU (or sends it) and drops it holds one cast
    tensor at a time, never a second copy of the model (~15 GB at 7B in bf16). An alias
    (tied embeddings) comes out as its own tensor (a cast already is one; otherwise a
    clone)."""
    state = source.state_dict() if isinstance(source, torch.nn.Module) else dict(source)
    copies = aliases(state)
    for k, t in state.items():
        t = t.detach()
        out = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        if k in copies and out.data_ptr() == t.data_ptr():
            out = out.clone()
        yield k, out
        del out, t  # the consumer's reference is the only one left


def serving_sizes(source: WeightSource, dtype: torch.dtype | None = None) -> dict[str, int]:
    """Bytes of each tensor `serving_items` yields, from shapes and dtypes alone (nothing
    is cast), so shards can be planned before any tensor is materialised."""
    state = source.state_dict() if isinstance(source, torch.nn.Module) else dict(source)
    return {k: t.numel() * (torch.empty((), dtype=dtype).element_size()
                            if dtype is not None and t.is_floating_point()
                            else t.element_size())
            for k, t in state.items()}


def publishable(source: WeightSource, dtype: torch.dtype | None = None
                ) -> dict[str, torch.Tensor]:
    """The tensors to publish, keyed as ``model.state_dict()`` and detached; an alias
    (tied embeddings) becomes its own copy (see the module docstring). With ``dtype``
    (the serving dtype, ``model.dtype``) floating-point tensors are cast to it: engines
    compute in that dtype anyway, so float32 master weights would only double the bytes
    written, hashed and read per version. All at once, on the tensors' devices: the
    `file` transport streams instead (`serving_items`)."""
    return dict(serving_items(source, dtype))


def plan_shards(state: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names per shard, in order; never empty (an empty state is one empty shard)."""
    return plan_by_size({k: nbytes(t) for k, t in state.items()}, max_shard_bytes)


def plan_by_size(sizes: Mapping[str, int], max_shard_bytes: int) -> list[list[str]]:
    """`plan_shards` from each tensor's byte count alone."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, n in sizes.items():
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def sharded_files(state: Mapping[str, torch.Tensor], *, version: int,
                  max_shard_bytes: int) -> Iterator[tuple[str, bytes]]:
    """(file name, bytes) of each shard, then of the index; lazily, one shard at a time."""
    return streamed_shards(iter(state.items()), {k: nbytes(t) for k, t in state.items()},
                           version=version, max_shard_bytes=max_shard_bytes)


def streamed_shards(items: Iterator[tuple[str, torch.Tensor]], sizes: Mapping[str, int], *,
                    version: int, max_shard_bytes: int) -> Iterator[tuple[str, bytes]]:
    """`sharded_files` of tensors that arrive one at a time (`serving_items`), planned
    from ``sizes`` (`serving_sizes`, in the items' order): each tensor is moved to the CPU
    as it arrives and the device copy dropped, so the device holds one produced tensor at
    a time and the host one shard. ``version`` is part of the signature for symmetry with
    the callers' (the bytes do not depend on it)."""
    plan = plan_by_size(sizes, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for i, names in enumerate(plan, start=1):
        name = shard_name(i, len(plan))
        tensors: dict[str, torch.Tensor] = {}
        for want in names:
            got, t = next(items)
            if got != want:
                raise ValueError(f"tensor {got!r} arrived where the plan has {want!r}")
            tensors[got] = t.to("cpu").contiguous()
            del t
        yield name, save(tensors, metadata=HEADER_PT)
        weight_map.update(dict.fromkeys(names, name))
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
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
