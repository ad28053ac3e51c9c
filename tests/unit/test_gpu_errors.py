"""A step that ran out of GPU memory or hit a sticky CUDA error is the device's failure,
not its groups': no group is dead-lettered or re-read, and the trainer stops with
`RoleFatal` (exit `FATAL_EXIT_CODE`, which `sluice up` reports as an error no restart can
fix), saying what to change. The errors are the classes torch 2.13 raises on CUDA
(``torch.OutOfMemoryError``, ``torch.AcceleratorError``) and the messages cuBLAS/NCCL
put in a plain ``RuntimeError``, raised here from a stand-in step on the CPU.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pipeline.config import load_config
from pipeline.runtime import RoleFatal
from trainer.gpu_errors import device_fatal, is_out_of_memory, is_sticky_device_error
from trainer.reader import Reader
from trainer.trainer import Trainer

OOM = torch.OutOfMemoryError(
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB")
STICKY = [
    torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
    RuntimeError("CUDA error: device-side assert triggered\nCUDA kernel errors might be "
                 "asynchronously reported"),
    RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx`"),
    RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error "
                 "(run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3"),
]
DATA = [RuntimeError("poisoned token in the forward"), ValueError("bad shape"),
        RuntimeError("out of memory (simulated)")]  # a message alone is not an OOM


def test_torch_cuda_names_the_same_oom_class() -> None:
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError
    assert issubclass(torch.AcceleratorError, RuntimeError)


@pytest.mark.parametrize("err", STICKY)
def test_sticky_cuda_errors_are_fatal_and_say_how_to_find_the_kernel(err: Exception) -> None:
    assert is_sticky_device_error(err) and not is_out_of_memory(err)
    fatal = device_fatal(err, 7)
    assert isinstance(fatal, RoleFatal)
    assert "step 7" in str(fatal) and "not charged" in str(fatal)
    assert "CUDA_LAUNCH_BLOCKING=1" in str(fatal)


def test_oom_is_fatal_and_names_the_keys_to_change() -> None:
    assert is_out_of_memory(OOM) and not is_sticky_device_error(OOM)
    msg = str(device_fatal(OOM, 3))
    for key in ("trainer.micro_batch_tokens", "trainer.gradient_checkpointing",
                "trainer.logprob_chunk_tokens", "not charged"):
        assert key in msg, key


@pytest.mark.parametrize("err", DATA)
def test_data_failures_stay_data_failures(err: Exception) -> None:
    assert device_fatal(err, 1) is None


class _NoBus:
    """Any call is a failure: a device error must not touch the stream."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the reader touched the bus ({name}) on a device failure")


@pytest.mark.parametrize("err", [OOM, *STICKY])
def test_step_failed_charges_no_group_on_a_device_failure(err: Exception) -> None:
    reader = Reader(load_config(None, []), "trainer-0", "trainer-0", None,  # type: ignore[arg-type]
                    None)  # type: ignore[arg-type]
    buf: list[Any] = [(object(), object()), (object(), object())]
    with pytest.raises(RoleFatal):
        asyncio.run(reader.step_failed(_NoBus(), buf, err, [0, 1], step=4))  # type: ignore[arg-type]
    assert reader.counts["dead"] == 0 and reader.counts["failed_steps"] == 0


class _Stub:
    """Just what `Trainer.steps` reads of its trainer: a full buffer of two groups, a step
    (``step_all``) that raises ``err``, and a record of the culprit search and of
    `Reader.step_failed` (the two ways groups get charged)."""

    def __init__(self, err: Exception) -> None:
        self.err, self.charged = err, []  # type: list[str]
        self.state = SimpleNamespace(step=0, version=0)
        self.train_cfg = SimpleNamespace(max_steps=5, groups_per_step=2, weight_sync_steps=1,
                                         save_steps=100)
        self.ranks = SimpleNamespace(distributed=False)
        self.reader = SimpleNamespace(collect=self.collect, step_failed=self.step_failed)

    async def collect(self, bus: Any, stop: Any, buf: list[Any], **_: Any) -> list[Any]:
        return [(object(), object()), (object(), object())]

    async def compute(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    def step_all(self, header: Any, groups: Any) -> Any:
        raise self.err

    def culprits(self, groups: Any) -> list[int]:
        self.charged.append("culprit search")
        return []

    async def step_failed(self, *args: Any) -> list[Any]:
        self.charged.append("step_failed")
        raise SystemExit  # the old path: the groups were charged; stop the loop here


@pytest.mark.parametrize("err", [OOM, STICKY[0]])
def test_the_trainer_stops_before_any_group_is_charged(err: Exception) -> None:
    stub = _Stub(err)
    lock = SimpleNamespace(lost=False)
    with pytest.raises(RoleFatal) as e:
        asyncio.run(Trainer.steps(stub, None, asyncio.Event(), lock))  # type: ignore[arg-type]
    assert stub.charged == [] and e.value.__cause__ is err


def test_a_data_failure_still_goes_to_the_culprit_search() -> None:
    stub = _Stub(DATA[0])
    with pytest.raises(SystemExit):
        asyncio.run(Trainer.steps(stub, None, asyncio.Event(),  # type: ignore[arg-type]
                                  SimpleNamespace(lost=False)))
    assert stub.charged == ["culprit search", "step_failed"]
