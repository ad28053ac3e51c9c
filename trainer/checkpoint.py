"""Trainer checkpoints: weights, optimizer, step, version, trained ids, run state.

Layout: ``<output_dir>/checkpoints/step-<N>/`` with ``model.safetensors``,
``optimizer.pt`` (tensors and plain containers only, read back with
``weights_only=True``) and ``meta.json``. A checkpoint directory appears only complete
(written under a temporary name, then renamed); the newest complete one is resumed.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pipeline.model import model_state_for_publish


@dataclass
class TrainerState:
    step: int = 0
    version: int = 0
    trained_ids: list[str] = field(default_factory=list)
    run_state: dict[str, int] = field(default_factory=dict)


class Checkpointer:
    def __init__(self, root: str | Path, keep: int = 2):
        self.root = Path(root)
        self.keep = keep

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             state: TrainerState) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step-{state.step:08d}"
        tmp = self.root / f".tmp-step-{state.step:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file(model_state_for_publish(model), str(tmp / "model.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        (tmp / "meta.json").write_text(json.dumps(state.__dict__))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in self.list()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def list(self) -> list[Path]:
        if not self.root.exists():
            return []
        return sorted(p for p in self.root.glob("step-*") if (p / "meta.json").exists())

    def load_latest(self, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> TrainerState | None:
        ckpts = self.list()
        if not ckpts:
            return None
        path = ckpts[-1]
        model.load_state_dict(load_file(str(path / "model.safetensors")))
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        return TrainerState(**json.loads((path / "meta.json").read_text()))
