"""Weight transports: the contract (base.py) and its implementations.

`make_transport` picks the run's transport from its config; every role builds the same
one: the trainer publishes with it, generators and the evaluator receive with it. The
store behind it (`open_store`) is a directory (``weights.store``, by default
``<output_dir>/weights``) or an s3:// bucket (`pipeline.weights.s3`); `check_store` is
the start-up check of the roles that use it.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.bus.schema import WeightsPublished
from pipeline.config import Config, ConfigError
from pipeline.devices import DTYPES, resolve_device
from pipeline.weights.base import WeightSource, WeightTransport
from pipeline.weights.file import FileTransport, read_full
from pipeline.weights.lora import LoraTransport, MergedLoraTransport, read_adapter
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
           "LoraTransport", "MergedLoraTransport", "WeightError", "WeightSource", "WeightStore",
           "WeightTransport",
           "cache_path", "check_store", "engine_format", "make_transport", "open_store",
           "read_adapter", "read_full", "sha256_file", "table_sha256"]


def cache_path(cfg: Config) -> Path:
    """``weights.cache_dir``, by default ``<output_dir>/weights-cache`` (local disk)."""
    c = cfg.weights.cache_dir
    return Path(c).resolve() if c else cfg.output_path / "weights-cache"


def open_store(cfg: Config, *, keep: int = 4) -> WeightStore:
    """The run's weight store: ``weights.store`` (empty: ``<output_dir>/weights``; a
    relative directory is relative to the current directory), an s3:// URL giving an
    `S3WeightStore` that downloads into `cache_path`. ``keep``: the pruning window."""
    where = cfg.weights.store
    if where.startswith("s3://"):
        from pipeline.weights.s3 import S3WeightStore

        return S3WeightStore(where, cache_dir=cache_path(cfg), keep=keep,
                             endpoint_url=cfg.weights.endpoint_url or None)
    return WeightStore(Path(where) if where else cfg.output_path / "weights", keep=keep)


def check_store(cfg: Config, *, write: bool) -> None:
    """Start-up check of the weight store for a role that uses it (the trainer with
    ``write``; generators and the evaluator read): an s3:// store needs credentials, a
    reachable endpoint and an existing bucket (`pipeline.weights.s3.check`); a role
    that downloads or rebuilds versions needs a usable ``weights.cache_dir``. Raises
    `ConfigError` naming the key."""
    if cfg.weights.store.startswith("s3://"):
        from pipeline.weights.s3 import check

        check(cfg.weights.store, cfg.weights.endpoint_url or None, write=write)
    if not write and (cfg.weights.store.startswith("s3://") or cfg.weights.full_every > 1):
        cache = cache_path(cfg)  # checked, not created: the run directory stays untouched
        existing = next(p for p in (cache, *cache.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"weights.cache_dir: cannot create or write {cache} "
                              f"({existing} is not a writable directory)")


def engine_format(msg: WeightsPublished) -> str:
    """The format an engine loads the received directory as: a delta is rebuilt into
    full weights (``safetensors``); every other format is the announcement's."""
    return "safetensors" if msg.format == "delta" else msg.format


def make_transport(cfg: Config, *, keep: int = 4) -> WeightTransport:
    """`lora` for ``[model.lora]`` runs with ``lora.sync = "adapter"``; `nccl` when the
    vLLM servers take NCCL pushes (``generation.vllm.weight_transfer = "nccl"``), over
    the file store below; otherwise the file store itself: `MergedLoraTransport` (a
    LoRA run with ``lora.sync = "merged"``: the merged full weights, which are also what
    an NCCL push carries) or `FileTransport`. All of them
    store versions in `open_store`; ``keep`` is the pruning window. Full weights are
    published in ``model.dtype`` (the serving dtype), not the trainer's float32 master
    copy; with ``weights.full_every`` > 1, deltas between full versions."""
    store = open_store(cfg, keep=keep)
    serving = DTYPES[cfg.model.dtype]  # versions are written in the engines' dtype
    if cfg.model.lora is not None and cfg.model.lora.sync == "adapter":
        return LoraTransport(store, base_model=cfg.model.path)
    file: FileTransport
    if cfg.model.lora is not None:  # merged: full weights, never deltas (root.py's rule)
        file = MergedLoraTransport(store, dtype=serving, cache_dir=cache_path(cfg))
    else:
        file = FileTransport(store, dtype=serving, full_every=cfg.weights.full_every,
                             cache_dir=cache_path(cfg))
    v = cfg.generation.vllm
    if cfg.generation.engine == "vllm" and v.weight_transfer == "nccl":
        from pipeline.vllm_auth import vllm_api_key
        from pipeline.weights.nccl import NCCLWeightSync
        from pipeline.weights.nccl_transport import NCCLTransport

        sync = NCCLWeightSync(v.urls, v.nccl_master_address, v.nccl_master_port,
                              timeout_s=v.nccl_timeout_s, device=_trainer_gpu(cfg),
                              api_key=vllm_api_key(v.api_key_file))
        return NCCLTransport(sync, file)
    return file


def _trainer_gpu(cfg: Config) -> int | None:
    """The CUDA index the trainer trains on (its NCCL threads join the servers' group on
    it, not on the event loop thread's current device, 0); None where this process has
    no such GPU (a generator's side of the transport never pushes)."""
    try:
        device = resolve_device(cfg.trainer.device, "trainer.device")
    except ConfigError:
        return None
    return device.index if device.type == "cuda" else None
