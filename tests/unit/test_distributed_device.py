"""What a trainer job on GPUs would send where, checked on the CPU.

NCCL carries CUDA tensors only; the job's control collectives use CPU tensors. The job
therefore runs a mixed backend on CUDA (`backend_for`): gloo for CPU tensors, nccl for
CUDA ones. These tests record every tensor the control plane hands to a collective and
pin the rule; tests/integration/test_ranks.py runs real gloo ranks. The current CUDA
device is per thread, so every torch call of a rank runs in one compute thread bound to
its device (`compute_thread`).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from benchmarks.synthetic import scored_groups
from pipeline.config import load_config
from trainer import distributed
from trainer.batch import build_batch
from trainer.checkpoint import Checkpointer
from trainer.distributed import (
    STEP,
    Ranks,
    StepHeader,
    backend_for,
    bind_device,
    compute_thread,
)
from trainer.step import DataParallel, step_norm


def test_a_cuda_job_runs_cpu_tensors_on_gloo_and_cuda_tensors_on_nccl() -> None:
    assert backend_for(torch.device("cpu")) == "gloo"
    backend = backend_for(torch.device("cuda", 1))
    assert backend == "cpu:gloo,cuda:nccl"
    # torch's own parser of the string: one backend per device type
    assert dict(item.split(":") for item in backend.split(",")) == {"cpu": "gloo",
                                                                    "cuda": "nccl"}


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, torch.Tensor]]:
    """Every tensor given to a collective, as (collective, tensor); each collective acts
    as rank 0 of a two-rank job would see it (broadcast: unchanged; all-reduce: x2)."""
    seen: list[tuple[str, torch.Tensor]] = []

    def broadcast(t: torch.Tensor, src: int = 0, **kw: Any) -> None:
        seen.append(("broadcast", t))

    def all_reduce(t: torch.Tensor, op: Any = None, **kw: Any) -> None:
        seen.append(("all_reduce", t))

    monkeypatch.setattr(dist, "broadcast", broadcast)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return seen


def test_every_control_collective_of_a_rank_uses_cpu_tensors(
        recorded: list[tuple[str, torch.Tensor]], tmp_path: Any) -> None:
    """Config agreement, the step header and the step's bytes, the step's normaliser,
    the skip decision, the micro-batch count and the checkpoint agreement: all CPU
    tensors, so with `backend_for` they travel on gloo, never on NCCL."""
    groups = scored_groups(2, 4, vocab_size=76, prompt_tokens=(3, 6),
                           completion_tokens=(1, 5), seed=0)
    ranks = Ranks(rank=0, world=2)
    ranks.check_config(load_config(None))
    ranks.exchange(StepHeader(STEP, 3, publish=True), groups)
    dp = ranks.data_parallel()
    assert isinstance(dp, DataParallel)
    step_norm(build_batch(groups, 0), dp)
    dp.all_max(3)
    Checkpointer(tmp_path, keep=1)._load_distributed(  # nothing saved: agreement only
        torch.nn.Linear(1, 1), torch.optim.SGD([torch.zeros(1, requires_grad=True)], 0.1),
        None, ranks)
    kinds = {kind for kind, _ in recorded}
    assert kinds == {"broadcast", "all_reduce"} and len(recorded) >= 8
    assert {t.device.type for _, t in recorded} == {"cpu"}, [
        (k, t.device) for k, t in recorded]


def test_the_compute_thread_is_bound_to_the_ranks_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Work submitted to a rank's compute thread runs after `torch.cuda.set_device` was
    called with the rank's device in that same thread (a fresh thread would run on GPU
    0); on the CPU nothing is set."""
    bound: list[tuple[torch.device, int]] = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: bound.append((d, threading.get_ident())))
    pool = compute_thread(torch.device("cuda", 1))
    try:
        ran_in = pool.submit(threading.get_ident).result(10)
        again = pool.submit(threading.get_ident).result(10)
    finally:
        pool.shutdown()
    assert bound == [(torch.device("cuda", 1), ran_in)] and again == ran_in
    assert ran_in != threading.get_ident()
    bound.clear()
    bind_device(torch.device("cpu"))
    assert bound == []


def test_the_trainer_runs_every_torch_call_in_its_compute_thread() -> None:
    """No bare asyncio.to_thread of torch work is left in the trainer role: each goes
    through `Trainer.compute` (the tracker's calls are not torch work)."""
    import inspect

    from trainer import trainer

    src = inspect.getsource(trainer)
    offenders = [line.strip() for line in src.splitlines()
                 if "to_thread(" in line and "tracker" not in line]
    assert offenders == []
    assert distributed.compute_thread.__name__ in src


def test_a_one_rank_checkpoint_keeps_optimizer_state_on_the_cpu_and_resumes_anywhere(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-rank GPU trainer's AdamW state lives on its GPU. What reaches torch: the state
    is gathered with ``cpu_offload`` (so ``optimizer.pt`` holds CPU tensors, no GPU index
    baked in) and read back with ``map_location="cpu"`` (a machine without the saver's GPU
    resumes; ``Optimizer.load_state_dict`` moves each state to its parameter's device)."""
    from trainer import checkpoint
    from trainer.checkpoint import TrainerState

    gets: list[Any] = []
    loads: list[dict[str, Any]] = []
    real_get, real_load = checkpoint.get_optimizer_state_dict, torch.load
    monkeypatch.setattr(checkpoint, "get_optimizer_state_dict",
                        lambda *a, **k: gets.append(k["options"]) or real_get(*a, **k))
    monkeypatch.setattr(checkpoint.torch, "load",
                        lambda *a, **k: loads.append(k) or real_load(*a, **k))
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    ckpt = Checkpointer(tmp_path, keep=1)
    ckpt.save(model, opt, TrainerState(step=1))
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    assert ckpt.load_latest(fresh, fresh_opt) is not None
    assert [o.cpu_offload and o.full_state_dict for o in gets] == [True]
    assert [k.get("map_location") for k in loads] == ["cpu"]
    saved = real_load(tmp_path / "step-00000001" / "optimizer.pt", weights_only=True)
    state = saved["optimizer"]["state"]
    assert state and all(t.device.type == "cpu" for s in state.values()
                         for t in s.values() if isinstance(t, torch.Tensor))
    torch.testing.assert_close(fresh_opt.state_dict()["state"][0]["exp_avg"],
                               opt.state_dict()["state"][0]["exp_avg"])


# ---------------------------------------------------------------- one GPU per rank


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int, world: int, rank: int) -> None:
    """A machine with ``count`` CUDA devices, this process rank ``rank`` of ``world``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_RANK", str(rank))


def test_a_multi_rank_job_refuses_one_named_gpu_for_every_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``cuda:N`` would put every rank on GPU N; each rank takes ``cuda:LOCAL_RANK``."""
    from pipeline.config import ConfigError
    from pipeline.devices import resolve_device

    _gpus(monkeypatch, 4, world=2, rank=1)
    with pytest.raises(ConfigError, match=r"trainer\.device.*'cuda:0'.*LOCAL_RANK"):
        resolve_device("cuda:0", "trainer.device")
    assert resolve_device("cuda", "trainer.device") == torch.device("cuda", 1)
    assert resolve_device("auto", "trainer.device") == torch.device("cuda", 1)
    _gpus(monkeypatch, 4, world=1, rank=0)  # one process: taken as written
    assert resolve_device("cuda:3", "trainer.device") == torch.device("cuda", 3)


def test_sluice_up_refuses_a_named_gpu_for_several_trainer_ranks() -> None:
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match=r"trainer\.device.*up\.trainer_ranks = 2"):
        load_config(None, ['trainer.device="cuda:1"', "up.trainer_ranks=2"])
    load_config(None, ['trainer.device="cuda"', "up.trainer_ranks=2"])
    load_config(None, ['trainer.device="cuda:1"', "up.trainer_ranks=1"])


# ---------------------------------------------------------------- tied weights under FSDP2


class _OneRankJob(Ranks):
    """One rank on the multi-rank paths (FSDP2's gathers, the checkpoint's broadcasts)."""

    @property
    def distributed(self) -> bool:
        return True


def test_a_sharded_tied_model_checkpoints_and_resumes(tmp_path: Any) -> None:
    """FSDP2's full state dict gathers a tied parameter (Qwen2.5's ``lm_head.weight`` =
    ``model.embed_tokens.weight``) once, under both names, and safetensors refuses
    tensors that share memory: `full_state` hands the checkpoint one copy per name, so a
    sharded tied model saves and resumes (a one-rank gloo job on the multi-rank path)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipeline.ports import free_port
    from trainer.checkpoint import TrainerState
    from trainer.distributed import full_state, shard_model
    from trainer.logprobs import CompletionLogprobs

    cpu, ranks = torch.device("cpu"), _OneRankJob(0, 1)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      tie_word_embeddings=True)

    def sharded() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = Qwen2ForCausalLM(cfg)
        shard_model(CompletionLogprobs(model, temperature=1.0), cpu, None)
        return model, torch.optim.AdamW(model.parameters(), lr=0.1)

    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model, opt = sharded()
        state = full_state(model, ranks)
        assert {"lm_head.weight", "model.embed_tokens.weight"} <= state.keys()
        storages = [t.untyped_storage().data_ptr() for t in state.values()]
        assert len(set(storages)) == len(storages)
        Checkpointer(tmp_path, keep=1).save(model, opt, TrainerState(step=1), None, ranks)
        fresh, fresh_opt = sharded()
        resumed = Checkpointer(tmp_path, keep=1).load_latest(fresh, fresh_opt, None, ranks)
        assert resumed is not None and resumed.step == 1
        torch.testing.assert_close(full_state(fresh, ranks), state)
    finally:
        dist.destroy_process_group()
