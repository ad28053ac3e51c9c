"""Weight transports: the contract (base.py) and its implementations.

`make_transport` picks the run's transport from its config; every role builds the same
one: the trainer publishes with it, generators and the evaluator receive with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.devices import DTYPES
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

if TYPE_CHECKING:
    from pipeline.config import Config

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

        sync = NCCLWeightSync(v.urls, v.nccl_master_address, v.nccl_master_port)
        return NCCLTransport(sync, FileTransport(root, keep=keep, dtype=serving))
    return FileTransport(root, keep=keep, dtype=serving)
