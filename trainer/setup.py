"""Build what a trainer rank trains with, from the config: device, dtypes, the policy and
its forward root, the KL reference, optimizer, learning-rate schedule, step settings.

Precision (``model.dtype`` x ``trainer.fp32_master``):
- float32: everything float32.
- bf16/fp16 with ``fp32_master`` (default): float32 parameters and AdamW state; forward
  and backward compute in the low dtype (``torch.autocast`` on one rank, FSDP2's
  ``MixedPrecisionPolicy`` with float32 gradient reduction across ranks). fp16 adds a
  ``GradScaler`` (loss scaling).
- bf16 without ``fp32_master``: parameters and optimizer state in bf16 (half the memory,
  coarser updates). fp16 without it is refused: loss scaling needs float32 masters.
Published weights are cast to ``model.dtype`` by the weight store's consumers (every
engine loads into its own dtype).

Bad combinations fail here, at start, naming the key: CUDA asked for without it
(`pipeline.devices`), fp16 without float32 masters, LoRA on several ranks (not supported
yet: the adapter's optimizer state would need its own sharding), a step that does not
split into whole groups per rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from transformers import get_scheduler

from pipeline.config import Config, ConfigError
from pipeline.devices import resolve_device, torch_dtype
from pipeline.model import is_peft, load_model, load_policy
from pipeline.rl.losses import LossConfig
from trainer.distributed import Ranks, shard_model
from trainer.logprobs import CompletionLogprobs, split_lm
from trainer.packing import LayoutKind
from trainer.step import StepSettings

log = logging.getLogger("sluice.trainer")

MASK_ATTENTIONS = ("sdpa", "eager")  # attentions that take a 4D (tree) mask


@dataclass
class TrainSetup:
    ranks: Ranks
    device: torch.device
    model: nn.Module  # the policy (HF model, peft-wrapped for LoRA)
    fwd: CompletionLogprobs  # the forward root; FSDP's root in a multi-rank job
    ref: CompletionLogprobs | None  # frozen KL reference (full-weight runs, beta > 0)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    settings: StepSettings
    pad_id: int
    tokenizer: object


def build(cfg: Config, ranks: Ranks | None = None) -> TrainSetup:
    tc = cfg.trainer
    device = resolve_device(tc.device, "trainer.device")
    ranks = ranks or Ranks.from_env(device, timeout_s=1800)
    ranks.check_config(cfg)
    if ranks.distributed and cfg.model.lora is not None:
        raise ConfigError("model.lora: LoRA training runs on one trainer rank "
                          f"(this job has {ranks.world}); drop the ranks or the adapter")
    if tc.groups_per_step % ranks.world:
        raise ConfigError(f"trainer.groups_per_step: {tc.groups_per_step} does not split "
                          f"into whole groups over {ranks.world} ranks")
    low = torch_dtype(cfg.model.dtype)
    master = "float32" if tc.fp32_master else cfg.model.dtype
    compute = low if tc.fp32_master and low != torch.float32 else None
    model, tok = load_policy(cfg, device=device, dtype=master)
    model.train()
    if tc.gradient_checkpointing:
        base = model.get_base_model() if is_peft(model) else model  # type: ignore[operator]
        if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.2x
            base.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            base.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
    temperature = tc.temperature or cfg.generation.temperature
    fwd = CompletionLogprobs(model, temperature, tc.logprob_chunk_tokens)
    ref = None
    if tc.beta > 0 and cfg.model.lora is None:  # frozen reference: loaded once, never synced
        ref_model, _ = load_model(cfg.model.path, dtype=master, device=device,
                                  attn_implementation=cfg.model.attn_implementation,
                                  revision=cfg.model.revision)
        ref_model.requires_grad_(False)
        ref = CompletionLogprobs(ref_model, temperature, tc.logprob_chunk_tokens)
    if ranks.distributed:
        shard_model(fwd, device, compute)
        if ref is not None:
            shard_model(ref, device, compute)
        compute = None  # FSDP's mixed-precision policy casts; no autocast on top
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=tc.lr, betas=tc.adam_betas,
                                  weight_decay=tc.weight_decay)
    scheduler = get_scheduler(tc.lr_scheduler, optimizer, num_warmup_steps=tc.warmup_steps,
                              num_training_steps=tc.max_steps)
    scaler = torch.amp.GradScaler(device.type) if low == torch.float16 else None
    pad_id = int(getattr(tok, "pad_token_id", None) or 0)
    settings = StepSettings(
        loss=LossConfig(
            loss_type=tc.loss_type, epsilon=tc.epsilon, epsilon_high=tc.epsilon_high,
            is_mode=tc.is_mode, is_clip_min=tc.is_clip_min, is_clip_max=tc.is_clip_max,
            beta=tc.beta, kl_bias_correction=tc.kl_bias_correction,
            max_completion_length=cfg.max_rollout_tokens,
            importance_sampling_level=tc.importance_sampling_level,
            decoupled_ppo=tc.decoupled_ppo, geo_mask=tc.geo_mask),
        temperature=temperature, num_iterations=tc.num_iterations,
        max_grad_norm=tc.max_grad_norm, micro_batch_tokens=tc.micro_batch_tokens,
        layout=layout_kind(cfg, model), chunk_tokens=tc.logprob_chunk_tokens, pad_id=pad_id,
        compute_dtype=compute)
    return TrainSetup(ranks, device, model, fwd, ref, optimizer, scheduler, scaler, settings,
                      pad_id, tok)


def layout_kind(cfg: Config, model: nn.Module) -> LayoutKind:
    """padded | packed | shared (packed + prefix sharing where the attention allows)."""
    if not cfg.trainer.packing:
        return "padded"
    body, _ = split_lm(model)
    attn = getattr(body.config, "_attn_implementation", "sdpa")
    if cfg.trainer.prefix_sharing and attn in MASK_ATTENTIONS:
        return "shared"
    if cfg.trainer.prefix_sharing:
        log.info("prefix sharing off: attention %r takes no tree mask (packing stays on)", attn)
    return "packed"
