"""The `file` weight store: one directory per version, safetensors + sha256 manifest.

Invariants:
- A version directory appears only complete: it is written under a temporary name and
  renamed into place, so a reader never sees half a checkpoint.
- The announced sha256 is that of ``model.safetensors``; `FileWeightStore.load` refuses
  a file whose hash differs, and refuses a URI outside the store's root (a hostile
  announcement cannot make a generator read arbitrary paths).
- Versions older than ``keep`` behind the newest are pruned (the staleness window).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import torch
from safetensors.torch import load_file, save_file

from pipeline.schema import WeightsPublished

WEIGHTS_FILE = "model.safetensors"
MANIFEST = "manifest.json"


class WeightError(ValueError):
    """Weights could not be loaded (bad URI, missing file, hash mismatch)."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class FileWeightStore:
    def __init__(self, root: str | Path, *, keep: int = 4):
        self.root = Path(root).resolve()
        self.keep = keep

    def dir_for(self, version: int) -> Path:
        return self.root / f"v{version:08d}"

    def publish(self, state: dict[str, torch.Tensor], *, version: int,
                step: int) -> WeightsPublished:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.dir_for(version)
        tmp = self.root / f".tmp-v{version:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"version": str(version)})
        digest = sha256_file(tmp / WEIGHTS_FILE)
        nbytes = (tmp / WEIGHTS_FILE).stat().st_size
        (tmp / MANIFEST).write_text(json.dumps(
            {"version": version, "step": step, "files": {WEIGHTS_FILE: digest}}))
        if final.exists():  # a re-publish of the same version (e.g. after a restart)
            shutil.rmtree(final)
        os.replace(tmp, final)
        self.prune(version)
        return WeightsPublished(version=version, step=step, uri=final.as_uri(),
                                format="safetensors", sha256=digest, nbytes=nbytes,
                                t=time.time())

    def prune(self, newest: int) -> None:
        for d in self.root.glob("v*"):
            try:
                v = int(d.name[1:])
            except ValueError:
                continue
            if v < newest - self.keep:
                shutil.rmtree(d, ignore_errors=True)

    def path_of(self, uri: str) -> Path:
        parsed = urlparse(uri)
        if parsed.scheme != "file":
            raise WeightError(f"unsupported weight URI scheme in {uri!r}")
        path = Path(unquote(parsed.path)).resolve()
        if not path.is_relative_to(self.root):
            raise WeightError(f"weight URI {uri!r} lies outside the weight store {self.root}")
        return path

    def load(self, msg: WeightsPublished) -> dict[str, torch.Tensor]:
        """Load announced weights after checking location and sha256."""
        path = self.path_of(msg.uri) / WEIGHTS_FILE
        if not path.is_file():
            raise WeightError(f"weights v{msg.version}: {path} does not exist")
        digest = sha256_file(path)
        if digest != msg.sha256:
            raise WeightError(f"weights v{msg.version}: sha256 {digest[:12]}… does not match "
                              f"the announced {msg.sha256[:12]}…")
        return load_file(str(path))
