"""The vLLM servers `sluice up` launches, where they run, and which role gets which.

The generators share ``generation.vllm.launch`` servers (`split_servers`); the evaluator,
when it decodes on vLLM without servers named, gets one more of its own
(`launches_eval_server`), so an evaluated version is never swapped into a generator's
server.

Placement (`plan_servers`, a pure function; `server_plan` feeds it this machine):
- A CPU machine: server i binds CPU core i (``cpu_core``); every server starts at once.
- A GPU machine: a server gets one entry of the GPUs this process sees: the parent's
  ``CUDA_VISIBLE_DEVICES`` list when it is set (a Slurm or Kubernetes allocation), so
  a server never escapes the allocation, else every GPU (`visible_devices`).
- ``weight_transfer = "file"``: servers go round robin over the GPUs the trainer does not
  use (`trainer_gpu_indices`), and share the trainer's only on a machine with no other
  (server 0 used to land on the trainer's GPU 0 while others stayed idle).
- Memory: a server's --gpu-memory-utilization is its GPU's budget over the servers on
  it. The budget is ``gpu_memory_utilization``, or `DEFAULT_GPU_UTILIZATION` when that
  is 0 (0 meant ``kv_cache_memory_bytes``, the CPU setting: 64 MiB of KV cache on a GPU,
  too small for a long ``max_model_len``); on a GPU the trainer shares, less
  ``trainer_gpu_fraction``, the trainer's share (refused naming both keys when nothing
  is left).
- ``weight_transfer = "nccl"``: the trainer (rank 0, cuda:0 of its ranks' GPUs) and every
  generator server join one NCCL group, and NCCL refuses two ranks on one GPU ("Duplicate
  GPU detected"). So the generators' servers each get a GPU of their own, none of the
  trainer's (`trainer_gpu_indices`); the evaluator's server is not in the group and goes
  round robin over those same GPUs. A machine that cannot give that is refused with a
  `ConfigError` naming the keys, before any process starts.
- Servers sharing a GPU start one after another (``after``: the previous one on that
  GPU must answer /health first), because vLLM sizes its KV cache from the memory that
  is free while it profiles, assuming no other process changes its use meanwhile; and
  they split ``gpu_memory_utilization`` (each gets fraction / servers on the GPU, since
  vLLM's fraction is per instance, of the GPU's whole memory), so together they use the
  configured fraction.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import Config, ConfigError
from pipeline.vllm_auth import run_key
from sluice.vllm_launch import ServerSpec


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
DEFAULT_GPU_UTILIZATION = 0.9
"""The servers' share of a GPU when ``gpu_memory_utilization`` is 0 (vLLM's own default)."""


def launches_eval_server(cfg: Config) -> bool:
    """`sluice up` starts one more vLLM server, the evaluator's own, when the evaluator
    runs on vLLM without servers named (``eval.vllm_urls``) and the generators' servers
    are launched too."""
    return (cfg.eval_engine == "vllm" and not cfg.eval.vllm_urls
            and cfg.generation.engine == "vllm" and cfg.generation.vllm.launch > 0)


@dataclass(frozen=True)
class Placement:
    """Where one launched server runs and when it starts.

    ``device``: the server's ``CUDA_VISIBLE_DEVICES``, one entry of the parent's visible
    list (None on a CPU machine). ``after``: the index (launch order) of the server that
    must answer /health before this one starts, always an earlier one on the same GPU
    (None: it starts at once). ``memory_utilization``: its --gpu-memory-utilization, its
    GPU's budget over the number of servers on it (module docstring); on a CPU machine
    the configured value (0: the servers size their KV cache by
    ``kv_cache_memory_bytes``)."""

    device: str | None
    after: int | None
    memory_utilization: float


def visible_devices(cuda_visible: str | None, count: int) -> list[str]:
    """The GPUs this process may hand out, as ``CUDA_VISIBLE_DEVICES`` entries: the
    parent's list (indices, UUIDs or MIG ids, passed through as written) when it is set,
    else ``0 .. count-1``. ``count`` is how many devices CUDA sees; it stops at the first
    entry it cannot use, so only that many entries are taken."""
    if cuda_visible is None:
        return [str(i) for i in range(count)]
    return [e.strip() for e in cuda_visible.split(",") if e.strip()][:count]


def machine_gpus() -> list[str]:
    """`visible_devices` of this process (empty without CUDA)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), count)


def trainer_gpu_indices(device: str, ranks: int, gpus: int) -> list[int]:
    """Indices (into the visible GPUs) the trainer job of ``ranks`` ranks uses with
    ``trainer.device`` = ``device`` (`pipeline.devices.resolve_device`): `cuda:N` is N
    for every rank, `auto`/`cuda` are cuda:LOCAL_RANK, `cpu` (or `auto` without a GPU)
    none."""
    if device == "cpu" or gpus == 0:
        return []
    if ":" in device:
        return [int(device.split(":", 1)[1])]
    return [r for r in range(ranks) if r < gpus]


def plan_servers(generator_servers: int, eval_servers: int, visible: Sequence[str],
                 trainer_gpus: Sequence[int], *, nccl: bool,
                 memory_utilization: float, trainer_fraction: float = 0.5
                 ) -> list[Placement]:
    """One `Placement` per server, the generators' first (module docstring: the rules).

    Invariants: with ``nccl`` no generator server shares a GPU with the trainer or with
    another generator server; every ``after`` names an earlier server on the same GPU
    and each GPU's servers form one chain; servers use a trainer's GPU only when every
    visible GPU is the trainer's; on each GPU the servers' fractions sum to its budget
    (``memory_utilization`` or `DEFAULT_GPU_UTILIZATION`, less ``trainer_fraction`` on
    the trainer's). Raises `ConfigError` when ``nccl`` cannot get that or a trainer's GPU
    leaves the servers nothing."""
    total = generator_servers + eval_servers
    if not visible:
        if nccl:
            raise ConfigError(
                'generation.vllm.weight_transfer = "nccl" needs CUDA GPUs, and this machine '
                "has no CUDA GPU visible (CUDA_VISIBLE_DEVICES, torch.cuda); use "
                'weight_transfer = "file"')
        return [Placement(None, None, memory_utilization)] * total
    if nccl:
        if not trainer_gpus:
            raise ConfigError(
                'generation.vllm.weight_transfer = "nccl": trainer rank 0 sends the weights '
                "from a GPU, but trainer.device puts the trainer on the CPU; use "
                'trainer.device = "auto" or "cuda", or weight_transfer = "file"')
        pool = [i for i in range(len(visible)) if i not in set(trainer_gpus)]
        if generator_servers > len(pool):
            used = ", ".join(visible[i] for i in sorted(set(trainer_gpus)) if i < len(visible))
            raise ConfigError(
                f'generation.vllm.weight_transfer = "nccl": {len(visible)} GPU(s) visible '
                f"({', '.join(visible)}); the trainer (trainer.device, up.trainer_ranks) uses "
                f"{used or 'none of them'}, which leaves {len(pool)} for "
                f"generation.vllm.launch = {generator_servers} server(s). NCCL refuses two "
                "ranks of one group on one GPU (the trainer and a server, or two servers), "
                "so each server needs a GPU of its own. Lower generation.vllm.launch or "
                'up.trainer_ranks, run on more GPUs, or use weight_transfer = "file"')
        gpus = [pool[i % len(pool)] for i in range(total)]
    else:
        free = [i for i in range(len(visible)) if i not in set(trainer_gpus)]
        pool = free or list(range(len(visible)))
        gpus = [pool[i % len(pool)] for i in range(total)]
    budget = memory_utilization or DEFAULT_GPU_UTILIZATION
    shared = budget - trainer_fraction
    if set(gpus) & set(trainer_gpus) and shared < 0.05:
        raise ConfigError(
            f"generation.vllm.gpu_memory_utilization: vLLM servers share the trainer's GPU "
            f"(no other is free), and {budget:g} of it less the trainer's "
            f"generation.vllm.trainer_gpu_fraction = {trainer_fraction:g} leaves them "
            f"{max(shared, 0):.2g}; raise the first or lower the second")
    sharing = Counter(gpus)
    last: dict[int, int] = {}
    plan: list[Placement] = []
    for i, g in enumerate(gpus):
        mine = shared if g in set(trainer_gpus) else budget
        plan.append(Placement(visible[g], last.get(g), mine / sharing[g]))
        last[g] = i
    return plan


def server_plan(cfg: Config) -> list[Placement]:
    """`plan_servers` for the servers `sluice up` launches on this machine."""
    v = cfg.generation.vllm
    visible = machine_gpus()
    return plan_servers(v.launch, int(launches_eval_server(cfg)), visible,
                        trainer_gpu_indices(cfg.trainer.device, cfg.up.trainer_ranks,
                                            len(visible)),
                        nccl=v.weight_transfer == "nccl",
                        memory_utilization=v.gpu_memory_utilization,
                        trainer_fraction=v.trainer_gpu_fraction)


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(model_config: dict[str, Any], dtype: str) -> int | None:
    """KV-cache bytes one token takes in a server of this model (2 × layers × KV heads ×
    head dim × dtype bytes: one key and one value per layer, vLLM's full-attention
    layout), from its ``config.json`` (a VLM's ``text_config``); None where that formula
    does not hold (sliding-window or linear-attention layers, MLA) or a field is
    missing: then nothing is judged."""
    c = model_config.get("text_config") or model_config
    if (c.get("sliding_window") and c.get("use_sliding_window", True)) \
            or any(t != "full_attention" for t in c.get("layer_types") or []) \
            or c.get("kv_lora_rank"):
        return None
    try:
        layers, heads = int(c["num_hidden_layers"]), int(c["num_attention_heads"])
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError):
        return None
    return 2 * layers * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 4)


def check_kv_budget(model_config: dict[str, Any], dtype: str, max_model_len: int,
                    kv_cache_memory_bytes: int) -> None:
    """`ConfigError` naming both keys when a CPU server's KV cache cannot hold one
    ``max_model_len`` sequence: vLLM refuses to start such a server, but only after it
    has loaded the model (a minute for a large one), and `sluice up` would then report a
    server that died at start."""
    per_token = kv_bytes_per_token(model_config, dtype)
    if per_token is None or kv_cache_memory_bytes >= per_token * max_model_len:
        return
    need = per_token * max_model_len
    raise ConfigError(
        f"generation.vllm.kv_cache_memory_bytes = {kv_cache_memory_bytes} cannot hold one "
        f"sequence of generation.vllm.max_model_len = {max_model_len} tokens: this model "
        f"takes {per_token} bytes of KV cache per token in {dtype}, {need} in all "
        f"({need / 2**20:.0f} MiB); raise kv_cache_memory_bytes or lower max_model_len")


def vllm_specs(cfg: Config) -> list[ServerSpec]:
    """One `ServerSpec` per server `sluice up` launches (the generators' ``launch``, then
    the evaluator's own if `launches_eval_server`), placed by `server_plan` (checked
    first: a `ConfigError` comes before anything is resolved or started). Every server
    loads the local folder of the model (the run's pinned snapshot when ``cfg`` comes from
    `prepare`; a hub id is resolved through the cache), the same files the trainer and
    generators load. Only the generators' servers take NCCL pushes. Every server gets the
    run's key (`pipeline.vllm_auth.run_key`: the configured one, else the run's own in
    ``<output>/vllm/api_key``); `run_up` hands it to the roles in ``VLLM_API_KEY``."""
    from pipeline.hub import resolve_model

    plan = server_plan(cfg)
    v = cfg.generation.vllm
    python = Path(v.python).absolute()
    if not python.exists():
        python = Path(__file__).resolve().parents[1] / v.python  # relative to the checkout
    lora = cfg.model.serving_lora  # merged LoRA: servers take full weights, no --enable-lora
    model = resolve_model(cfg.model.path, cfg.model.revision).local_dir
    if any(p.device is None for p in plan):  # CPU servers size their KV cache in bytes
        config_json = Path(model) / "config.json"
        if config_json.exists():
            check_kv_budget(json.loads(config_json.read_text()), cfg.model.dtype,
                            v.max_model_len, v.kv_cache_memory_bytes)
    nccl = NCCL_ARGS if v.weight_transfer == "nccl" else []
    key = run_key(cfg.output_path / "vllm", v.api_key_file)
    return [ServerSpec(api_key=key, python=str(python), model=model,
                       dtype=cfg.model.dtype, max_model_len=v.max_model_len,
                       kv_cache_memory_bytes=v.kv_cache_memory_bytes,
                       gpu_memory_utilization=p.memory_utilization,
                       lora_rank=lora.rank if lora else 0,
                       max_loras=cfg.trainer.max_staleness + 2,
                       max_logprobs=max(20, cfg.generation.num_sampler_logprobs + 1),
                       api_server_count=v.api_server_count,
                       cpu_core=i % (os.cpu_count() or 1) if p.device is None else None,
                       cuda_device=p.device, start_after=p.after,
                       extra_args=[*(nccl if i < v.launch else []), *v.extra_args])
            for i, p in enumerate(plan)]
