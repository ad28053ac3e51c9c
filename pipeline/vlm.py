"""Vision-language models trained on text only: which tensors are frozen, and the tiny one.

A VLM (Qwen2.5-VL, Qwen3-VL, Qwen3.5, ...) is a text model plus a vision tower and a
projector (merger) that feed image features into it. sluice trains it on text-only data
as TRL's AsyncGRPOTrainer does (trl 1.16, ``experimental/async_grpo/async_grpo_trainer.py``):

- **The frozen set is TRL's rule, which is structural, not a list of names.** A model is
  a VLM when its config has a separate text config (``config.get_text_config() is not
  config``). Then everything is frozen except the text model (the `PreTrainedModel`
  submodule whose config *is* the text config: ``model.language_model`` for Qwen-VL and
  Gemma 3, ``model.text_model`` for SmolVLM) and the output embeddings (``lm_head``).
  So the vision tower (``model.visual``), its merger / ``multi_modal_projector`` and any
  other non-text part are frozen whatever their names. `frozen_keys` gives them as
  ``state_dict`` keys; ``model.frozen_prefixes`` (config) adds parameter-name prefixes of
  the user's own (any model, VLM or not).
- **Frozen means**: ``requires_grad=False`` in the trainer (`freeze`), so no gradient and
  no AdamW state (the optimizer takes trainable parameters only; checkpoints' optimizer
  state is keyed by those names); and never published (`without_frozen`): no file, s3,
  delta or NCCL version carries them, as TRL's ``_iter_vllm_named_params`` skips
  ``requires_grad=False`` parameters. Every engine keeps the values it loaded from the
  run's pinned model folder, which are the trainer's too (it never changes them), and
  accepts versions without them (`workers.engines.transformers.read_weights`).
- **Text only.** A prompt carrying an image or a video is refused when the task is built
  (`workers.tasks.prompts.refuse_images`), as TRL's async trainer has no image path;
  sluice's packed layouts also have no 3D M-RoPE positions for image tokens. Text tokens
  have the same position on M-RoPE's three axes (`trainer.packing.model_positions`).

Invariant: every role computes the same frozen set from the same config and folder
(`frozen_keys` reads only the module tree and the config), so a version's tensor names
are the trained keys on both sides of a weight transport.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeline.config import Config, ConfigError

VISION_TOKENS: tuple[str, ...] = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                  "<|video_pad|>")
"""The tiny VLM's extra special tokens (Qwen2.5-VL's names), after the char vocabulary."""
TINY_VLM_RECIPE = "tiny-char-qwen2_5_vl"


def is_vlm_config(config: Any) -> bool:
    """TRL's test: the config holds a separate text config (a multimodal model)."""
    get = getattr(config, "get_text_config", None)
    return get is not None and get() is not config


def text_model_name(model: nn.Module) -> str | None:
    """The module name of a VLM's text model (the submodule whose config is the text
    config), None for a model that is not a VLM. Raises when a VLM has none."""
    from transformers import PreTrainedModel

    config = getattr(model, "config", None)
    if not is_vlm_config(config):
        return None
    text_config = config.get_text_config()
    for name, module in model.named_modules():
        if module is not model and isinstance(module, PreTrainedModel) \
                and module.config is text_config:
            return name
    raise ValueError(f"{type(model).__name__} is multimodal but has no text model whose "
                     "config is its text config: sluice cannot tell what to train")


def frozen_keys(model: nn.Module, extra_prefixes: Iterable[str] = ()) -> frozenset[str]:
    """``state_dict`` keys that are never trained nor published (module docstring): a
    VLM's non-text parts, and every key under one of ``extra_prefixes``
    (``model.frozen_prefixes``; each must match at least one parameter, else
    ValueError naming it). Empty for a text model without extra prefixes."""
    keys = list(model.state_dict())
    frozen: set[str] = set()
    text = text_model_name(model)
    if text is not None:
        head = model.get_output_embeddings()
        head_name = next((n for n, m in model.named_modules() if m is head), None)
        trained = tuple(f"{p}." for p in (text, head_name) if p)
        frozen |= {k for k in keys if not k.startswith(trained)}
    names = [n for n, _ in model.named_parameters()]
    for prefix in extra_prefixes:
        if not any(_under(n, prefix) for n in names):
            raise ValueError(f"model.frozen_prefixes: {prefix!r} names no parameter of "
                             f"{type(model).__name__} (e.g. {names[0]!r})")
        frozen |= {k for k in keys if _under(k, prefix)}
    return frozenset(frozen)


def _under(name: str, prefix: str) -> bool:
    prefix = prefix.rstrip(".")
    return name == prefix or name.startswith(prefix + ".")


def freeze(model: nn.Module, keys: frozenset[str]) -> int:
    """``requires_grad_(False)`` on every parameter named in ``keys``; returns how many
    elements were frozen. A tied parameter is frozen only if all its names are (the
    trained name wins, as TRL unfreezes ``lm_head`` after freezing the model)."""
    frozen = 0
    trained_ids = {id(p) for n, p in model.named_parameters(remove_duplicate=False)
                   if n not in keys}
    for name, p in model.named_parameters():
        if name in keys and id(p) not in trained_ids:
            p.requires_grad_(False)
            frozen += p.numel()
    return frozen


def without_frozen(state: Mapping[str, torch.Tensor], keys: frozenset[str]
                   ) -> dict[str, torch.Tensor]:
    """``state`` minus the frozen keys: what a version publishes (same order)."""
    return {k: v for k, v in state.items() if k not in keys}


def auto_class(config: Any) -> Any:
    """The transformers auto class that loads a folder with this config: a VLM through
    ``AutoModelForImageTextToText`` (its causal-LM mapping has no multimodal entries in
    transformers 5), anything else through ``AutoModelForCausalLM``. TRL instead takes
    ``config.architectures[0]``; both load Qwen2.5-VL as
    ``Qwen2_5_VLForConditionalGeneration``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vlm_config(config) else AutoModelForCausalLM


def tiny_vlm(text: Mapping[str, Any], *, vocab_size: int) -> nn.Module:
    """A random-init Qwen2.5-VL whose text model has ``text``'s Qwen2 settings and
    ``vocab_size`` (the char vocabulary plus `VISION_TOKENS`), with a one-block vision
    tower (hidden 32) and its merger; seed the RNG before calling. The vision token ids
    are the last four, so no character is an image token."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    hidden = int(text["hidden_size"])
    n = vocab_size - len(VISION_TOKENS)
    text_config = {**text, "vocab_size": vocab_size,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                       "mrope_section": _mrope_section(
                                           hidden // int(text["num_attention_heads"]))}}
    cfg = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64,
                       "num_heads": 2, "out_hidden_size": hidden, "patch_size": 14,
                       "spatial_merge_size": 2, "temporal_patch_size": 2,
                       "window_size": 56, "fullatt_block_indexes": [0]},
        vision_start_token_id=n, vision_end_token_id=n + 1, image_token_id=n + 2,
        video_token_id=n + 3, tie_word_embeddings=bool(text["tie_word_embeddings"]))
    return Qwen2_5_VLForConditionalGeneration(cfg).to(torch.float32)


def _mrope_section(head_dim: int) -> list[int]:
    """M-RoPE's split of the head's ``head_dim / 2`` rotary frequencies over (t, h, w),
    in Qwen2.5-VL's proportions (16, 24, 24 of 64)."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def image_processor_config() -> dict[str, Any]:
    """``preprocessor_config.json`` of the tiny VLM (Qwen2.5-VL's image processor at the
    tiny tower's patch and merge sizes): vLLM builds the model's multimodal processor
    from it even when every prompt is text."""
    return {"image_processor_type": "Qwen2VLImageProcessor", "do_resize": True,
            "do_rescale": True, "do_normalize": True, "rescale_factor": 1 / 255,
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
            "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2,
            "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64,
            "processor_class": "Qwen2_5_VLProcessor"}


def check_model(cfg: Config) -> None:
    """The trainer's start-up check (`trainer.preflight`), before any weights load: a LoRA
    adapter on a VLM is refused (peft's ``target_modules`` would adapt the vision
    tower's layers too), and every ``model.frozen_prefixes`` entry must name a parameter
    (the model is built on the meta device from its config). A folder that does not
    exist yet (`sluice up` builds it) is checked when the trainer loads it
    (`trainer.setup.frozen_part`). Raises `ConfigError` naming the key."""
    from transformers import AutoConfig

    from pipeline.hub import is_hub_id, resolve_model

    path = cfg.model.path
    if not is_hub_id(path) and not (Path(path) / "config.json").is_file():
        return
    folder = resolve_model(path, cfg.model.revision).local_dir
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    if cfg.model.lora is not None and is_vlm_config(config):
        raise ConfigError("model.lora: LoRA on a vision-language model is not supported "
                          "yet (its target modules would also adapt the vision tower); "
                          "train full weights (docs/vlm.md)")
    if cfg.model.frozen_prefixes:
        with torch.device("meta"):
            model = auto_class(config).from_config(config)
        try:
            frozen_keys(model, cfg.model.frozen_prefixes)
        except ValueError as e:
            raise ConfigError(str(e)) from None
