"""Devices and precision: one place that turns config names into torch objects.

`resolve_device` is called by every role that holds a model (trainer, in-process
generator, evaluator) before anything is loaded, so a config asking for CUDA on a machine
without it fails at start with the key named, not later inside a forward.

Under torchrun (``LOCAL_RANK`` set) `auto` and a bare `cuda` mean ``cuda:LOCAL_RANK``: each
rank drives its own GPU. An explicit ``cuda:N`` is taken as written by one process, and
refused in a job of several (``WORLD_SIZE`` > 1): every rank would take GPU N.
"""

from __future__ import annotations

import os

import torch

from pipeline.config import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def local_rank() -> int:
    """This process's rank on its node (torchrun's ``LOCAL_RANK``; 0 outside torchrun)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def resolve_device(spec: str, key: str) -> torch.device:
    """``spec`` (auto | cpu | cuda | cuda:N) as a torch device; ``key`` names the config
    key in the error raised when CUDA is asked for but absent or out of range."""
    if spec == "cpu":
        return torch.device("cpu")
    has_cuda = torch.cuda.is_available()
    if spec == "auto":
        return torch.device("cuda", local_rank()) if has_cuda else torch.device("cpu")
    if not has_cuda:
        raise ConfigError(f"{key}: {spec!r} asked for, but torch {torch.__version__} sees no "
                          "CUDA device on this machine; use 'cpu' or 'auto'")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if ":" in spec and world > 1:
        raise ConfigError(f"{key}: {spec!r} names one GPU, but this is rank {local_rank()} of "
                          f"a job of {world}: every rank would run on it. A multi-rank job "
                          "takes each rank's GPU from LOCAL_RANK: use 'cuda' or 'auto'")
    index = int(spec.split(":", 1)[1]) if ":" in spec else local_rank()
    if index >= torch.cuda.device_count():
        raise ConfigError(f"{key}: {spec!r} (device {index}) asked for, but this machine has "
                          f"{torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name (``model.dtype``)."""
    if name not in DTYPES:
        raise ConfigError(f"model.dtype: unknown dtype {name!r}; expected one of "
                          f"{sorted(DTYPES)}")
    return DTYPES[name]
