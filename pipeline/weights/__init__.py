"""Weight transports: the contract (base.py) and its implementations.

`make_transport` picks the run's transport from its config; every role builds the same
one: the trainer publishes with it, generators and the evaluator receive with it.
"""

from __future__ import annotations

from pipeline.config import Config, ConfigError
from pipeline.devices import DTYPES, resolve_device
from pipeline.weights.base import WeightSource, WeightTransport
from pipeline.weights.file import FileTransport, read_full
from pipeline.weights.lora import LoraTransport, read_adapter
from pipeline.weights.store import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    INDEX,
    MANIFEST,
    WeightError,
    WeightStore,
    sha256_file,
    table_sha256,
)

__all__ = ["ADAPTER_CONFIG", "ADAPTER_FILE", "INDEX", "MANIFEST", "FileTransport",
           "LoraTransport", "WeightError", "WeightSource", "WeightStore", "WeightTransport",
           "make_transport", "read_adapter", "read_full", "sha256_file", "table_sha256"]


def make_transport(cfg: Config, *, keep: int = 4) -> WeightTransport:
    """`lora` for ``[model.lora]`` runs; `nccl` when the vLLM servers take NCCL pushes
    (``generation.vllm.weight_transfer = "nccl"``); otherwise `file`. All of them
    store versions under ``<output_dir>/weights``; ``keep`` is the pruning window. Full
    weights are published in ``model.dtype`` (the serving dtype), not the trainer's
    float32 master copy."""
    root = cfg.output_path / "weights"
    serving = DTYPES[cfg.model.dtype]  # versions are written in the engines' dtype
    if cfg.model.lora is not None:
        return LoraTransport(root, keep=keep, base_model=cfg.model.path)
    v = cfg.generation.vllm
    if cfg.generation.engine == "vllm" and v.weight_transfer == "nccl":
        from pipeline.weights.nccl import NCCLTransport, NCCLWeightSync

        sync = NCCLWeightSync(v.urls, v.nccl_master_address, v.nccl_master_port,
                              timeout_s=v.nccl_timeout_s, device=_trainer_gpu(cfg))
        return NCCLTransport(sync, FileTransport(root, keep=keep, dtype=serving))
    return FileTransport(root, keep=keep, dtype=serving)


def _trainer_gpu(cfg: Config) -> int | None:
    """The CUDA index the trainer trains on (its NCCL threads join the servers' group on
    it, not on the event loop thread's current device, 0); None where this process has
    no such GPU (a generator's side of the transport never pushes)."""
    try:
        device = resolve_device(cfg.trainer.device, "trainer.device")
    except ConfigError:
        return None
    return device.index if device.type == "cuda" else None
