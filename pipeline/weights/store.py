"""The weight store: one directory per version, every file listed in a sha256 manifest.

Layout: ``<store>/v<N>/`` (``<store>`` = ``weights.store``, by default
``<output_dir>/weights``) holds the format's files (`file`: sharded safetensors +
``model.safetensors.index.json``; a `file` delta: ``delta-*.safetensors`` + ``delta.json``,
`pipeline.weights.delta`; `lora`: ``adapter_model.safetensors`` + ``adapter_config.json``)
and ``manifest.json``::

    {"version": N, "step": S, "format": "safetensors",
     "files": {"<name>": "<sha256 hex>", ...}, "bytes": {"<name>": <size>, ...}}

The announced sha256 is that of the manifest's canonical file table (`table_sha256`):
one line ``<sha256 hex>  <name>\\n`` per file, sorted by name, UTF-8 — exactly what
``sha256sum`` prints for those files in name order, so
``cd v<N> && sha256sum $(ls | grep -v manifest.json) | sha256sum`` reproduces it.

Writing (`WeightStore.commit`) hashes each file's bytes as they are written; nothing is
read back. A version is written into ``.tmp-v<N>-<pid>/``, every file and the folder
fsynced, renamed to ``v<N>`` (the commit point) and the parent fsynced
(`pipeline.durable.commit_dir`); a failed write removes its temporary folder, and the
trainer removes those a crashed writer left when it takes the lock (`clean_temp`).
``guard`` (set by the trainer: its lock's fence) is called before a version is written,
before its rename and before pruning, and refuses a trainer that lost its lock.
Verifying (`WeightStore.verify`) streams every listed file through sha256.
This class is a directory store (local disk or a shared filesystem);
`pipeline.weights.s3.S3WeightStore` keeps the same layout as objects in a bucket.

Retention: versions older than ``keep`` behind the newest are pruned, except that a
commit may name ``keep_from``, the oldest version still needed (the full version a chain
of deltas starts from), which is kept with everything after it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from pipeline.bus.schema import WeightsPublished
from pipeline.durable import commit_dir, remove_dir, remove_temp, test_pause

MANIFEST = "manifest.json"
INDEX = "model.safetensors.index.json"  # HF's name; vLLM and transformers read it
ADAPTER_FILE = "adapter_model.safetensors"  # peft's names; vLLM's load_lora_adapter
ADAPTER_CONFIG = "adapter_config.json"
DELTA_INFO = "delta.json"  # a delta version's description (pipeline/weights/delta.py)
MAX_MANIFEST_BYTES = 16 * 2**20
MAX_INDEX_BYTES = 256 * 2**20


class WeightError(ValueError):
    """Announced weights cannot be used (bad URI, missing or unlisted file, hash mismatch)."""


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    """sha256 of a file, streamed (constant memory whatever its size)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def table_sha256(files: Mapping[str, str]) -> str:
    """sha256 of the canonical file table (lines ``<sha256>  <name>``, sorted by name):
    the one hash an announcement carries for a whole multi-file version."""
    table = "".join(f"{files[name]}  {name}\n" for name in sorted(files))
    return hashlib.sha256(table.encode()).hexdigest()


def expired(version: int, newest: int, keep: int, keep_from: int | None = None) -> bool:
    """Whether retention drops ``version``: older than the window of ``keep`` versions
    behind ``newest``, and older than ``keep_from`` (the oldest version still needed)."""
    floor = newest - keep if keep_from is None else min(newest - keep, keep_from)
    return version < floor


def _plain_name(name: object) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\\" not in name and name != MANIFEST)


def tallied(files: Iterable[tuple[str, bytes]], digests: dict[str, str],
            sizes: dict[str, int]) -> Iterator[tuple[str, bytes]]:
    """Each ``(name, bytes)`` of ``files``, once its name is checked (plain, not repeated:
    ValueError) and its sha256 and size are recorded in ``digests`` and ``sizes``: the
    manifest every store writes. Lazy, and holds no file after handing it on, so a
    publish keeps one file in memory at a time."""
    for name, data in files:
        if not _plain_name(name) or name in digests:
            raise ValueError(f"bad or repeated weight file name {name!r}")
        digests[name] = hashlib.sha256(data).hexdigest()
        sizes[name] = len(data)
        yield name, data
        del data


class WeightStore:
    """Version directories under ``root``; see the module docstring for the layout.

    Versions older than ``keep`` behind the newest published are pruned (the staleness
    window). `verify` refuses a URI outside ``root`` (after resolving symlinks of the
    directory and of each file), so a hostile announcement cannot make a role or a vLLM
    server read any other path.
    """

    def __init__(self, root: str | Path, *, keep: int = 4) -> None:
        self.root = Path(root).resolve()
        self.keep = keep
        self.guard: Callable[[], None] | None = None  # the trainer lock's fence

    def _check(self) -> None:
        if self.guard is not None:
            self.guard()

    def clean_temp(self) -> list[Path]:
        """Remove the temporary folders crashed writers left (any PID: one trainer, the
        lock's holder, writes the store)."""
        return remove_temp(self.root)

    def dir_for(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def uri_for(self, version: int) -> str:
        """The URI an announcement of ``version`` names."""
        return self.dir_for(version).as_uri()

    @property
    def location(self) -> str:
        """Where versions are published (for messages): the directory, or the bucket URL."""
        return str(self.root)

    # ------------------------------------------------------------------ writing
    def commit(self, files: Iterable[tuple[str, bytes]], *, fmt: str, version: int,
               step: int, keep_from: int | None = None) -> WeightsPublished:
        """Write ``files`` (name, bytes; produced lazily, one in memory at a time) as
        ``v<version>/`` atomically: each is hashed as written, then the manifest, then
        the temporary directory is renamed into place and old versions are pruned
        (`prune`, with ``keep_from``)."""
        self._check()
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.dir_for(version)
        tmp = self.root / f".tmp-v{version:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        digests: dict[str, str] = {}
        sizes: dict[str, int] = {}
        try:
            tmp.mkdir()
            for name, data in tallied(files, digests, sizes):
                with open(tmp / name, "wb") as f:
                    f.write(data)
                del data
                test_pause()
            (tmp / MANIFEST).write_text(json.dumps(
                {"version": version, "step": step, "format": fmt, "files": digests,
                 "bytes": sizes}, indent=1, sort_keys=True))
            self._check()
            # a re-publish of the same version (e.g. after a restart) replaces it only
            # once the new copy is durable
            commit_dir(tmp, final)
        except BaseException as e:
            if isinstance(e, Exception) and not tmp.exists():
                # only a newer lock holder removes our temporary folder (it cleans
                # them all when it starts): the guard then says so (`TrainerLockLost`)
                self._check()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._check()
        self.prune(version, keep_from)
        nbytes = sum(sizes.values())
        return WeightsPublished(version=version, step=step, uri=final.as_uri(), format=fmt,
                                sha256=table_sha256(digests), nbytes=nbytes, t=time.time())

    def prune(self, newest: int, keep_from: int | None = None) -> None:
        """Remove versions older than ``newest - keep`` (and than ``keep_from``), each
        renamed away before it is deleted (`pipeline.durable.remove_dir`): a kill -9 in
        the middle never leaves a ``v<N>`` folder with some of its files."""
        for d in self.root.glob("v*"):
            try:
                v = int(d.name[1:])
            except ValueError:
                continue
            if expired(v, newest, self.keep, keep_from):
                remove_dir(d)  # never a half version under its name

    # ------------------------------------------------------------------ reading
    def path_of(self, uri: str) -> Path:
        parsed = urlparse(uri)
        if parsed.scheme != "file":
            raise WeightError(f"unsupported weight URI scheme in {uri!r}")
        path = Path(unquote(parsed.path)).resolve()
        if not path.is_relative_to(self.root):
            raise WeightError(f"weight URI {uri!r} lies outside the weight store {self.root}")
        return path

    def _inside(self, path: Path, what: str) -> Path:
        if not path.resolve().is_relative_to(self.root):  # a symlinked file inside the store
            raise WeightError(f"{what}: {path} resolves outside the weight store {self.root}")
        return path

    def manifest(self, msg: WeightsPublished) -> tuple[Path, dict[str, Any]]:
        """The version's directory and its manifest, checked against the announcement
        (version, format, and the file table's sha256) but not yet against the files."""
        directory = self.path_of(msg.uri)
        what = f"weights v{msg.version}"
        path = self._inside(directory / MANIFEST, what)
        if not path.is_file():
            raise WeightError(f"{what}: {path} does not exist")
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            raise WeightError(f"{what}: {MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
        try:
            man = json.loads(path.read_bytes())
            files = man["files"]
            ok = (isinstance(files, dict) and files
                  and all(_plain_name(k) and isinstance(v, str) for k, v in files.items()))
        except (ValueError, KeyError, TypeError) as e:
            raise WeightError(f"{what}: unreadable {MANIFEST}: {e}") from e
        if not ok:
            raise WeightError(f"{what}: {MANIFEST} lists no files or bad file names")
        digest = table_sha256(files)
        if digest != msg.sha256:
            raise WeightError(f"{what}: sha256 {digest[:12]}… of the manifest's file table "
                              f"does not match the announced {msg.sha256[:12]}…")
        if man.get("version") != msg.version or man.get("format") != msg.format:
            raise WeightError(f"{what}: the manifest is for v{man.get('version')} "
                              f"({man.get('format')}), the announcement for v{msg.version} "
                              f"({msg.format})")
        return directory, man

    def verify(self, msg: WeightsPublished) -> Path:
        """The announced version's directory, after checking its location, its manifest
        against the announcement, every listed file's sha256 (streamed) and size, that
        no unlisted file is present, and the format's layout. Blocking: disk + hashing."""
        directory, man = self.manifest(msg)
        what = f"weights v{msg.version}"
        files: dict[str, str] = man["files"]
        sizes = man.get("bytes") or {}
        present = {p.name for p in directory.iterdir()} - {MANIFEST}
        unlisted = sorted(present - files.keys())
        if unlisted:
            raise WeightError(f"{what}: files not in the manifest: {unlisted[:3]}")
        for name in sorted(files):
            path = self._inside(directory / name, what)
            if not path.is_file():
                raise WeightError(f"{what}: {path} does not exist")
            if name in sizes and path.stat().st_size != sizes[name]:
                raise WeightError(f"{what}: {name} has {path.stat().st_size} bytes, the "
                                  f"manifest says {sizes[name]}")
            digest = sha256_file(path)
            if digest != files[name]:
                raise WeightError(f"{what}: sha256 {digest[:12]}… of {name} does not match "
                                  f"the manifest's {files[name][:12]}…")
        _check_layout(directory, msg.format, set(files), what)
        return directory


def _check_layout(directory: Path, fmt: str, files: set[str], what: str) -> None:
    """The files an engine needs for ``fmt`` are there (and, for full weights, the index
    maps every tensor to a listed shard, and every listed shard is in the index)."""
    if fmt == "lora":
        missing = {ADAPTER_FILE, ADAPTER_CONFIG} - files
        if missing:
            raise WeightError(f"{what}: a lora version without {sorted(missing)}")
        return
    if fmt == "delta":
        _check_delta_layout(directory, files, what)
        return
    if fmt != "safetensors":
        raise WeightError(f"{what}: unknown weight format {fmt!r}")
    if INDEX not in files:
        raise WeightError(f"{what}: {INDEX} does not exist")
    if (directory / INDEX).stat().st_size > MAX_INDEX_BYTES:
        raise WeightError(f"{what}: {INDEX} is larger than {MAX_INDEX_BYTES} bytes")
    try:
        weight_map = json.loads((directory / INDEX).read_bytes())["weight_map"]
        shards = set(weight_map.values())
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightError(f"{what}: unreadable {INDEX}: {e}") from e
    listed = {f for f in files if f.endswith(".safetensors")}
    if not shards or shards != listed:
        raise WeightError(f"{what}: the index names shards {sorted(shards)[:3]}, the "
                          f"manifest {sorted(listed)[:3]}")


def _check_delta_layout(directory: Path, files: set[str], what: str) -> None:
    """A delta version: ``delta.json`` (bounded, a JSON map) names exactly the listed
    ``.safetensors`` files as its shards."""
    if DELTA_INFO not in files:
        raise WeightError(f"{what}: a delta version without {DELTA_INFO}")
    if (directory / DELTA_INFO).stat().st_size > MAX_MANIFEST_BYTES:
        raise WeightError(f"{what}: {DELTA_INFO} is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        shards = set(json.loads((directory / DELTA_INFO).read_bytes())["shards"])
    except (ValueError, KeyError, TypeError) as e:
        raise WeightError(f"{what}: unreadable {DELTA_INFO}: {e}") from e
    listed = {f for f in files if f.endswith(".safetensors")}
    if shards != listed:
        raise WeightError(f"{what}: {DELTA_INFO} names shards {sorted(shards)[:3]}, the "
                          f"manifest {sorted(listed)[:3]}")
