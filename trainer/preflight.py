"""The trainer role's start-up checks, run before any role starts (`sluice train`, `sluice
up`, `sluice replay`, as ``trainer.trainer.preflight``): what would otherwise fail only
once the model is loaded fails at once, with a ``ConfigError`` naming the key."""

from __future__ import annotations

from pipeline.attention import attention_for, check_attention
from pipeline.config import Config, ConfigError
from pipeline.devices import resolve_device
from pipeline.tracking import check_report_to
from pipeline.vlm import check_model
from pipeline.weights import check_store


def preflight(cfg: Config) -> None:
    """What the trainer loads first, checked before any role starts (`sluice train`,
    `sluice up`): ``trainer.device`` exists and can run ``model.attn_implementation``
    (`pipeline.attention`), float16 has float32 master weights, the tracker of
    ``run.report_to`` is installed, and the weight store takes its versions
    (`pipeline.weights.check_store`), and what it freezes fits the model (no LoRA on a
    vision-language model, ``model.frozen_prefixes``: `pipeline.vlm.check_model`). Each
    failure is a ``ConfigError`` naming the key."""
    device = resolve_device(cfg.trainer.device, "trainer.device")
    check_attention(attention_for(cfg, device), device.type, device_key="trainer.device")
    if cfg.model.dtype == "float16" and not cfg.trainer.fp32_master:
        raise ConfigError("trainer.fp32_master: model.dtype float16 needs float32 master "
                          "weights (loss scaling); set it true or use bfloat16")
    check_report_to(cfg)
    check_store(cfg, write=True)
    check_model(cfg)
