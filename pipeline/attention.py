"""What an attention implementation (``model.attn_implementation``) needs, checked at start.

transformers runs ``sdpa`` and ``eager`` anywhere. Everything else is a varlen kernel on
CUDA: ``flash_attention_2`` / ``flash_attention_3`` (the ``flash_attn`` packages), or a
`kernels` hub repository such as ``kernels-community/flash-attn2``, which transformers
loads through the ``kernels`` library (transformers 5.24 accepts ``kernels>=0.18.2,<0.19``
only; the ``gpu`` extra pins that range). Roles started by `sluice up` run with
``HF_HUB_OFFLINE=1``, so a hub kernel must already be in the local Hugging Face cache:
``deploy/setup.sh --gpu`` fetches it. A missing piece fails at start naming the key, not
as a traceback from the first forward of a role that started.
"""

from __future__ import annotations

import importlib.util

from pipeline.config import ConfigError

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
    kernel absent from the local Hugging Face cache."""
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
    if offline:
        repo, _, revision = name.partition("@")
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            snapshot_download(repo, revision=revision or None, local_files_only=True)
        except (LocalEntryNotFoundError, OSError, ValueError) as e:
            raise ConfigError(
                f"{key}: the kernel {name!r} is not in the local Hugging Face cache and the "
                "roles run offline (HF_HUB_OFFLINE=1); fetch it once with network: "
                f"python -c \"from kernels import get_kernel; get_kernel('{repo}')\" "
                f"(deploy/setup.sh --gpu does) [{type(e).__name__}]") from None
