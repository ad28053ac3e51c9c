"""``model.attn_implementation = "auto"``: the pure rule (`resolve_attention`) for every
kind of device, the softcapping refusals, and what a CPU run resolves it to end to end
(the loaded model's attention and the trainer's packing layout). No GPU here: GPU devices
are stated properties, the rule's input; nothing on a GPU has run this path."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import Gemma2Config, Gemma3Config, Qwen2Config

from pipeline.attention import (
    AITER_FLASH_ATTN,
    AUTO_HUB_KERNELS,
    FLASH_ATTN2,
    FLASH_ATTN3,
    FLASH_ATTN4,
    DeviceProps,
    attention_for,
    check_attention,
    device_props,
    kernels_to_cache,
    logit_softcapping,
    resolve_attention,
)
from pipeline.config import ConfigError, load_config
from pipeline.model import init_tiny_model, load_policy
from trainer.setup import layout_kind

torch.set_num_threads(1)

CHOICES = [  # (device, no softcap, softcap 50)
    (DeviceProps("cpu"), "sdpa", "eager"),
    (DeviceProps("mps"), "sdpa", "eager"),
    (DeviceProps("other"), "sdpa", "eager"),
    (DeviceProps("cuda", None), "sdpa", "eager"),  # capability unknown: nothing assumed
    (DeviceProps("cuda", (7, 5)), "sdpa", "eager"),  # Turing: no FlashAttention-2
    (DeviceProps("cuda", (8, 0)), FLASH_ATTN2, FLASH_ATTN2),  # A100
    (DeviceProps("cuda", (8, 9)), FLASH_ATTN2, FLASH_ATTN2),  # L4 / RTX 40
    (DeviceProps("cuda", (9, 0)), FLASH_ATTN3, FLASH_ATTN3),  # H100 / H200
    (DeviceProps("cuda", (10, 0)), FLASH_ATTN4, None),  # B200
    (DeviceProps("cuda", (10, 3)), FLASH_ATTN4, None),  # B300
    (DeviceProps("cuda", (12, 0)), FLASH_ATTN4, None),  # RTX 50 / PRO 6000
    (DeviceProps("rocm"), AITER_FLASH_ATTN, None),  # MI300X and the like
]


@pytest.mark.parametrize(("device", "plain", "capped"), CHOICES,
                         ids=[f"{d.vendor}{d.capability or ''}" for d, _, _ in CHOICES])
def test_auto_picks_by_device_and_refuses_softcapping_where_the_kernel_lacks_it(
        device: DeviceProps, plain: str, capped: str | None) -> None:
    assert resolve_attention(device) == plain
    if capped is not None:
        assert resolve_attention(device, 50.0) == capped
        return
    with pytest.raises(ConfigError, match=r'^model\.attn_implementation: "auto" picks '
                       rf"{plain}.*softcapping = 50.*model\.attn_implementation = \"eager\""):
        resolve_attention(device, 50.0)


def test_every_hub_kernel_auto_picks_is_one_setup_caches_on_that_machine() -> None:
    for device, plain, _ in CHOICES:
        cached = kernels_to_cache(device)
        if plain in AUTO_HUB_KERNELS:
            assert plain in cached, device
        assert set(cached) <= set(AUTO_HUB_KERNELS)
    assert kernels_to_cache(DeviceProps("cuda", (9, 0))) == [FLASH_ATTN2, FLASH_ATTN3]
    assert kernels_to_cache(DeviceProps("rocm")) == [AITER_FLASH_ATTN]  # no CUDA build
    assert kernels_to_cache(DeviceProps("cpu")) == []
    setup = (Path(__file__).resolve().parents[2] / "deploy" / "setup.sh").read_text()
    assert "local_kernels_to_cache" in setup and "get_attn_kernel_version" in setup


def test_softcapping_is_read_from_the_model_config_or_its_text_config() -> None:
    assert logit_softcapping(Gemma2Config()) == 50.0  # Gemma 2 softcaps by default
    assert logit_softcapping(Gemma2Config(attn_logit_softcapping=None)) is None
    assert logit_softcapping(Qwen2Config()) is None
    wrapped = Gemma3Config()
    assert logit_softcapping(wrapped) is None
    wrapped.text_config.attn_logit_softcapping = 30.0
    assert logit_softcapping(wrapped) == 30.0


def test_device_props_of_the_cpu_and_check_attention_takes_resolved_names() -> None:
    assert device_props(torch.device("cpu")) == DeviceProps("cpu")
    with pytest.raises(ValueError, match="resolved"):
        check_attention("auto", "cpu")
    with pytest.raises(ConfigError, match=r"model\.attn_implementation: .*CUDA kernel"):
        check_attention(FLASH_ATTN3, "cpu")


def test_auto_on_the_cpu_loads_sdpa_keeps_prefix_sharing_and_logs_the_choice(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model_dir = init_tiny_model(tmp_path / "m", seed=0)
    cfg = load_config(None, [f"model.path={model_dir}", 'model.attn_implementation="auto"',
                             "trainer.packing=true", "trainer.prefix_sharing=true"])
    with caplog.at_level(logging.INFO, logger="sluice.attention"):
        model, _ = load_policy(cfg, device="cpu", trained=True)
    assert model.config._attn_implementation == "sdpa"
    assert layout_kind(cfg, model) == "shared"  # a mask attention: tree masks stay on
    assert any('"auto" -> sdpa on cpu' in r.getMessage() for r in caplog.records)


def test_auto_gives_a_softcapping_model_eager_on_the_cpu(tmp_path: Path) -> None:
    folder = tmp_path / "gemma2"
    Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                 vocab_size=64).save_pretrained(folder)
    cfg = load_config(None, [f"model.path={folder}", 'model.attn_implementation="auto"'])
    assert attention_for(cfg, "cpu") == "eager"
    cfg = load_config(None, [f"model.path={folder}"])
    assert attention_for(cfg, "cpu") == "sdpa"  # as written: auto is not the default
