"""Trainer checkpoints: weights, optimizer, step, version, trained ids, run state.

Layout: ``<output_dir>/checkpoints/step-<N>/`` with the weights, ``optimizer.pt``
(tensors and plain containers only, read back with ``weights_only=True``) and
``meta.json``. The weights are ``model.safetensors`` (every tensor) for a full-weight
run and ``adapter_model.safetensors`` (the LoRA adapter only, peft's saved keys, as the
weight store publishes it) for a LoRA run: the frozen base is the model directory
itself, so it is never copied. Resuming a LoRA checkpoint into a full-weight run (or the
reverse) is refused, not half-loaded.

Crash safety (`pipeline.durable`): a checkpoint is written into ``.tmp-step-<N>-<pid>/``,
every file fsynced, then the folder; the rename to ``step-<N>`` is the commit point (no
separate completion marker: only ``step-*`` names are ever loaded, and such a name exists
only for a folder whose every file reached the disk); the parent is fsynced, and only
then are checkpoints beyond ``keep`` pruned, so the previous checkpoint is never deleted
before the new one is durable. A failed write (a full disk) removes its temporary folder
and raises `CheckpointError`; the folders a crashed writer left, of any PID, are removed
when the next trainer takes the lock (`clean_temp`: only the lock's holder writes here).
Before the rename and before pruning, ``guard`` (the trainer lock's fence,
`trainer.lock.TrainerLock.guard`) refuses a trainer that lost its lock.

``optimizer.pt`` holds ``{"optimizer": …, "scheduler": …}``: the optimizer state keyed by
parameter name (``torch.distributed.checkpoint.state_dict``'s full state dict), so a
checkpoint written by N FSDP ranks resumes in a one-process trainer and the reverse, and
the learning-rate schedule's position. Older checkpoints (a plain
``optimizer.state_dict()``) still load. In a data-parallel job every rank calls `save` and
`load_latest` (they gather and scatter the shards); rank 0 alone touches the files.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from pipeline.durable import commit_dir, remove_temp, test_pause
from pipeline.model import adapter_state, adapter_to_model_keys, is_peft
from pipeline.weights import ADAPTER_FILE
from pipeline.weights.file import SINGLE_FILE as WEIGHTS_FILE
from trainer.distributed import Ranks, full_state

Scheduler = torch.optim.lr_scheduler.LRScheduler


@dataclass
class TrainerState:
    step: int = 0
    version: int = 0
    trained_ids: list[str] = field(default_factory=list)
    run_state: dict[str, int] = field(default_factory=dict)
    tokens_seen: int = 0  # prompt + completion tokens trained so far (TRL's num_tokens)
    entropy_coef: float | None = None  # adaptive entropy control (pipeline.rl.entropy_control)
    last_entropy: float | None = None  # None: none measured yet (the controller's +inf)


class CheckpointError(OSError):
    """A checkpoint could not be written (a full disk, an I/O error); nothing of it is
    left behind and the previous checkpoints are intact."""


class Checkpointer:
    def __init__(self, root: str | Path, keep: int = 2):
        self.root = Path(root)
        self.keep = keep
        self.guard: Callable[[], None] | None = None  # the lock's fence (module docstring)
        self.generation = 0  # the writer's lock generation, recorded in meta.json

    def clean_temp(self) -> list[Path]:
        """Remove what crashed writers left (temporary folders of any PID)."""
        return remove_temp(self.root)

    def latest_step(self) -> int | None:
        """The step of the newest complete checkpoint (None: there is none)."""
        ckpts = self.list()
        return int(ckpts[-1].name.split("-", 1)[1]) if ckpts else None

    def _check(self) -> None:
        if self.guard is not None:
            self.guard()

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             state: TrainerState, scheduler: Scheduler | None = None,
             ranks: Ranks | None = None) -> Path | None:
        """Write ``step-<N>/``; in a job, every rank calls it and rank 0 writes (returns
        the path on rank 0, None elsewhere)."""
        ranks = ranks or Ranks()
        weights = adapter_state(model) if is_peft(model) else full_state(model, ranks)
        optim = get_optimizer_state_dict(model, optimizer, options=_options())
        if not ranks.is_main:
            return None
        self._check()  # a trainer that lost its lock does not even start writing
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step-{state.step:08d}"
        tmp = self.root / f".tmp-step-{state.step:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir()
            save_file(weights, str(tmp / (ADAPTER_FILE if is_peft(model) else WEIGHTS_FILE)))
            test_pause()
            torch.save({"optimizer": optim,
                        "scheduler": scheduler.state_dict() if scheduler is not None else None},
                       tmp / "optimizer.pt")
            test_pause()
            (tmp / "meta.json").write_text(json.dumps(  # written last
                {**state.__dict__, "generation": self.generation}))
            self._check()
            commit_dir(tmp, final)  # the commit point
        except BaseException as e:
            if isinstance(e, Exception) and not tmp.exists():
                self._check()  # removed by a newer lock holder: `TrainerLockLost`
            code = e.errno if isinstance(e, OSError) else None
            if isinstance(e, RuntimeError) and _disk_full(self.root):
                code = errno.ENOSPC  # torch.save reports it as an iostream RuntimeError
            shutil.rmtree(tmp, ignore_errors=True)
            if code in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
                raise CheckpointError(
                    code, f"checkpoint of step {state.step} could not be written to "
                    f"{self.root}: {os.strerror(code or 0)}; nothing of it was kept and "
                    f"the previous checkpoints are intact ({[p.name for p in self.list()]})"
                ) from e
            raise
        self._check()
        for old in self.list()[: -self.keep]:  # renamed away first: a pruning cut short
            gone = self.root / f".tmp-pruned-{old.name}"  # never leaves a half step-* folder
            os.replace(old, gone)
            shutil.rmtree(gone, ignore_errors=True)
        return final

    def list(self) -> list[Path]:
        if not self.root.exists():
            return []
        return sorted(p for p in self.root.glob("step-*") if (p / "meta.json").exists())

    def load_latest(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Scheduler | None = None,
                    ranks: Ranks | None = None) -> TrainerState | None:
        ranks = ranks or Ranks()
        if ranks.distributed:
            return self._load_distributed(model, optimizer, scheduler, ranks)
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
        saved = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        if "optimizer" in saved:
            set_optimizer_state_dict(model, optimizer, saved["optimizer"],
                                     options=_options())
            if scheduler is not None and saved.get("scheduler") is not None:
                scheduler.load_state_dict(saved["scheduler"])
        else:  # written before parameter-name keys: a plain optimizer.state_dict()
            optimizer.load_state_dict(saved)
        return _state(json.loads((path / "meta.json").read_text()))

    def _load_distributed(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          scheduler: Scheduler | None, ranks: Ranks) -> TrainerState | None:
        """Rank 0 reads the newest checkpoint; its tensors are broadcast into every rank's
        shards. Full-weight runs only (LoRA jobs run on one rank)."""
        path = self.list()[-1] if ranks.is_main and self.list() else None
        found = torch.tensor([1 if path is not None else 0])
        dist.broadcast(found, 0)
        if not int(found):
            return None
        weights: dict[str, torch.Tensor] = {}
        saved: dict = {"optimizer": {}, "scheduler": None}
        if path is not None:
            if not (path / WEIGHTS_FILE).is_file():
                raise ValueError(f"checkpoint {path} has no {WEIGHTS_FILE} (a LoRA run's?)")
            weights = load_file(str(path / WEIGHTS_FILE))
            saved = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
            if "optimizer" not in saved:
                raise ValueError(f"checkpoint {path} predates parameter-name optimizer "
                                 "state; resume it with one rank first")
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, weights, options=opts)
        set_optimizer_state_dict(model, optimizer, saved["optimizer"], options=opts)
        meta = json.loads((path / "meta.json").read_text()) if path is not None else {}
        blob = json.loads(ranks.broadcast_bytes(  # JSON over a byte tensor: no pickle
            json.dumps({"meta": meta, "scheduler": saved.get("scheduler")}).encode()
            if ranks.is_main else None))
        if scheduler is not None and blob["scheduler"] is not None:
            scheduler.load_state_dict(blob["scheduler"])
        return _state(blob["meta"])


def _disk_full(folder: Path, below_bytes: int = 1 << 20) -> bool:
    """Whether the filesystem of ``folder`` has (almost) no space left."""
    try:
        return shutil.disk_usage(folder).free < below_bytes
    except OSError:
        return False


def _state(meta: dict) -> TrainerState:
    """The state in a ``meta.json`` (which also names the writer's ``generation``)."""
    return TrainerState(**{k: v for k, v in meta.items() if k != "generation"})


def _options() -> StateDictOptions:
    """Full (unsharded) optimizer state, always gathered to the CPU: a one-rank GPU trainer
    would otherwise write CUDA tensors into ``optimizer.pt`` (its GPU index baked in). Read
    back with ``map_location="cpu"``; ``Optimizer.load_state_dict`` then moves each state
    to its parameter's device, so a resume never needs the saver's GPU (or its free memory
    for a second copy of the state). On the CPU both are no-ops (``.to("cpu")`` returns the
    tensor itself)."""
    return StateDictOptions(full_state_dict=True, cpu_offload=True)

