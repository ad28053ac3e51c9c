"""The GPU check's training stages on the trainer's production paths: FSDP2 at one or two
ranks (``fsdp``), and a one-rank trainer's checkpoint on a GPU other than 0
(``checkpoint``).

``fsdp`` does what `trainer.setup.build` does for a multi-rank job (read there): float32
master parameters, gradient checkpointing, the forward root `CompletionLogprobs` (float32
LM head) sharded by `trainer.distributed.shard_model` with the serving dtype as FSDP2's
``MixedPrecisionPolicy`` (bf16 on CUDA; float32 on the CPU) and **no autocast on top**
(``StepSettings.compute_dtype`` None), gradients all-reduced through the job's
`DataParallel`, and each rank training the groups ``rank::world``. The model ties its
LM head to the input embedding, as Qwen2.5-0.5B does. World size 2 when two GPUs are
visible (one spawned process per rank, rank r on ``cuda:r``, a TCP store on 127.0.0.1),
else 1 (still the multi-rank code path: `OneRankJob`).

``checkpoint`` is the one-rank trainer (no FSDP: ``compute_dtype`` bf16 autocast on
CUDA) on ``cuda:1`` when two GPUs are visible, else ``cuda:0``, every tensor op on the
rank's compute thread as the trainer runs it: its AdamW state must reach
``optimizer.pt`` on the CPU (no GPU index baked in), resume there, and (on ``cuda:1``)
nothing may have been allocated on GPU 0.

Both save after two steps, resume into a fresh model and optimizer, and require equal
parameters after the resume and after one more step from each.
"""

from __future__ import annotations

import datetime
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.gpu_check.common import (
    OneRankJob,
    StageContext,
    enable_checkpointing,
    one_batch,
    params_equal,
    tiny_config,
    tiny_model,
)
from benchmarks.synthetic import scored_groups
from pipeline.ports import free_port
from pipeline.rl.losses import LossConfig
from trainer.batch import Batch, build_batch
from trainer.checkpoint import Checkpointer, TrainerState
from trainer.distributed import Ranks, backend_for, compute_thread, shard_model
from trainer.logprobs import CompletionLogprobs
from trainer.step import StepSettings, optimize

RANK_TIMEOUT_S = 300  # a rank's process-group timeout: below the stage's own timeout


def stage_fsdp(ctx: StageContext) -> dict[str, Any]:
    world = ctx.fsdp_world
    with tempfile.TemporaryDirectory(prefix="sluice-gpu-check-fsdp-") as tmp:
        port = free_port()
        if world == 1:
            fsdp_rank(0, 1, port, ctx.device.type, tmp)
        else:  # ranks in this stage's process group: a hang kills them with it
            import torch.multiprocessing as mp

            mp.start_processes(fsdp_rank, args=(world, port, ctx.device.type, tmp),
                               nprocs=world, start_method="spawn", join=True)
        return json.loads((Path(tmp) / "rank0.json").read_text())


def fsdp_rank(rank: int, world: int, port: int, device_type: str, tmp: str) -> None:
    """One rank of the FSDP job (``torch.multiprocessing`` calls it with ``rank``
    first); rank 0 writes the result to ``tmp/rank0.json``."""
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # as `Ranks.from_env`
    else:
        torch.set_num_threads(1 if world > 1 else 2)
    timeout = datetime.timedelta(seconds=RANK_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timeout)
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world,
                            timeout=timeout)
    ranks = Ranks(rank, world) if world > 1 else OneRankJob(0, 1)
    pool = compute_thread(device)  # every tensor op of the rank there, as in the trainer
    try:
        out = pool.submit(_fsdp_round_trip, device, ranks, Path(tmp)).result()
    except BaseException:
        ranks.close(together=False)  # the other rank may never reach a barrier
        raise
    finally:
        pool.shutdown(wait=True)
    ranks.close(together=True)
    if rank == 0:
        (Path(tmp) / "rank0.json").write_text(json.dumps(out))


def _policy(device: torch.device) -> torch.nn.Module:
    """The tied tiny policy as the trainer builds one: float32 masters, training mode,
    gradient checkpointing on."""
    model = tiny_model(device, tied=True).train()
    enable_checkpointing(model)
    return model


def _sharded(device: torch.device) -> tuple[torch.nn.Module, CompletionLogprobs,
                                             torch.optim.Optimizer]:
    model = _policy(device)
    fwd = CompletionLogprobs(model, temperature=1.0)
    shard_model(fwd, device, torch.bfloat16 if device.type == "cuda" else None)
    return model, fwd, torch.optim.AdamW(fwd.parameters(), lr=1e-3)


def _rank_batch(ranks: Ranks, seed: int) -> Batch:
    """This rank's share of a step: groups ``rank::world`` of 4 (as `Ranks.shard`)."""
    groups = scored_groups(4, 4, vocab_size=tiny_config().vocab_size, prompt_tokens=(5, 24),
                           completion_tokens=(3, 40), seed=seed)
    return build_batch(groups[ranks.rank::ranks.world], pad_id=0)


def _fsdp_round_trip(device: torch.device, ranks: Ranks, tmp: Path) -> dict[str, Any]:
    st = StepSettings(loss=LossConfig(loss_type="dapo"), temperature=1.0,
                      compute_dtype=None)  # FSDP2's policy casts: no autocast on top
    dp = ranks.data_parallel()
    model, fwd, opt = _sharded(device)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    steps = [optimize(fwd, opt, _rank_batch(ranks, s), st, None, data_parallel=dp)
             for s in (1, 2)]
    _require_trained(steps)
    ckpt = Checkpointer(tmp / "ckpt", keep=1)
    path = ckpt.save(model, opt, TrainerState(step=2, version=2), None, ranks)
    on_cpu = _optimizer_state_on_cpu(path) if ranks.is_main else True
    model2, fwd2, opt2 = _sharded(device)
    state = ckpt.load_latest(model2, opt2, None, ranks)
    if state is None or state.step != 2:
        raise AssertionError(f"checkpoint not resumed: {state}")
    same = params_equal(model, model2)
    third = _rank_batch(ranks, 3)
    optimize(fwd, opt, third, st, None, data_parallel=dp)
    optimize(fwd2, opt2, third, st, None, data_parallel=dp)
    after = params_equal(model, model2)
    if not (tied and on_cpu and same and after):
        raise AssertionError(f"tied head after sharding {tied}; AdamW state on the CPU in "
                             f"optimizer.pt {on_cpu}; parameters equal after the resume "
                             f"{same}, after a step from each {after}")
    return {"world_size": ranks.world, "backend": backend_for(device),
            "mixed_precision": "bfloat16" if device.type == "cuda" else "float32",
            "autocast": False, "gradient_checkpointing": True, "tied_embeddings": tied,
            "losses": [m["loss"] for m in steps], "resumed_step": state.step}


def _require_trained(steps: list[dict[str, float]]) -> None:
    bad = [m for m in steps if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]))
           or m.get("skipped", 0.0) > 0]
    if bad:
        raise AssertionError(f"non-finite or skipped steps: {bad}")


def _optimizer_state_on_cpu(path: Path | None) -> bool:
    """Whether every tensor of the AdamW state in ``path/optimizer.pt`` was saved on the
    CPU: loaded with no ``map_location``, a tensor saved on a GPU comes back there."""
    if path is None:
        raise AssertionError("rank 0 wrote no checkpoint")
    saved = torch.load(path / "optimizer.pt", weights_only=True)
    state = saved["optimizer"]["state"]
    tensors = [t for s in state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    if not tensors:
        raise AssertionError("optimizer.pt holds no AdamW state")
    return all(t.device.type == "cpu" for t in tensors)


def stage_checkpoint(ctx: StageContext) -> dict[str, Any]:
    device = torch.device("cuda", 1 if ctx.gpus >= 2 else 0) if ctx.cuda else ctx.device
    pool = compute_thread(device)  # bound to `device`: what the trainer's rank runs in
    try:
        with tempfile.TemporaryDirectory(prefix="sluice-gpu-check-ckpt-") as tmp:
            out = pool.submit(_one_rank_round_trip, device, Path(tmp)).result()
    finally:
        pool.shutdown(wait=True)
    if device.type == "cuda" and device.index != 0:
        on_gpu0 = torch.cuda.max_memory_allocated(0)
        out["bytes_allocated_on_cuda0"] = on_gpu0
        if on_gpu0:
            raise AssertionError(f"a one-rank trainer on {device} allocated {on_gpu0} bytes "
                                 "on cuda:0")
    return out


def _one_rank_round_trip(device: torch.device, tmp: Path) -> dict[str, Any]:
    st = StepSettings(loss=LossConfig(loss_type="dapo"), temperature=1.0,
                      compute_dtype=torch.bfloat16 if device.type == "cuda" else None)
    vocab = tiny_config().vocab_size

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = _policy(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    model, opt = fresh()
    steps = [optimize(model, opt, one_batch(vocab, seed=s), st) for s in (1, 2)]
    _require_trained(steps)
    ckpt = Checkpointer(tmp / "ckpt", keep=1)
    path = ckpt.save(model, opt, TrainerState(step=2, version=2), None, Ranks())
    on_cpu = _optimizer_state_on_cpu(path)
    model2, opt2 = fresh()
    state = ckpt.load_latest(model2, opt2, None, Ranks())
    if state is None or state.step != 2:
        raise AssertionError(f"checkpoint not resumed: {state}")
    resumed_on = sorted({str(t.device) for s in opt2.state.values() for t in s.values()
                         if isinstance(t, torch.Tensor) and t.dim() > 0})
    same = params_equal(model, model2)
    third = one_batch(vocab, seed=3)
    optimize(model, opt, third, st)
    optimize(model2, opt2, third, st)
    after = params_equal(model, model2)
    if not (on_cpu and resumed_on == [str(device)] and same and after):
        raise AssertionError(f"AdamW state on the CPU in optimizer.pt {on_cpu}; resumed on "
                             f"{resumed_on} (want [{device}]); parameters equal after the "
                             f"resume {same}, after a step from each {after}")
    return {"device": str(device), "autocast": str(st.compute_dtype),
            "adamw_state_saved_on_cpu": on_cpu, "adamw_state_resumed_on": resumed_on,
            "losses": [m["loss"] for m in steps], "resumed_step": state.step}
