"""What the GPU check's stages share: the tiny models and batches they train and compare,
one-rank process groups, and the context a stage runs in.

Every stage process imports this after `benchmarks.gpu_check` set ``HF_HUB_OFFLINE``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from benchmarks.synthetic import scored_groups
from pipeline.attention import FLASH_ATTN2
from pipeline.ports import free_port
from trainer.batch import Batch, build_batch
from trainer.distributed import Ranks, backend_for

BF16_TOL = 0.05  # nats: bf16 logprobs of other kernels / layouts (seen: 0.004 on the CPU)
FP32_TOL = 1e-4  # nats: float32 logprobs of other kernels / layouts
FLASH_KERNEL = FLASH_ATTN2  # the kernel deploy/setup.sh --gpu caches on every NVIDIA GPU


@dataclass(frozen=True)
class StageContext:
    """Where a stage runs: ``device`` (``cpu``, or ``cuda:0``: the stage picks other
    GPUs itself), how many CUDA devices this process sees, the FSDP stage's world size,
    and whether the vLLM stages may run against a CPU build of vLLM (development only)."""

    device: torch.device
    gpus: int
    fsdp_world: int
    vllm_on_cpu: bool = False

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


class Skipped(Exception):
    """Raised by a stage that cannot run here; the message is the reason, and the
    report row says ``skipped`` with it (a skipped stage does not fail the check)."""


class OneRankJob(Ranks):
    """A job of one rank that still takes the multi-rank paths (FSDP2's full-state
    gathers, the checkpoint's broadcasts): what a GPU job runs, at world size 1."""

    @property
    def distributed(self) -> bool:
        return True


def tiny_config(vocab: int = 512, tied: bool = False) -> Qwen2Config:
    """A 2-layer Qwen2 (hidden 128, 4 heads, 2 KV heads, rope theta 1e6); ``tied``: the LM
    head shares the input embedding, as Qwen2.5-0.5B's does."""
    return Qwen2Config(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=2048, rope_theta=1e6,
                       tie_word_embeddings=tied, attn_implementation="sdpa")


def tiny_model(device: torch.device, dtype: torch.dtype = torch.float32,
               attn: str = "sdpa", tied: bool = False) -> Qwen2ForCausalLM:
    """`tiny_config`'s model in eval mode, seeded: every call gives the same weights."""
    torch.manual_seed(0)
    cfg = tiny_config(tied=tied)
    cfg._attn_implementation = attn
    with device:
        model = Qwen2ForCausalLM(cfg)
    return model.to(dtype).eval()


def one_batch(vocab: int, seed: int = 0, groups: int = 3) -> Batch:
    """``groups`` groups of 4 synthetic samples (prompts 5-24, completions 3-40 tokens)."""
    return build_batch(scored_groups(groups, 4, vocab_size=vocab, prompt_tokens=(5, 24),
                                     completion_tokens=(3, 40), seed=seed), pad_id=0)


@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[str]:
    """A one-rank default process group on `backend_for` ``device`` (a TCP store on a free
    loopback port); destroyed on exit."""
    backend = backend_for(device)
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every entry of ``model``'s state dict as a full CPU tensor (FSDP2's DTensors
    gathered: every rank must call it)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
            for k, v in model.state_dict().items()}


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    fa, fb = full_params(a), full_params(b)
    return fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Gradient checkpointing exactly as `trainer.setup.build` turns it on."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(  # type: ignore[operator]
            gradient_checkpointing_kwargs={"use_reentrant": False})
