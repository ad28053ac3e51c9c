"""Where a model comes from: ``model.path`` as a local folder or a Hugging Face hub id,
resolved to one local folder and (for a hub id) one commit.

Rules (in this order):

- A ``model.path`` that exists, is absolute, or starts with ``./``, ``../`` or ``~`` is a
  **folder**: loaded as it is, ``model.revision`` ignored (there is no commit to pin).
- Otherwise an ``org/name`` (exactly one ``/``, a valid repo id) is a **hub id**: fetched
  through the normal Hugging Face cache with ``huggingface_hub.snapshot_download`` at
  ``model.revision`` (branch, tag or commit). ``HF_HOME`` / ``HF_HUB_CACHE`` and
  ``HF_HUB_OFFLINE`` are honoured, read when resolving (not when huggingface_hub was
  imported), so a process or test that sets them late is still obeyed. Offline, only the
  cache is read: ``refs/<revision>`` names the commit, ``snapshots/<commit>/`` holds it.
- Anything else (``tiny``, ``a/b/c`` that does not exist) is a folder that is missing.

A bare name such as ``gpt2`` is a folder, not a hub id: that keeps the old meaning of a
relative folder. Write ``./org/name`` for a relative folder shaped like a hub id.

Resolution is the only place that may touch the network; everything downstream loads
the returned folder (`pipeline.rundir` pins it once per run, so every role and every
resume loads the same commit).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import ConfigError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class ResolvedModel:
    """One model as every role loads it.

    ``local_dir`` is absolute and holds ``config.json``; ``revision`` is the commit sha of a
    hub id's snapshot, or None for a plain folder (pinned by path only: its files are not
    fingerprinted)."""

    source: str
    local_dir: str
    revision: str | None


def is_hub_id(path: str) -> bool:
    """True when ``model.path`` names a hub repo rather than a local folder (module rules)."""
    if not path or Path(path).expanduser().exists():
        return False
    if path.startswith(("/", "./", "../", "~", ".\\")) or Path(path).is_absolute():
        return False
    return bool(_HUB_ID.match(path)) and ".." not in path and not path.endswith(".git")


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as huggingface_hub reads it."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def cache_dir() -> Path:
    """The hub cache huggingface_hub uses: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(xdg) / "huggingface" / "hub"


def cached_commit(repo_id: str, revision: str) -> str | None:
    """The commit ``revision`` points to in the local cache (no network); None if the
    cache does not know it. A commit sha is its own answer."""
    if COMMIT.match(revision):
        return revision
    ref = cache_dir() / f"models--{repo_id.replace('/', '--')}" / "refs" / revision
    try:
        sha = ref.read_text().strip()
    except OSError:
        return None
    return sha if COMMIT.match(sha) else None


def resolve_model(path: str, revision: str = "main") -> ResolvedModel:
    """``model.path`` (folder or hub id) → the folder to load, and its commit.

    Raises ConfigError naming ``model.path`` (and the revision for a hub id) when there is
    no model: a folder without ``config.json``, a hub id not in the cache while offline,
    an unknown repo or revision online.
    """
    if not is_hub_id(path):
        folder = Path(path).expanduser().resolve()
        if not (folder / "config.json").is_file():
            raise ConfigError(
                f"model.path: no model at {folder} (no config.json); point it at a local "
                "model directory or a hub id (org/name), or build the tiny one with "
                "`sluice init-model DIR`")
        if revision != "main":
            print(f"sluice: model.revision {revision!r} is ignored: model.path {path!r} is a "
                  "local folder", file=sys.stderr)
        return ResolvedModel(path, str(folder), None)
    return _resolve_hub(path, revision)


def _resolve_hub(repo_id: str, revision: str) -> ResolvedModel:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"model.path: {repo_id!r} (revision {revision})"
    is_offline = offline()
    try:
        local = snapshot_download(repo_id, revision=revision, cache_dir=str(cache_dir()),
                                  local_files_only=is_offline)
    except LocalEntryNotFoundError:
        if is_offline:
            raise ConfigError(
                f"{where} is not in the local Hugging Face cache ({cache_dir()}) and "
                "HF_HUB_OFFLINE=1 forbids downloading it; download it once online "
                "(`hf download`), set HF_HOME to the cache that has it, or give a local "
                "folder (write ./org/name for a relative one)") from None
        raise ConfigError(f"{where}: the Hub cannot be reached and it is not in the local "
                          f"cache ({cache_dir()})") from None
    except RevisionNotFoundError:
        raise ConfigError(f"{where}: no such revision on the Hub (model.revision is a "
                          "branch, tag or commit)") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{where}: no such model on the Hub (or it is private/gated and "
                          "no token allows it); a local folder? write ./org/name") from None
    except HfHubHTTPError as e:
        raise ConfigError(f"{where}: the Hub refused: {e}") from None
    folder = Path(local).resolve()
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{where}: snapshot {folder} has no config.json (not a "
                          "transformers model)")
    sha = folder.name if COMMIT.match(folder.name) else cached_commit(repo_id, revision)
    return ResolvedModel(repo_id, str(folder), sha)
