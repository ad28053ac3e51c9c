"""The `file` weight store: one directory per version, safetensors + sha256 manifest.

Two formats share the store (and `_commit`, the one place a version directory is made):
- ``safetensors`` (`publish`): full weights in ``model.safetensors``;
- ``lora`` (`publish_lora`): a peft adapter directory, ``adapter_model.safetensors`` +
  ``adapter_config.json``, exactly what ``PeftModel.from_pretrained`` and vLLM's
  ``POST /v1/load_lora_adapter`` read.

Invariants:
- A version directory appears only complete: it is written under a temporary name and
  renamed into place, so a reader never sees half a checkpoint.
- The announced sha256 is that of the format's weight file (`weight_file`);
  `FileWeightStore.verify` refuses a file whose hash differs, and refuses a URI outside
  the store's root (a hostile announcement cannot make a generator read arbitrary paths).
- Versions older than ``keep`` behind the newest are pruned (the staleness window).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

import torch
from safetensors.torch import load_file, save_file

from pipeline.schema import WeightsPublished

if TYPE_CHECKING:
    from peft import PeftModel

WEIGHTS_FILE = "model.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"  # peft's name; vLLM's load_lora_adapter reads it
ADAPTER_CONFIG = "adapter_config.json"
MANIFEST = "manifest.json"


def weight_file(fmt: str) -> str:
    """The file an announcement's sha256 covers, by its format."""
    return ADAPTER_FILE if fmt == "lora" else WEIGHTS_FILE


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
        """Write full weights (keys as ``model.state_dict()``) as ``version``."""
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}

        def write(tmp: Path) -> None:
            save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"version": str(version)})

        return self._commit(write, fmt="safetensors", version=version, step=step)

    def publish_lora(self, model: PeftModel, *, version: int, step: int,
                     base_model: str | Path | None = None) -> WeightsPublished:
        """Write ``model``'s active LoRA adapter as ``version``, in peft's format.

        The adapter file holds peft's saved keys (``base_model.model.….lora_A.weight``)
        and ``adapter_config.json`` the adapter's peft config (inference mode, its
        ``base_model_name_or_path`` set to ``base_model`` when given), so the directory
        loads with ``PeftModel.from_pretrained(base, dir)`` and vLLM's load_lora_adapter.
        """
        from pipeline.model import adapter_state  # lazy: keeps transformers out of light roles

        tensors = adapter_state(model)
        pcfg = copy.deepcopy(model.peft_config[model.active_adapter])
        pcfg.inference_mode = True
        if base_model is not None:
            pcfg.base_model_name_or_path = str(Path(base_model).resolve())

        def write(tmp: Path) -> None:
            # metadata "format": "pt" is what peft's own save_pretrained writes
            save_file(tensors, str(tmp / ADAPTER_FILE),
                      metadata={"format": "pt", "version": str(version)})
            pcfg.save_pretrained(str(tmp))

        return self._commit(write, fmt="lora", version=version, step=step)

    def _commit(self, write: Callable[[Path], None], *, fmt: str, version: int,
                step: int) -> WeightsPublished:
        """Make ``v<version>/`` atomically: ``write`` fills a temp dir, the manifest names
        the sha256 of the format's weight file, then rename into place and prune."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.dir_for(version)
        tmp = self.root / f".tmp-v{version:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            write(tmp)
            weights = tmp / weight_file(fmt)
            digest = sha256_file(weights)
            nbytes = weights.stat().st_size
            (tmp / MANIFEST).write_text(json.dumps(
                {"version": version, "step": step, "format": fmt,
                 "files": {weights.name: digest}}))
            if final.exists():  # a re-publish of the same version (e.g. after a restart)
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.prune(version)
        return WeightsPublished(version=version, step=step, uri=final.as_uri(),
                                format=fmt, sha256=digest, nbytes=nbytes, t=time.time())

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

    def verify(self, msg: WeightsPublished) -> Path:
        """The announced version's directory, after checking its location and the sha256
        of its weight file (``model.safetensors``, or the adapter file of a LoRA store)."""
        directory = self.path_of(msg.uri)
        path = directory / weight_file(msg.format)
        if not path.resolve().is_relative_to(self.root):  # a symlinked file inside the store
            raise WeightError(f"weights v{msg.version}: {path} resolves outside the weight "
                              f"store {self.root}")
        if not path.is_file():
            raise WeightError(f"weights v{msg.version}: {path} does not exist")
        digest = sha256_file(path)
        if digest != msg.sha256:
            raise WeightError(f"weights v{msg.version}: sha256 {digest[:12]}… does not match "
                              f"the announced {msg.sha256[:12]}…")
        return directory

    def load(self, msg: WeightsPublished) -> dict[str, torch.Tensor]:
        """Load announced weights after checking location and sha256."""
        return load_file(str(self.verify(msg) / weight_file(msg.format)))
