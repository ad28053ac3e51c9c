"""Data-parallel trainer ranks: torchrun + FSDP2 (``fully_shard``), gloo on CPU, nccl on GPU.

How ranks share the stream (decided, and why): **rank 0 reads and scatters**. Rank 0 is the
only consumer of ``trainers`` (name ``trainer-0``) and the only rank that talks to Redis:
it decides staleness against one version per step, dedupes, and after the step publishes,
announces, retires and checkpoints. Every step it broadcasts the step's groups as the same
msgpack bytes the bus carries (`pipeline.bus.codec`, never pickle); each rank decodes them and
trains groups ``rank::world``. So every guarantee of the one-process trainer (trained at
most once, one version per step, acks after the step) holds unchanged, and a restarted job
drains rank 0's pending entries from the checkpoint. Membership is torchrun's: a rank that
dies takes the job down (torchrun stops the others); ``--max-restarts`` restarts it.

Between steps rank 0 sends a command: ``STEP`` (groups follow), ``IDLE`` (nothing ready
yet; keeps a slow pipeline from hitting the collective timeout) or ``STOP``.

Gradients: FSDP2 averages over ranks; the GRPO normaliser already divides by the whole
step's count (all-reduced), so each rank's loss is multiplied by ``world`` (`DataParallel`).
With 1e-5 the parameters after N steps equal a one-rank job's on the same batches
(``tests/integration/test_ranks.py``).
"""

from __future__ import annotations

import datetime
import gc
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeline.bus.codec import decode, encode
from pipeline.bus.schema import Limits, ScoredGroup
from pipeline.config import Config, ConfigError
from trainer.step import DataParallel

log = logging.getLogger("sluice.trainer")

STEP, IDLE, STOP = 0, 1, 2
_STORES: list[dist.Store] = []  # this process's job store (see `Ranks.close`)


@dataclass(frozen=True)
class StepHeader:
    """What rank 0 tells every rank before each exchange (broadcast as four int64s):
    ``command`` (`STEP`: the step's groups follow; `IDLE`; `STOP`), the weight
    ``version`` the step trains, and whether the step ends in a ``publish`` of the
    weights and a checkpoint ``save``."""

    command: int
    version: int = 0
    publish: bool = False
    save: bool = False

    def as_ints(self) -> list[int]:
        return [self.command, self.version, int(self.publish), int(self.save)]

    @classmethod
    def of_ints(cls, ints: list[int]) -> StepHeader:
        command, version, publish, save = ints
        return cls(command, version, bool(publish), bool(save))


IDLE_HEADER = StepHeader(IDLE)


@dataclass
class Ranks:
    """This process's place in the job: ``world`` ranks, this one ``rank``."""

    rank: int = 0
    world: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    # ------------------------------------------------------------------ set-up

    @classmethod
    def from_env(cls, device: torch.device, timeout_s: float) -> Ranks:
        """Join torchrun's job when ``WORLD_SIZE`` > 1 (`backend_for` the device)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        if not dist.is_initialized():
            backend = backend_for(device)
            if device.type == "cuda":
                torch.cuda.set_device(device)
            timeout = datetime.timedelta(seconds=timeout_s)
            rank = int(os.environ["RANK"])
            _STORES.append(_attempt_store(rank, world, timeout))
            dist.init_process_group(backend, store=_STORES[-1], rank=rank, world_size=world,
                                    timeout=timeout)
        return cls(rank=dist.get_rank(), world=dist.get_world_size())

    def close(self, together: bool = True) -> None:
        """Leave the job; ``together`` (a clean stop, every rank calls it) waits for the
        others first: a rank tearing gloo down while another still talks to it can abort
        that one ("terminate called without an active exception")."""
        if self.distributed and dist.is_initialized():
            if together:
                dist.barrier()
            dist.destroy_process_group()
        # Release the store client now, while the runtime is whole: left to interpreter
        # teardown, its destructor aborted a rank at exit ("terminate called without an
        # active exception") in 2 of 2 full-suite runs under load.
        if _STORES:  # a single process never made one: nothing to collect
            _STORES.clear()
            gc.collect()

    def data_parallel(self) -> DataParallel | None:
        if not self.distributed:
            return None
        return DataParallel(all_reduce=lambda t: dist.all_reduce(t), grad_scale=self.world,
                            all_max=_all_max)

    def check_config(self, cfg: Config) -> None:
        """Every rank must run the same config: rank 0's is broadcast and compared key by
        key; any difference fails every rank at start, naming the first differing key."""
        if not self.distributed:
            return
        mine = _flat(cfg.model_dump(mode="json"))
        theirs = json.loads(self.broadcast_bytes(
            json.dumps(mine, sort_keys=True).encode() if self.is_main else None))
        keys = sorted(set(mine) | set(theirs))
        bad = [k for k in keys if mine.get(k) != theirs.get(k)]
        flag = torch.tensor([1 if bad else 0])
        dist.all_reduce(flag)
        if bad:
            raise ConfigError(f"{bad[0]}: rank {self.rank} has {mine.get(bad[0])!r}, rank 0 "
                              f"has {theirs.get(bad[0])!r}; every rank must run one config")
        if int(flag) > 0:
            raise ConfigError("trainer ranks disagree on the config (see the failing rank's "
                              "log for the key); every rank must run one config")

    # ------------------------------------------------------------------ per step

    def exchange(self, header: StepHeader, groups: list[ScoredGroup] | None = None,
                 limits: Limits | None = None) -> tuple[StepHeader, list[ScoredGroup]]:
        """Rank 0 sends ``header`` and, for ``STEP``, the step's groups; every rank
        returns them (the others pass any header, e.g. `IDLE_HEADER`)."""
        if not self.distributed:
            return header, groups or []
        head = torch.tensor(header.as_ints(), dtype=torch.int64)
        dist.broadcast(head, 0)
        header = StepHeader.of_ints([int(x) for x in head])
        if header.command != STEP:
            return header, []
        blobs = [encode(g) for g in groups or []] if self.is_main else None
        payload = self.broadcast_bytes(_join(blobs) if blobs is not None else None)
        out = [decode(b, limits or Limits(), expect=ScoredGroup) for b in _split(payload)]
        return header, out  # type: ignore[return-value]

    def shard(self, groups: list[ScoredGroup]) -> list[ScoredGroup]:
        """This rank's groups of the step: ``rank::world`` (whole groups, so a packed
        forward can share each prompt)."""
        return groups[self.rank::self.world]

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (others pass None)."""
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(size, 0)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
               else torch.zeros(int(size), dtype=torch.uint8))
        if int(size):
            dist.broadcast(buf, 0)
        return bytes(buf.numpy().tobytes())


def backend_for(device: torch.device) -> str:
    """The process-group backend of a job training on ``device``: gloo on the CPU; on CUDA
    gloo for CPU tensors and nccl for CUDA tensors. The job's control collectives (config
    agreement, the step header, the step's group bytes, micro-batch counts, checkpoint
    agreement) use CPU tensors, which NCCL cannot carry (it has no CPU backend); FSDP2's
    gathers and gradient reductions use CUDA tensors, which go through NCCL."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def bind_device(device: torch.device) -> None:
    """Make ``device`` the current CUDA device of the calling thread (nothing on the
    CPU). The current device is per thread: a thread that never set it allocates and
    launches on GPU 0, whatever the rank."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def compute_thread(device: torch.device) -> ThreadPoolExecutor:
    """The one thread a trainer rank runs all its torch work in (steps, collectives,
    gathers, checkpoints), bound to ``device`` once when it starts (`bind_device`), so
    the event loop stays free for heartbeats and the lock while a step runs, collectives
    are issued in one order from one thread, and no allocation lands on another GPU."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-compute",
                              initializer=bind_device, initargs=(device,))


def shard_model(model: nn.Module, device: torch.device,
                compute_dtype: torch.dtype | None) -> None:
    """FSDP2 in place: each decoder layer its own unit, then the root (``model``, the
    `CompletionLogprobs` wrapper whose forward runs the policy). ``compute_dtype``: the
    parameters are gathered in it and gradients reduced in float32 (mixed precision)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) \
        if compute_dtype is not None else MixedPrecisionPolicy()
    for layer in _decoder_layers(model):
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    layers = [m for m in model.modules()
              if type(m).__name__.endswith(("DecoderLayer", "Block"))]
    if not layers:
        raise ValueError(f"no decoder layers found in {type(model).__name__} to shard")
    return layers


def full_state(module: nn.Module, ranks: Ranks) -> dict[str, torch.Tensor]:
    """Full CPU tensors of ``module``'s state dict, keys as ``module.state_dict()`` of an
    unsharded copy, no two sharing storage. Every rank must call it (it gathers); only
    rank 0 gets the tensors.

    Why no sharing: the checkpoint writes them with safetensors, which refuses tensors
    that share memory, and FSDP2's full state dict gathers a tied parameter (Qwen2.5's
    ``lm_head.weight`` = ``model.embed_tokens.weight``) once, under both names: every
    checkpoint of a sharded tied model failed ("Some tensors share memory")."""
    if not ranks.distributed:
        return {k: v.detach().to("cpu", copy=True).contiguous()
                for k, v in module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from pipeline.weights.shards import aliases

    sd = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True,
                                                               cpu_offload=True))
    sd = {k: v.contiguous() for k, v in sd.items()}
    copies = aliases(sd)
    return {k: v.clone() if k in copies else v for k, v in sd.items()}


def _attempt_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store:
    """The job's key-value store (``MASTER_ADDR:MASTER_PORT``; torchrun's agent hosts it),
    under a prefix per torchrun restart. The agent's store outlives a restart, and without
    the prefix a restarted rank could read a dead rank's gloo address from the previous
    attempt and fail with "Connection refused" (seen in the rank-kill fault test)."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                          int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent and rank == 0, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"sluice/attempt-{attempt}", store)


def _all_max(n: int) -> int:
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _join(blobs: list[bytes]) -> bytes:
    head = json.dumps([len(b) for b in blobs]).encode()
    return len(head).to_bytes(8, "little") + head + b"".join(blobs)


def _split(data: bytes) -> list[bytes]:
    n = int.from_bytes(data[:8], "little")
    lens = json.loads(data[8:8 + n])
    out, at = [], 8 + n
    for ln in lens:
        out.append(data[at:at + ln])
        at += ln
    return out


def rank_of(name: str | None) -> int:
    """The rank a trainer process named ``trainer-<rank>`` is (0 without a name)."""
    if name and name.rsplit("-", 1)[-1].isdigit():
        return int(name.rsplit("-", 1)[-1])
    return 0
