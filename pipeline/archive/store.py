"""Where the archive lives: a folder or any fsspec URL, and the files in it (docs/archive.md).

Layout under ``archive.path`` (default ``<output_dir>/archive``)::

    run.json                     the run's config and model pin (a copy of its run.json)
    groups/part-<archiver>-<seq>.parquet   the scored groups (`pipeline.archive.format`)
    dispositions.parquet         what became of every group (`pipeline.archive.history`)

Invariants:

- A file appears complete or not at all. On a local disk it is written under a temporary
  name, flushed to disk and renamed into place (the folder fsynced after the rename; a
  failed write removes its temporary file at once); on an object store (s3://, gs://, …) it is
  one PUT of the whole object, which the store makes visible atomically. So a reader (a
  replay, ``datasets``) never sees half a file written by a live archiver, and a killed
  archiver leaves at most a temporary file, which nothing reads (``.tmp-`` names are
  skipped, and `ArchiveStore.clean` removes its own).
- ``<seq>`` grows by one per file of one archiver name; `ArchiveStore.newest` is the last
  file that archiver wrote, the only one that may hold entries it had not acknowledged
  when it died (`workers.archiver`).
- Nothing here knows Redis: this is plain file handling, shared by the archiver, the
  replay and `sluice trace`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.archive.history import disposition_table, lives
from pipeline.bus.ledger import read_ledgers
from pipeline.config import Config, ConfigError
from pipeline.durable import fsync_dir

GROUPS = "groups"
DISPOSITIONS = "dispositions.parquet"
RUN_COPY = "run.json"
_PART = re.compile(r"^part-(?P<who>[A-Za-z0-9_.-]+)-(?P<seq>\d{8})\.parquet$")


class ArchiveReadError(ValueError):
    """An archive file cannot be read (truncated, corrupt, not Parquet); names the file."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def archive_url(cfg: Config) -> str:
    """``archive.path``, or ``<output_dir>/archive`` when it is empty."""
    return cfg.archive.path or str(cfg.output_path / "archive")


def safe_name(name: str) -> str:
    """An archiver's name as it appears in file names (``[A-Za-z0-9_.-]``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "archiver"


class ArchiveStore:
    """The files of one archive, through fsspec (``url``: a path or ``proto://...``)."""

    def __init__(self, url: str):
        try:
            self.fs, root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as e:
            raise ConfigError(f"archive.path: cannot open {url!r}: {e}") from None
        self.url = url
        self.root = root.rstrip("/")
        self.local = "file" in _protocols(self.fs)

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def display(self, path: str) -> str:
        """A path as the user would write it (with its URL scheme when remote)."""
        return path if self.local else self.fs.unstrip_protocol(path)

    # ------------------------------------------------------------------ writing
    def put(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` so that it appears whole or not at all (module
        docstring)."""
        parent = path.rsplit("/", 1)[0]
        if self.local:
            os.makedirs(parent, exist_ok=True)
            tmp = f"{parent}/.tmp-{uuid.uuid4().hex}"
            try:  # a failed write (a full disk) leaves no temporary file behind
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            fsync_dir(Path(parent))  # the rename itself reaches the disk
            return
        self.fs.makedirs(parent, exist_ok=True)
        self.fs.pipe_file(path, data)

    def write_table(self, path: str, table: pa.Table) -> int:
        """``table`` as a Parquet file at ``path`` (zstd); returns its size in bytes."""
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        data = buf.getvalue()
        self.put(path, data)
        return len(data)

    def write_groups(self, archiver: str, seq: int, table: pa.Table) -> tuple[str, int]:
        """The next file of ``archiver``: (its name, its size)."""
        name = f"part-{safe_name(archiver)}-{seq:08d}.parquet"
        return name, self.write_table(self.path(GROUPS, name), table)

    def write_run(self, record: dict[str, Any]) -> None:
        """The run's config and pin, once (an existing copy is the run's own)."""
        path = self.path(RUN_COPY)
        if not self.fs.exists(path):
            self.put(path, json.dumps(record, indent=1).encode())

    def clean(self) -> None:
        """Remove temporary files of interrupted local writes."""
        if self.local and os.path.isdir(self.path(GROUPS)):
            for p in Path(self.path(GROUPS)).glob(".tmp-*"):
                p.unlink(missing_ok=True)

    # ------------------------------------------------------------------ reading
    def files(self, archiver: str | None = None) -> list[str]:
        """Names of the group files (of one archiver when given), oldest first."""
        try:
            names = [p.rsplit("/", 1)[-1] for p in self.fs.ls(self.path(GROUPS), detail=False)]
        except FileNotFoundError:
            return []
        parts = [(m["who"], int(m["seq"]), n) for n in names if (m := _PART.match(n))]
        if archiver is not None:
            parts = [p for p in parts if p[0] == safe_name(archiver)]
        return [n for _, _, n in sorted(parts)]

    def newest(self, archiver: str) -> tuple[str | None, int]:
        """``archiver``'s last file and its sequence number ((None, 0) before any)."""
        own = self.files(archiver)
        if not own:
            return None, 0
        return own[-1], int(_PART.match(own[-1])["seq"])  # type: ignore[index]

    def read(self, name: str, columns: list[str] | None = None) -> pa.Table:
        """Group file ``name``; `ArchiveReadError` naming it if it is not a whole Parquet
        file of the archive's schema."""
        path = self.path(GROUPS, name)
        try:
            with self.fs.open(path, "rb") as f:
                return pq.read_table(f, columns=columns)
        except (OSError, pa.ArrowException, ValueError) as e:
            raise ArchiveReadError(self.display(path), f"{type(e).__name__}: {e}") from None

    def read_run(self) -> dict[str, Any] | None:
        path = self.path(RUN_COPY)
        if not self.fs.exists(path):
            return None
        return dict(json.loads(self.fs.cat_file(path)))

    def exists(self, name: str) -> bool:
        return bool(self.fs.exists(self.path(name)))


def _protocols(fs: Any) -> set[str]:
    p = fs.protocol
    return set(p) if isinstance(p, tuple | list) else {p}


def write_dispositions(cfg: Config, store: ArchiveStore | None = None) -> int:
    """What became of every group the run's ledgers name, as the archive's
    ``dispositions.parquet`` (replaced whole); returns its rows."""
    store = store or ArchiveStore(archive_url(cfg))
    table = disposition_table(lives(read_ledgers(cfg.output_path)))
    store.write_table(store.path("dispositions.parquet"), table)
    return int(table.num_rows)
