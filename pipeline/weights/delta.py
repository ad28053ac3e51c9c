"""Delta versions: only the elements that changed since the previous version.

With ``weights.full_every = K > 1`` the `file` transport publishes a full version, then
K-1 deltas, then a full one again. Elements are compared bit for bit in the serving dtype
(``model.dtype``): at LLM learning rates most bf16 elements round to the same value after
a step, so a delta holds a few percent of them (``benchmarks/weights.py``).

A delta version directory (announced with format ``delta``, ``base`` = the version it
applies to) holds ``delta-0000i-of-0000n.safetensors`` and ``delta.json``. For each
changed tensor ``name`` the shards hold either ``idx/<name>`` (flat indices of the
changed elements: int32, int64 past 2**31 elements) with ``val/<name>`` (their new values,
in the tensor's dtype), or ``all/<name>`` (the whole tensor, where that is smaller).
``delta.json``::

    {"base": B, "base_state": "<sha256>", "state": "<sha256>", "shards": [...],
     "chain": [<announcement of the full version F>, <delta F+1>, ..., <version B>],
     "changed": <elements changed>, "elements": <elements in all>}

The state hash (`state_sha256`): sha256 over the tensors in name order, each as the line
``<name>\\t<dtype>\\t<comma-separated shape>\\n`` followed by its raw bytes (C order,
little-endian). Every announcement of a run with deltas carries it (``state``).

Invariants:
1. A delta never changes the set of tensors, a shape or a dtype: the publisher writes a
   full version instead when they change, every K versions, and whenever it holds no
   previous state (a restarted trainer starts with a full version).
2. The chain stays in the store: the newest full version and everything after it are
   never pruned (``keep_from``, `pipeline.weights.store.expired`).
3. `Rebuilder.rebuild` returns a directory (a full HF folder, as a `file` version) only
   when the rebuilt state's sha256 equals the announced ``state``. It starts from the
   version this process received or rebuilt last when that version is in the chain with
   the same state hash (the fast path: the delta's own base); otherwise, or when the
   result does not match (a wrong base), from the chain's full version, applying every
   delta of the chain. Anything else raises `WeightError` and the engine keeps its
   weights. Every file it reads is verified by the store first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save

from pipeline.bus.schema import WeightsPublished
from pipeline.weights.base import WeightSource
from pipeline.weights.shards import (
    HEADER_DELTA,
    nbytes,
    plan_shards,
    publishable,
    read_full,
    sharded_files,
)
from pipeline.weights.store import DELTA_INFO, WeightError, WeightStore

log = logging.getLogger("sluice.weights")
FORMAT = "delta"
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_WIDE = 2**31  # tensors with at least this many elements get int64 indices
_LOCK = ".lock"


def delta_shard_name(i: int, n: int) -> str:
    return f"delta-{i:05d}-of-{n:05d}.safetensors"


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1)


def state_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 of a whole state (see the module docstring); tensors on any device."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu()
        shape = ",".join(str(d) for d in t.shape)
        h.update(f"{name}\t{str(t.dtype).removeprefix('torch.')}\t{shape}\n".encode())
        h.update(memoryview(_flat(t).view(torch.uint8).numpy()))
    return h.hexdigest()


def same_layout(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Same tensor names, shapes and dtypes: a delta can take ``a`` to ``b``."""
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)


def diff(prev: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]
         ) -> tuple[dict[str, torch.Tensor], int]:
    """The delta payload taking ``prev`` to ``new`` (same layout, CPU tensors) and how
    many elements changed. Elements compare by their bits, so -0.0 vs 0.0 and NaN
    payloads are changes too, and applying the payload reproduces ``new`` exactly."""
    payload: dict[str, torch.Tensor] = {}
    changed = 0
    for name, t in new.items():
        size = t.element_size()
        a, b = _flat(prev[name]), _flat(t)
        if size in _BITS:
            idx = (a.view(_BITS[size]) != b.view(_BITS[size])).nonzero().reshape(-1)
        else:  # an element size no integer view has (complex128): all or nothing
            idx = torch.arange(b.numel()) if not torch.equal(a, b) else torch.empty(0)
        n = idx.numel()
        if n == 0:
            continue
        changed += n
        wide = b.numel() >= _WIDE
        if n * ((8 if wide else 4) + size) < nbytes(b):
            payload[f"idx/{name}"] = idx if wide else idx.to(torch.int32)
            payload[f"val/{name}"] = b[idx]
        else:
            payload[f"all/{name}"] = t.detach().contiguous()
    return payload, changed


def apply_delta(state: dict[str, torch.Tensor], payload: Mapping[str, torch.Tensor]) -> None:
    """Apply a delta payload to ``state`` in place; a payload that does not fit the state
    (unknown tensor, wrong dtype or shape, index out of range, a half pair) raises
    `WeightError` (``state`` may then be partly changed: rebuild from a full version)."""
    names: set[str] = set()
    for key in payload:
        kind, _, name = key.partition("/")
        if kind not in ("idx", "val", "all") or name not in state:
            raise WeightError(f"delta entry {key!r} names no tensor of the base")
        names.add(name)
    for name in sorted(names):
        t = state[name]
        if f"all/{name}" in payload:
            new = payload[f"all/{name}"]
            if new.shape != t.shape or new.dtype != t.dtype:
                raise WeightError(f"delta: {name} is {new.dtype} {list(new.shape)}, the base "
                                  f"{t.dtype} {list(t.shape)}")
            state[name] = new
            continue
        idx, val = payload.get(f"idx/{name}"), payload.get(f"val/{name}")
        if idx is None or val is None or idx.ndim != 1 or idx.shape != val.shape \
                or idx.dtype not in (torch.int32, torch.int64) or val.dtype != t.dtype:
            raise WeightError(f"delta: the entries of {name} are not an index/value pair "
                              f"of its dtype {t.dtype}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= t.numel()):
            raise WeightError(f"delta: an index of {name} is outside its {t.numel()} elements")
        if not t.is_contiguous():
            t = state[name] = t.contiguous()
        t.view(-1).index_copy_(0, idx.long(), val)


def delta_files(payload: Mapping[str, torch.Tensor], info: dict[str, Any], *, version: int,
                max_shard_bytes: int) -> Iterator[tuple[str, bytes]]:
    """(file name, bytes) of each delta shard, then of ``delta.json`` (``info`` plus the
    shard names); lazily, one shard at a time."""
    plan = plan_shards(payload, max_shard_bytes)
    names = [delta_shard_name(i, len(plan)) for i in range(1, len(plan) + 1)]
    for name, keys in zip(names, plan, strict=True):
        yield name, save({k: payload[k].contiguous() for k in keys},
                         metadata=HEADER_DELTA)
    yield DELTA_INFO, json.dumps({**info, "shards": names}, indent=1).encode()


def owned_cpu_state(source: WeightSource, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """What a version publishes (`publishable`), on the CPU and never sharing memory with
    the live model: the publisher keeps it as the next delta's base, so training must
    not change it underneath."""
    live = source.state_dict() if isinstance(source, torch.nn.Module) else dict(source)
    ptrs = {t.untyped_storage().data_ptr() for t in live.values() if t.device.type == "cpu"}
    out = {}
    for k, t in publishable(live, dtype).items():
        c = t.to("cpu")
        out[k] = c.clone() if c.untyped_storage().data_ptr() in ptrs else c
    return out


class DeltaPublisher:
    """The trainer's side: which version is full, the payload of the others, the chain.

    ``chain`` holds the announcements since the newest full version (it first); ``prev``
    the state last published. Both change only once a commit succeeded."""

    def __init__(self, full_every: int) -> None:
        if full_every < 2:
            raise ValueError(f"deltas need full_every >= 2, got {full_every}")
        self.full_every = full_every
        self.prev: dict[str, torch.Tensor] | None = None
        self.chain: list[WeightsPublished] = []
        self.changed = 0.0  # the last delta's fraction of elements changed (stats)

    def write(self, store: WeightStore, source: WeightSource, *, dtype: torch.dtype | None,
              version: int, step: int, max_shard_bytes: int) -> WeightsPublished:
        state = owned_cpu_state(source, dtype)
        digest = state_sha256(state)
        prev = self.prev
        if (prev is None or not self.chain or len(self.chain) >= self.full_every
                or version <= self.chain[-1].version or not same_layout(prev, state)):
            msg = store.commit(sharded_files(state, version=version,
                                             max_shard_bytes=max_shard_bytes),
                               fmt="safetensors", version=version, step=step)
            msg = dataclasses.replace(msg, state=digest)
            self.chain = [msg]
        else:
            payload, changed = diff(prev, state)
            elements = sum(t.numel() for t in state.values())
            base = self.chain[-1]
            info = {"base": base.version, "base_state": base.state, "state": digest,
                    "chain": [dataclasses.asdict(m) for m in self.chain],
                    "changed": changed, "elements": elements}
            msg = store.commit(delta_files(payload, info, version=version,
                                           max_shard_bytes=max_shard_bytes),
                               fmt=FORMAT, version=version, step=step,
                               keep_from=self.chain[0].version)
            msg = dataclasses.replace(msg, base=base.version, state=digest)
            self.chain.append(msg)
            self.changed = changed / max(elements, 1)
        self.prev = state
        return msg


def read_info(directory: Path, msg: WeightsPublished) -> tuple[dict[str, Any],
                                                                list[WeightsPublished]]:
    """A verified delta directory's ``delta.json`` and its chain, checked against the
    announcement (base, state) and for shape: a full version first, then deltas, in
    increasing versions, ending at the base."""
    what = f"weights v{msg.version}"
    try:
        info = json.loads((directory / DELTA_INFO).read_bytes())
        chain = [WeightsPublished(**m) for m in info["chain"]]
        base_state = info["base_state"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WeightError(f"{what}: unreadable {DELTA_INFO}: {e!r}") from None
    if info.get("base") != msg.base or info.get("state") != msg.state:
        raise WeightError(f"{what}: {DELTA_INFO} is for base v{info.get('base')}, the "
                          f"announcement for v{msg.base} (or another state)")
    versions = [m.version for m in chain]
    if (not chain or not all(type(v) is int for v in versions)
            or versions != sorted(set(versions)) or chain[0].format != "safetensors"
            or any(m.format != FORMAT for m in chain[1:]) or chain[-1].version != msg.base
            or chain[-1].state != base_state):
        raise WeightError(f"{what}: {DELTA_INFO} holds no valid chain from a full version "
                          f"to its base v{msg.base}")
    return info, chain


def read_payload(directory: Path, info: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    payload: dict[str, torch.Tensor] = {}
    for shard in info["shards"]:
        try:
            payload.update(load_file(str(directory / shard), device="cpu"))
        except Exception as e:  # safetensors raises its own error types on bad bytes
            raise WeightError(f"{directory.name}/{shard}: not a readable delta shard: "
                              f"{e}") from None
    return payload


class Rebuilder:
    """The engine side: full directories of delta versions, rebuilt in a cache directory
    of this process (``<cache_dir>/rebuilt/<random>/v<N>/``, the newest two kept).

    The directory holds an exclusive lock (`fcntl.flock`) while this process lives; one
    whose lock is free belonged to a process that died, and is removed when the next
    process's `Rebuilder` creates its own."""

    def __init__(self, store: WeightStore, cache_dir: Path, max_shard_bytes: int) -> None:
        self.store = store
        self.cache_dir = Path(cache_dir)
        self.max_shard_bytes = max_shard_bytes
        self.held: tuple[WeightsPublished, Path] | None = None  # newest received, its dir
        self._own: WeightStore | None = None
        self._lock: Any = None

    def received(self, msg: WeightsPublished, path: Path) -> None:
        """A full version was verified at ``path``: a base for the next deltas."""
        if msg.state:
            self.held = (msg, path)

    def rebuild(self, msg: WeightsPublished) -> Path:
        """The verified full directory of delta ``msg`` (invariant 3). Blocking."""
        directory = self.store.verify(msg)
        info, chain = read_info(directory, msg)
        starts: list[tuple[Path | None, int]] = []
        if self.held is not None:
            held, path = self.held
            at = [i for i, m in enumerate(chain)
                  if (m.version, m.state) == (held.version, held.state)]
            if at:
                starts.append((path, at[0]))
        starts.append((None, 0))
        last: Exception | None = None
        for path, i in starts:
            try:
                state = self._replay(path, chain, i)
                apply_delta(state, read_payload(directory, info))
            except (WeightError, OSError, ValueError) as e:
                last = e
                log.warning("weights v%d: rebuilding from v%d failed (%s)", msg.version,
                            chain[i].version, e)
                continue
            digest = state_sha256(state)
            if digest == msg.state:
                return self._write(msg, state)
            last = WeightError(f"weights v{msg.version}: the state rebuilt from "
                               f"v{chain[i].version} hashes to {digest[:12]}…, the "
                               f"announcement says {msg.state[:12]}…")
            log.warning("%s; %s", last, "falling back to the full version"
                        if path is not None else "refused")
        raise WeightError(f"weights v{msg.version}: cannot rebuild the delta: {last}")

    def _replay(self, path: Path | None, chain: list[WeightsPublished],
                i: int) -> dict[str, torch.Tensor]:
        """The state of ``chain[-1]`` (the delta's base), from ``path`` holding
        ``chain[i]`` (None: the chain's full version, verified from the store)."""
        state = read_full(path if path is not None else self.store.verify(chain[0]))
        for m in chain[i + 1:]:
            d = self.store.verify(m)
            minfo, _ = read_info(d, m)
            apply_delta(state, read_payload(d, minfo))
        return state

    def _write(self, msg: WeightsPublished, state: dict[str, torch.Tensor]) -> Path:
        own = self._own_store()
        own.commit(sharded_files(state, version=msg.version,
                                 max_shard_bytes=self.max_shard_bytes),
                   fmt="safetensors", version=msg.version, step=msg.step)
        path = own.dir_for(msg.version)
        self.held = (msg, path)
        return path

    def _own_store(self) -> WeightStore:
        if self._own is None:
            parent = self.cache_dir / "rebuilt"
            parent.mkdir(parents=True, exist_ok=True)
            for d in parent.iterdir():  # left by processes that died
                if d.is_dir() and _abandoned(d):
                    shutil.rmtree(d, ignore_errors=True)
            mine = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=parent))
            self._lock = open(mine / _LOCK, "w")  # held for the process's life
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._own = WeightStore(mine, keep=1)
        return self._own

    def close(self) -> None:
        """Remove this process's rebuilt versions."""
        if self._own is not None:
            shutil.rmtree(self._own.root, ignore_errors=True)
            self._lock.close()
            self._own = self._lock = None
            self.held = None


def _abandoned(directory: Path, grace_s: float = 60.0) -> bool:
    """Whether no live process holds ``directory``'s lock (one without a lock file is
    abandoned only after ``grace_s``: its owner may be about to take the lock)."""
    try:
        f = open(directory / _LOCK)
    except OSError:
        try:
            return time.time() - directory.stat().st_mtime > grace_s
        except OSError:
            return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        with contextlib.suppress(OSError):
            fcntl.flock(f, fcntl.LOCK_UN)
        return True
