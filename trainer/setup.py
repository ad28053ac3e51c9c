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
split into whole groups per rank, a LoRA adapter on a vision-language model.

Frozen parameters (`frozen_part`: a VLM's vision tower and projector, TRL's rule, and
``model.frozen_prefixes``) get ``requires_grad=False`` before the optimizer is built, so
AdamW holds no state for them; `TrainSetup.frozen` names them for publishing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from transformers import get_scheduler

from pipeline.attention import MASK_ATTENTIONS, attention_for
from pipeline.config import Config, ConfigError
from pipeline.config.root import score_centering_on
from pipeline.devices import resolve_device, torch_dtype
from pipeline.model import is_peft, load_model, load_policy
from pipeline.rl.logprobs import split_lm
from pipeline.rl.losses import LossConfig
from pipeline.vlm import freeze, frozen_keys, is_vlm_config
from trainer.distributed import Ranks, shard_model
from trainer.logprobs import CompletionLogprobs, attention_implementation
from trainer.packing import LayoutKind
from trainer.step import StepSettings

log = logging.getLogger("sluice.trainer")


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
    frozen: frozenset[str] = frozenset()  # state_dict keys never trained nor published


def frozen_part(cfg: Config, model: nn.Module) -> frozenset[str]:
    """Freeze what is never trained (`pipeline.vlm`: a vision-language model's non-text
    parts, TRL's rule; ``model.frozen_prefixes``) and return its ``state_dict`` keys.
    A LoRA run freezes its whole base already (peft); a LoRA adapter on a VLM is
    refused: peft's ``target_modules`` would also match the vision tower's layers."""
    if is_peft(model):
        if is_vlm_config(model.get_base_model().config):  # type: ignore[operator]
            raise ConfigError("model.lora: LoRA on a vision-language model is not "
                              "supported yet (its target modules would also adapt the "
                              "vision tower); train full weights (docs/vlm.md)")
        return frozenset()
    try:
        keys = frozen_keys(model, cfg.model.frozen_prefixes)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    elements = freeze(model, keys)
    if keys:
        log.info("frozen: %d tensors, %d elements (never trained nor published)",
                 len(keys), elements)
    return keys


def head_matmul_precision(device: torch.device, model_dtype: torch.dtype,
                          fp32_head: bool) -> str | None:
    """The float32 matmul precision the trainer sets for its process, or None to leave
    torch's default (``highest``: plain IEEE float32).

    "high" (TF32 on NVIDIA tensor cores) on CUDA when the LM head runs in float32 amid a
    bf16/fp16 model: the head is then the only float32 matmul of the step (autocast runs
    the rest in the low dtype), and TF32 (10-bit mantissa inputs, float32 accumulation)
    keeps its logits far closer than bf16 logits (8-bit) at tensor-core speed. A float32
    model asked for float32 everywhere, so it keeps "highest"; the CPU has no TF32.

    Set through ``torch.set_float32_matmul_precision`` (torch's older API), not
    ``torch.backends.cuda.matmul.fp32_precision = "tf32"`` (its newer one): in torch 2.13
    setting only the newer one makes every later read through the older one raise
    ("you have used mix of the legacy and new APIs"), and torch's own inductor
    (``torch.compile``, flex attention) reads ``get_float32_matmul_precision``; the
    older setter updates both, so either reader sees "tf32"/"high". ``allow_tf32``
    carries no deprecation warning in 2.13 but is the legacy flag too."""
    if device.type == "cuda" and fp32_head and model_dtype != torch.float32:
        return "high"
    return None


def set_head_matmul_precision(device: torch.device, model_dtype: torch.dtype,
                              fp32_head: bool) -> None:
    """Apply `head_matmul_precision` (process-wide: torch has no per-matmul switch, and
    the head's backward runs on autograd's own thread)."""
    precision = head_matmul_precision(device, model_dtype, fp32_head)
    if precision is not None:
        torch.set_float32_matmul_precision(precision)
        log.info("float32 matmuls (the float32 LM head) run in TF32 on %s "
                 "(torch.set_float32_matmul_precision(%r))", device, precision)


def build(cfg: Config, ranks: Ranks | None = None) -> TrainSetup:
    train_cfg = cfg.trainer
    device = resolve_device(train_cfg.device, "trainer.device")
    set_head_matmul_precision(device, torch_dtype(cfg.model.dtype), train_cfg.fp32_lm_head)
    ranks = ranks or Ranks.from_env(device, timeout_s=1800)
    ranks.check_config(cfg)
    if ranks.distributed and cfg.model.lora is not None:
        raise ConfigError("model.lora: LoRA training runs on one trainer rank "
                          f"(this job has {ranks.world}); drop the ranks or the adapter")
    if train_cfg.groups_per_step % ranks.world:
        raise ConfigError(f"trainer.groups_per_step: {train_cfg.groups_per_step} does not split "
                          f"into whole groups over {ranks.world} ranks")
    low = torch_dtype(cfg.model.dtype)
    master = "float32" if train_cfg.fp32_master else cfg.model.dtype
    compute = low if train_cfg.fp32_master and low != torch.float32 else None
    model, tok = load_policy(cfg, device=device, dtype=master, trained=True)
    model.train()
    frozen = frozen_part(cfg, model)  # before sharding and before the optimizer
    if train_cfg.gradient_checkpointing:
        base = model.get_base_model() if is_peft(model) else model  # type: ignore[operator]
        if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.2x
            base.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            base.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
    temperature = train_cfg.temperature or cfg.generation.temperature
    fwd = CompletionLogprobs(model, temperature, train_cfg.logprob_chunk_tokens,
                             train_cfg.fp32_lm_head)
    ref = None
    if train_cfg.beta > 0 and cfg.model.lora is None:  # frozen reference: loaded once, never synced
        ref_model, _ = load_model(cfg.model.path, dtype=master, device=device,
                                  attn_implementation=attention_for(cfg, device),
                                  revision=cfg.model.revision)
        ref_model.requires_grad_(False)
        ref = CompletionLogprobs(ref_model, temperature, train_cfg.logprob_chunk_tokens,
                                 train_cfg.fp32_lm_head)
    if ranks.distributed:
        shard_model(fwd, device, compute)
        if ref is not None:
            shard_model(ref, device, compute)
        compute = None  # FSDP's mixed-precision policy casts; no autocast on top
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=train_cfg.lr, betas=train_cfg.adam_betas,
                                  weight_decay=train_cfg.weight_decay)
    scheduler = get_scheduler(train_cfg.lr_scheduler, optimizer,
                              num_warmup_steps=train_cfg.warmup_steps,
                              num_training_steps=train_cfg.max_steps)
    scaler = torch.amp.GradScaler(device.type) if low == torch.float16 else None
    pad_id = int(getattr(tok, "pad_token_id", None) or 0)
    t = train_cfg
    settings = StepSettings(
        loss=LossConfig(
            loss_type=t.loss_type, epsilon=t.epsilon, epsilon_high=t.epsilon_high,
            is_mode=t.is_mode, is_clip_min=t.is_clip_min, is_clip_max=t.is_clip_max,
            beta=t.beta, kl_bias_correction=t.kl_bias_correction,
            max_completion_length=cfg.max_rollout_tokens,
            importance_sampling_level=t.importance_sampling_level,
            decoupled_ppo=t.decoupled_ppo, geo_mask=t.geo_mask,
            score_centering=score_centering_on(cfg)),
        temperature=temperature, num_iterations=t.num_iterations,
        max_grad_norm=t.max_grad_norm, micro_batch_tokens=t.micro_batch_tokens,
        layout=layout_kind(cfg, model), chunk_tokens=t.logprob_chunk_tokens, pad_id=pad_id,
        compute_dtype=compute, fp32_head=t.fp32_lm_head)
    return TrainSetup(ranks, device, model, fwd, ref, optimizer, scheduler, scaler, settings,
                      pad_id, tok, frozen)


def layout_kind(cfg: Config, model: nn.Module) -> LayoutKind:
    """padded | packed | shared | trie: ``trainer.packing`` and ``trainer.prefix_sharing``
    (true or ``prompt``: shared; ``trie``: trie) where the attention allows.

    ``shared`` and ``trie`` need a 4D tree mask, so only a mask attention (sdpa, eager:
    `pipeline.attention.MASK_ATTENTIONS`) gets them; any other (flash, hub kernels, flex)
    gets ``packed``, every sample's path written out in full, whose sample boundaries the
    forward hands a varlen kernel explicitly (`trainer.packing`)."""
    if not cfg.trainer.packing:
        return "padded"
    sharing = cfg.trainer.prefix_sharing
    if sharing is False:
        return "packed"
    want: LayoutKind = "trie" if sharing == "trie" else "shared"
    body, _ = split_lm(model)
    attn = attention_implementation(body)
    if attn in MASK_ATTENTIONS:
        return want
    log.info("prefix sharing (%s) off: attention %r takes no tree mask (a tree is not a set "
             "of varlen segments); packing stays on, each sample written in full", want, attn)
    return "packed"
