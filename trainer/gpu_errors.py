"""Which step failures are the device's, not the data's.

A step that raises is normally blamed on its groups (`trainer.reader.Reader.step_failed`:
the groups that raise on their own are dead-lettered, the rest re-read until
``bus.max_deliveries``). Two kinds of failure are not the data's fault, and treating them
so throws good groups away while the run goes on without training:

- running out of device memory (``torch.OutOfMemoryError``, which ``torch.cuda`` names
  ``OutOfMemoryError`` too): the same shapes would run out again after any number of
  replays, and the culprit search (one forward per group) would blame whichever group
  happened to be largest;
- a sticky CUDA error (an illegal memory access, a device-side assert, a cuBLAS or NCCL
  failure): the CUDA context is unusable afterwards, every later kernel of this process
  fails, so the culprit search would dead-letter every group. torch 2.13 raises these as
  ``torch.AcceleratorError`` (a ``RuntimeError`` subclass, ``torch/_C/__init__.pyi``)
  when the error is the runtime's own, and as a plain ``RuntimeError`` from libraries
  (cuBLAS, NCCL, the flash kernels), so the message is read too.

Either way the process must end without charging the groups: `device_fatal` turns the
error into a `pipeline.runtime.RoleFatal` whose message says what happened and what to
change, so the CLI exits `pipeline.runtime.FATAL_EXIT_CODE` and `sluice up` ends the run
naming it instead of restarting into the same failure. The groups stay pending and are
re-read when the run is resumed, with their delivery counts untouched by this failure's
culprit search.
"""

from __future__ import annotations

import torch

from pipeline.runtime import RoleFatal

STICKY_MARKERS = (
    "CUDA error",
    "an illegal memory access",
    "illegal instruction",
    "device-side assert",
    "misaligned address",
    "unspecified launch failure",
    "CUBLAS_STATUS",
    "CUDNN_STATUS",
    "NCCL error",
    "ncclUnhandledCudaError",
    "ncclSystemError",
    "ncclInternalError",
    "HIP error",
)
"""Substrings of the messages of errors that leave a CUDA (or ROCm) context unusable, as
the runtime, cuBLAS, cuDNN and NCCL word them."""

OOM_ADVICE = (
    "lower trainer.micro_batch_tokens (a step is split into micro-batches under it; 0 = "
    "the whole step at once), trainer.logprob_chunk_tokens or the longest rollout "
    "(generation.max_new_tokens / generation.vllm.max_model_len), set "
    "trainer.gradient_checkpointing = true, or leave the trainer more of its GPU "
    "(generation.vllm.gpu_memory_utilization / trainer_gpu_fraction where vLLM shares it)")


def is_out_of_memory(err: BaseException) -> bool:
    """``err`` is the device running out of memory (CUDA's caching allocator, or an
    accelerator's, raises ``torch.OutOfMemoryError``)."""
    return isinstance(err, torch.OutOfMemoryError)


def is_sticky_device_error(err: BaseException) -> bool:
    """``err`` leaves the device context unusable: a ``torch.AcceleratorError``, or a
    ``RuntimeError`` whose message carries one of `STICKY_MARKERS`. An OOM is not sticky
    (the allocator recovers) but is fatal for another reason (`device_fatal`)."""
    if is_out_of_memory(err):
        return False
    if isinstance(err, torch.AcceleratorError):
        return True
    return isinstance(err, RuntimeError) and any(m in str(err) for m in STICKY_MARKERS)


def device_fatal(err: BaseException, step: int) -> RoleFatal | None:
    """The `RoleFatal` to end the trainer with when ``err`` (raised by ``step``) is the
    device's failure, not the data's; None for any other error (the caller charges the
    groups as before)."""
    first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
    if is_out_of_memory(err):
        return RoleFatal(
            f"trainer step {step} ran out of GPU memory ({first}). Its groups were not "
            "charged: they stay pending and are read again when the run is resumed. The "
            f"same shapes would run out again, so the trainer stops; {OOM_ADVICE}")
    if is_sticky_device_error(err):
        return RoleFatal(
            f"trainer step {step} hit a CUDA error that leaves the device unusable in this "
            f"process ({type(err).__name__}: {first}). Its groups were not charged: they "
            "stay pending for the resumed run. Rerun with CUDA_LAUNCH_BLOCKING=1 to find "
            "the failing kernel; a device-side assert is often a token id outside the "
            "model's vocabulary, an illegal memory access a kernel or driver fault")
    return None
