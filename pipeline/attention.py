"""What an attention implementation (``model.attn_implementation``) needs, checked at start,
and what ``auto`` picks on a device.

transformers runs ``sdpa`` and ``eager`` anywhere. Everything else is a varlen kernel on
CUDA: ``flash_attention_2`` / ``flash_attention_3`` (the ``flash_attn`` packages), or a
`kernels` hub repository such as ``kernels-community/flash-attn2``, which transformers
loads through the ``kernels`` library (transformers 5.24 accepts ``kernels>=0.18.2,<0.19``
only; the ``gpu`` extra pins that range). Roles started by `sluice up` run with
``HF_HUB_OFFLINE=1``, so a hub kernel must already be in the local Hugging Face cache:
``deploy/setup.sh --gpu`` fetches it. A missing piece fails at start naming the key, not
as a traceback from the first forward of a role that started.

``auto`` (`resolve_attention`, a pure function of the device's stated properties and the
model's attention-logit softcapping; `attention_for` reads both and logs the choice):

- CPU, Apple MPS, any other non-CUDA device: ``sdpa`` (``eager`` for a softcapping model:
  transformers' sdpa has no softcap, Gemma 2 refuses it);
- ROCm (AMD): ``kernels-community/aiter-flash-attn``;
- NVIDIA Blackwell and newer (compute capability major >= 10: sm_100/sm_103 data-centre,
  sm_110, sm_120/sm_121 consumer and GB10): ``kernels-community/flash-attn4``;
- NVIDIA Hopper (sm_90): ``kernels-community/flash-attn3`` (FlashAttention-3 is Hopper-only);
- NVIDIA Ampere/Ada (sm_80-sm_89): ``kernels-community/flash-attn2`` (FA3 does not run there);
- older NVIDIA (< sm_80, which FlashAttention-2 does not support): ``sdpa`` (``eager`` with
  softcapping).

aiter-flash-attn and flash-attn4 have no softcap argument; a softcapping model
(``attn_logit_softcapping`` set: Gemma 2) on ROCm or Blackwell is refused at start naming
the key (`ConfigError`), never silently run without its softcap. TRL 1.16's async
trainers pick by vendor only (ROCm: aiter-flash-attn, else flash-attn3:
``trl/experimental/async_grpo/packing.py``); flash-attn4 on Blackwell and the softcapping
limit follow TRL's newer docs; the per-capability split is sluice's (docs/gpu.md).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pipeline.config import ConfigError

if TYPE_CHECKING:
    import torch

    from pipeline.config import Config

log = logging.getLogger("sluice.attention")
AUTO = "auto"
FLASH_ATTN2 = "kernels-community/flash-attn2"
FLASH_ATTN3 = "kernels-community/flash-attn3"
FLASH_ATTN4 = "kernels-community/flash-attn4"
AITER_FLASH_ATTN = "kernels-community/aiter-flash-attn"
AUTO_HUB_KERNELS = (FLASH_ATTN2, FLASH_ATTN3, FLASH_ATTN4, AITER_FLASH_ATTN)
"""Every hub kernel ``auto`` can pick (``deploy/setup.sh --gpu`` caches the one for its GPU)."""
NO_SOFTCAP = frozenset({FLASH_ATTN4, AITER_FLASH_ATTN})
"""Hub kernels without attention-logit softcapping."""
Vendor = Literal["cpu", "cuda", "rocm", "mps", "other"]

MASK_ATTENTIONS = frozenset({"sdpa", "eager"})
"""Attentions that take an explicit (4D) mask and run on the CPU: the packed layouts'
block and tree masks work with them (`trainer.packing`)."""

# the flash_attn packages each built-in flash implementation imports
_FLASH_PACKAGES = {"flash_attention_2": ("flash_attn",),
                   "flash_attention_3": ("flash_attn_interface", "flash_attn_3")}


def is_hub_kernel(name: str) -> bool:
    """A `kernels` hub repository (``org/name``, optionally ``org/name@revision``)."""
    return "/" in name


def is_varlen(name: str) -> bool:
    """A varlen (flash-style) kernel: no explicit mask; packed samples are separated by
    ``cu_seqlens`` (or by position ids in a single row), never by a mask."""
    return name not in MASK_ATTENTIONS and name != "flex_attention"


def check_attention(name: str, device_type: str, *, key: str = "model.attn_implementation",
                    device_key: str = "trainer.device", offline: bool = True) -> None:
    """``ConfigError`` naming ``key`` when ``name`` cannot run here: a flash kernel on a
    non-CUDA device (``device_key``), a flash package that is not installed, a hub
    kernel without a ``kernels`` version transformers accepts, or (``offline``) a hub
    kernel absent from the local Hugging Face cache. ``name`` is resolved: ``auto``
    goes through `attention_for` first."""
    if name == AUTO:
        raise ValueError('check_attention takes a resolved name: attention_for(cfg, device)')
    if not is_varlen(name):
        return
    if device_type != "cuda":
        raise ConfigError(f"{key}: {name!r} is a CUDA kernel but {device_key} is "
                          f"{device_type!r}; use sdpa there")
    if name in _FLASH_PACKAGES:
        if not any(importlib.util.find_spec(p) for p in _FLASH_PACKAGES[name]):
            raise ConfigError(f"{key}: {name!r} needs the package "
                              f"{_FLASH_PACKAGES[name][0]!r}, which is not installed")
        return
    if not is_hub_kernel(name):
        return  # another transformers implementation: transformers validates it
    from transformers.utils.import_utils import (
        KERNELS_MAX_VERSION,
        KERNELS_MIN_VERSION,
        is_kernels_available,
    )

    if not is_kernels_available():
        raise ConfigError(f"{key}: {name!r} needs the `kernels` library at a version "
                          f"transformers accepts (>={KERNELS_MIN_VERSION},"
                          f"<{KERNELS_MAX_VERSION}): `pip install -e '.[gpu]'` "
                          "(deploy/setup.sh --gpu)")
    if offline:  # transformers' own load, in this role's environment (offline under up)
        from kernels import get_kernel
        from transformers.integrations.hub_kernels import get_attn_kernel_version

        repo, _, revision = name.partition("@")
        pinned = {"revision": revision} if revision else {
            "version": get_attn_kernel_version(repo)}
        try:
            get_kernel(repo, **pinned)
        except Exception as e:  # the kernel's own import errors too: it cannot run here
            raise ConfigError(
                f"{key}: the kernel {name!r} ({pinned}) does not load from the local Hugging "
                "Face cache and the roles run offline (HF_HUB_OFFLINE=1); fetch it once with "
                "network: bash deploy/setup.sh --gpu (it caches the kernels auto picks), or "
                f"SLUICE_KERNELS={repo} bash deploy/setup.sh --gpu "
                f"[{type(e).__name__}: {str(e)[:200]}]") from None


@dataclass(frozen=True)
class DeviceProps:
    """What ``auto`` reads of a device: its vendor and, for NVIDIA, the compute capability
    ``(major, minor)`` (``torch.cuda.get_device_capability``; on ROCm torch reports the
    gfx version there, which is never compared)."""

    vendor: Vendor
    capability: tuple[int, int] | None = None

    def describe(self) -> str:
        if self.vendor == "cuda" and self.capability is not None:
            return f"an NVIDIA GPU of compute capability {self.capability[0]}.{self.capability[1]}"
        return {"rocm": "an AMD (ROCm) GPU", "cpu": "the CPU", "mps": "Apple MPS"}.get(
            self.vendor, "this device")


def resolve_attention(device: DeviceProps, softcap: float | None = None, *,
                      key: str = "model.attn_implementation") -> str:
    """The attention ``auto`` means on ``device`` for a model whose attention logits are
    softcapped at ``softcap`` (None: not). Pure: the module docstring's table. Raises
    `ConfigError` naming ``key`` where the kernel it picks has no softcap."""
    capped = softcap is not None
    if device.vendor == "rocm":
        kernel = AITER_FLASH_ATTN
    elif device.vendor == "cuda" and device.capability is not None:
        major = device.capability[0]
        if major < 8:
            return "eager" if capped else "sdpa"
        kernel = FLASH_ATTN4 if major >= 10 else FLASH_ATTN3 if major == 9 else FLASH_ATTN2
    else:  # cpu, mps, or a CUDA device whose capability is unknown
        return "eager" if capped else "sdpa"
    if capped and kernel in NO_SOFTCAP:
        raise ConfigError(
            f'{key}: "auto" picks {kernel} on {device.describe()}, which has no '
            f"attention-logit softcapping, and this model softcaps its attention logits "
            f"(attn_logit_softcapping = {softcap:g}); set {key} = \"eager\" (exact, "
            f"slower) or train it on a GPU where auto picks flash-attn2/3")
    return kernel


def device_props(device: torch.device) -> DeviceProps:
    """The stated properties of a torch device (`resolve_attention`'s input)."""
    import torch

    if device.type == "cuda":
        if torch.version.hip is not None:
            return DeviceProps("rocm")
        major, minor = torch.cuda.get_device_capability(device)
        return DeviceProps("cuda", (int(major), int(minor)))
    if device.type in ("cpu", "mps"):
        return DeviceProps(device.type)  # type: ignore[arg-type]
    return DeviceProps("other")


def logit_softcapping(config: Any) -> float | None:
    """``attn_logit_softcapping`` of a transformers config (or of its text config, for
    multimodal wrappers); None when absent or unset."""
    for c in (config, getattr(config, "text_config", None)):
        value = getattr(c, "attn_logit_softcapping", None) if c is not None else None
        if value is not None:
            return float(value)
    return None


def model_softcapping(path: str | Path, revision: str = "main") -> float | None:
    """The softcapping of the model at ``path`` (a folder or a cached hub id; read
    offline); None when its config cannot be read yet (`sluice up` builds the tiny model
    after the checks; the load that follows resolves again from the real folder)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path), revision=revision,
                                            local_files_only=True)
    except (OSError, ValueError):
        return None
    return logit_softcapping(config)


def attention_for(cfg: Config, device: torch.device | str, *,
                  model_path: str | Path | None = None) -> str:
    """``model.attn_implementation`` for a role's model on ``device``: as written, or
    for ``auto`` `resolve_attention` of the device and of the model at ``model_path``
    (default ``model.path``), logged with what it read."""
    import torch

    name = cfg.model.attn_implementation
    if name != AUTO:
        return name
    dev = torch.device(device)
    props = device_props(dev)
    softcap = model_softcapping(model_path or cfg.model.path, cfg.model.revision)
    chosen = resolve_attention(props, softcap)
    log.info('model.attn_implementation "auto" -> %s on %s (%s)%s', chosen, dev,
             props.describe(), f", attn_logit_softcapping {softcap:g}" if softcap else "")
    return chosen


def kernels_to_cache(device: DeviceProps) -> list[str]:
    """The hub kernels ``deploy/setup.sh --gpu`` fetches on a machine whose GPU is
    ``device``: flash-attn2 on NVIDIA (the documented explicit choice, Ampere and newer)
    and whatever hub kernel ``auto`` picks there (softcap aside), so an ``auto`` run
    starts offline. A device where auto picks no hub kernel gets none of its own."""
    out = [FLASH_ATTN2] if device.vendor == "cuda" else []
    chosen = resolve_attention(device)
    if is_hub_kernel(chosen) and chosen not in out:
        out.append(chosen)
    return out


def local_kernels_to_cache() -> list[str]:
    """`kernels_to_cache` for this machine's first GPU (none without one)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return kernels_to_cache(device_props(torch.device("cuda", 0)))
