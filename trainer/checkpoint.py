"""Trainer checkpoints: weights, optimizer, step, version, trained ids, run state.

Layout: ``<output_dir>/checkpoints/step-<N>/`` with the weights, ``optimizer.pt``
(tensors and plain containers only, read back with ``weights_only=True``) and
``meta.json``. The weights are ``model.safetensors`` (every tensor) for a full-weight
run and ``adapter_model.safetensors`` (the LoRA adapter only, peft's saved keys, as the
weight store publishes it) for a LoRA run: the frozen base is the model directory
itself, so it is never copied. A checkpoint directory appears only complete (written
under a temporary name, then renamed); the newest complete one is resumed, and resuming
a LoRA checkpoint into a full-weight run (or the reverse) is refused, not half-loaded.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pipeline.model import adapter_state, adapter_to_model_keys, is_peft, model_state_for_publish
from pipeline.weights import ADAPTER_FILE, WEIGHTS_FILE


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
        if is_peft(model):
            save_file(adapter_state(model), str(tmp / ADAPTER_FILE))
        else:
            save_file(model_state_for_publish(model), str(tmp / WEIGHTS_FILE))
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
        lora = is_peft(model)
        weights = path / (ADAPTER_FILE if lora else WEIGHTS_FILE)
        if not weights.is_file():
            raise ValueError(f"checkpoint {path} has no {weights.name}: it was written by a "
                             f"{'full-weight' if lora else 'LoRA'} run, and this run is "
                             f"{'LoRA' if lora else 'full-weight'} ([model.lora])")
        if lora:  # checked against the adapter's keys and shapes before any change
            model.load_state_dict(adapter_to_model_keys(model, load_file(str(weights))),
                                  strict=False)
        else:
            model.load_state_dict(load_file(str(weights)))
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        return TrainerState(**json.loads((path / "meta.json").read_text()))
