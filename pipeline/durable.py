"""Crash-safe folder and file writes: write under a temporary name, fsync, rename, fsync
the parent; the rename is the commit point.

Used by the trainer's checkpoints (`trainer.checkpoint`), the weight store
(`pipeline.weights.store`) and the archive (`pipeline.archive.store`). Why every fsync:
without them a machine crash (power loss, a kernel panic) after the rename can leave the
new name pointing at files whose data never reached the disk, and a reader would load a
folder that looks complete and is not. A process crash (kill -9) is covered by the rename
alone: a temporary name is never read, and the next writer removes it (`remove_temp`).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

TEST_PAUSE_ENV = "SLUICE_TEST_WRITE_PAUSE_S"
"""Test-only: seconds to sleep after each file written into a temporary folder, so a
fault test's kill -9 lands inside a checkpoint write or a weight publish. Unset: none."""


def test_pause() -> None:
    """Sleep `TEST_PAUSE_ENV` seconds (fault tests only; nothing when unset)."""
    pause_s = float(os.environ.get(TEST_PAUSE_ENV) or 0)
    if pause_s > 0:
        time.sleep(pause_s)


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush ``path``'s entries (a rename or a new file in it) to the disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file of ``folder`` (one level: checkpoints and versions are flat), then
    the folder itself."""
    for p in folder.iterdir():
        if p.is_file():
            fsync_file(p)
    fsync_dir(folder)


def commit_dir(tmp: Path, final: Path) -> None:
    """Make the complete folder ``tmp`` appear as ``final``, durably: its files and
    itself fsynced, renamed, the parent fsynced. An existing ``final`` (a re-write of the
    same step or version) is moved aside first and deleted only after the new one is
    durable, so a crash at any moment leaves the old one or the new one under a name a
    reader can find: ``final``, or the aside name ``.old-<name>-<pid>``, which
    `remove_temp` puts back when ``final`` is missing (a crash between the two renames)
    and deletes otherwise."""
    fsync_tree(tmp)
    aside = None
    if final.exists():
        aside = final.parent / f".old-{final.name}-{os.getpid()}"
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def remove_dir(path: Path) -> None:
    """Delete the folder ``path`` so that no reader ever finds half of it under its name:
    renamed to a temporary name first (the delete's commit point), then removed. A crash
    in the middle leaves a ``.tmp-`` folder that `remove_temp` finishes; a plain rmtree cut
    short by kill -9 left ``path`` with some of its files and no manifest."""
    gone = path.parent / f".tmp-gone-{path.name}-{os.getpid()}"
    try:
        os.replace(path, gone)
    except FileNotFoundError:  # already gone
        return
    shutil.rmtree(gone, ignore_errors=True)


def remove_temp(root: Path, prefixes: tuple[str, ...] = (".tmp-", ".old-")) -> list[Path]:
    """Remove the temporary and set-aside folders and files under ``root`` left by a
    writer that crashed (of any PID: the caller is the only writer, e.g. the lock's
    holder); returns what it removed."""
    if not root.is_dir():
        return []
    gone = [p for p in root.iterdir() if p.name.startswith(prefixes)]
    for p in gone:
        if p.name.startswith(".old-") and p.is_dir():  # ".old-<name>-<pid>"
            original = root / p.name[len(".old-"):].rsplit("-", 1)[0]
            if not original.exists():  # crashed between the renames: the old one is it
                os.replace(p, original)
                fsync_dir(root)
                continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return gone
