"""The vLLM servers `sluice up` launches, and which role gets which server.

Server i binds CPU core i on a CPU machine, GPU i on a GPU machine. The generators share
``generation.vllm.launch`` servers (`split_servers`); the evaluator, when it decodes on
vLLM without servers named, gets one more of its own (`launches_eval_server`), so an
evaluated version is never swapped into a generator's server.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipeline.config import Config
from workers.engines.vllm_server import ServerSpec


def urls_override(urls: list[str]) -> list[str]:
    """``--set generation.vllm.urls=[...]`` for a role (nothing when there are none)."""
    return ["--set", f"generation.vllm.urls={json.dumps(urls)}"] if urls else []


def split_servers(urls: list[str], generators: int) -> list[list[str]]:
    """Servers per generator: disjoint shares when there are enough (a server then has
    one owner, so each weight version is swapped into it once), else every generator
    uses every server (works; each version is then loaded once per generator)."""
    if len(urls) >= generators:
        return [urls[i::generators] for i in range(generators)]
    return [list(urls) for _ in range(generators)]


NCCL_ARGS = ["--weight-transfer-config", '{"backend": "nccl"}']


def launches_eval_server(cfg: Config) -> bool:
    """`sluice up` starts one more vLLM server, the evaluator's own, when the evaluator
    runs on vLLM without servers named (``eval.vllm_urls``) and the generators' servers
    are launched too."""
    return (cfg.eval_engine == "vllm" and not cfg.eval.vllm_urls
            and cfg.generation.engine == "vllm" and cfg.generation.vllm.launch > 0)


def vllm_specs(cfg: Config) -> list[ServerSpec]:
    """One `ServerSpec` per server `sluice up` launches (the generators' ``launch``, then
    the evaluator's own if `launches_eval_server`): on a CPU machine server i binds core
    i; on a GPU machine it gets GPU i. Every server loads the local folder of the model
    (the run's pinned snapshot when ``cfg`` comes from `prepare`; a hub id is resolved
    through the cache), the same files the trainer and generators load."""
    import torch

    from pipeline.hub import resolve_model

    v = cfg.generation.vllm
    python = Path(v.python).absolute()
    if not python.exists():
        python = Path(__file__).resolve().parents[2] / v.python  # relative to the checkout
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    lora = cfg.model.lora
    model = resolve_model(cfg.model.path, cfg.model.revision).local_dir
    return [ServerSpec(python=str(python), model=model,
                       dtype=cfg.model.dtype, max_model_len=v.max_model_len,
                       kv_cache_memory_bytes=v.kv_cache_memory_bytes,
                       gpu_memory_utilization=v.gpu_memory_utilization,
                       lora_rank=lora.rank if lora else 0,
                       max_loras=cfg.trainer.max_staleness + 2,
                       cpu_core=None if gpus else i % (os.cpu_count() or 1),
                       cuda_device=i % gpus if gpus else None,
                       extra_args=[*(NCCL_ARGS if v.weight_transfer == "nccl" else []),
                                   *v.extra_args])
            for i in range(v.launch + launches_eval_server(cfg))]
