"""Model/tokenizer construction and loading shared by workers and the trainer.

The tiny model is built locally: a 76-symbol character tokenizer and a random-init
Qwen2 causal LM (or, recipe ``tiny-char-qwen2_5_vl``, that text model inside a tiny
Qwen2.5-VL: `pipeline.vlm`). Any other causal LM transformers loads
(``AutoModelForCausalLM``; a vision-language model through ``AutoModelForImageTextToText``) and
its tokenizer (``AutoTokenizer``: fast or slow, so code here and downstream uses only
`PreTrainedTokenizerBase` methods) load from a folder; a hub id is first resolved to its
cached snapshot folder (`pipeline.hub`; roles get the run's pinned folder,
`pipeline.rundir`). Workers and the trainer must agree byte-for-byte on parameter names
and shapes, so both go through this module: `load_policy` is the one way every role
builds the policy, LoRA-wrapped (peft) when ``[model.lora]`` is set, so the trainer's
adapter keys are exactly those the engines load.
"""

from __future__ import annotations

import json
import os
import shutil
import string
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from pipeline.devices import DTYPES
from pipeline.textdecode import GENERIC_TOKENIZERS
from pipeline.vlm import (
    TINY_VLM_RECIPE,
    VISION_TOKENS,
    auto_class,
    image_processor_config,
    tiny_vlm,
)

if TYPE_CHECKING:  # peft is imported lazily: full-weight runs never need it
    from peft import PeftModel

    from pipeline.config import Config, LoraConfig

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, EOS, BOS, UNK)  # ids 0..3, fixed by position
PUNCTUATION: str = " =+-*,.:?!"
VOCAB_SIZE = 76
TINY_RECIPE = "tiny-char-qwen2"
RECIPES: tuple[str, ...] = (TINY_RECIPE, TINY_VLM_RECIPE)
"""What ``model.init`` / ``sluice init-model --recipe`` can build."""



def _symbols() -> list[str]:
    syms = [*SPECIAL_TOKENS, *string.digits, *string.ascii_lowercase, *string.ascii_uppercase]
    syms += list(PUNCTUATION)
    assert len(syms) == VOCAB_SIZE and len(set(syms)) == VOCAB_SIZE
    return syms


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per character, ids stable across builds.

    No post-processor, so encoding never adds bos/eos: prompt token counts equal character
    counts, which reward code and tests rely on. Spaces are real tokens (``isolated`` split),
    and the ``Fuse`` decoder joins tokens without inserting spaces, so decode round-trips.
    """
    vocab = {s: i for i, s in enumerate(_symbols())}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )
    return tok


def _tiny_config(
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    tie_word_embeddings: bool,
) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=SPECIAL_TOKENS.index(PAD),
        eos_token_id=SPECIAL_TOKENS.index(EOS),
        bos_token_id=SPECIAL_TOKENS.index(BOS),
        dtype="float32",
    )


def init_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    recipe: str = TINY_RECIPE,
) -> Path:
    """Write a random-init Qwen2 + char tokenizer to ``out_dir``; same seed -> same weights.

    ``recipe`` ``tiny-char-qwen2_5_vl`` (`pipeline.vlm.TINY_VLM_RECIPE`): the same text
    model as the text of a Qwen2.5-VL with a tiny vision tower (`pipeline.vlm.tiny_vlm`),
    its tokenizer the char one plus Qwen2.5-VL's four vision tokens (ids 76-79), and an
    image processor config (``preprocessor_config.json``) for servers that want one.

    ``tie_word_embeddings``: ``lm_head`` shares the input embedding (as in Qwen2.5-0.5B);
    the checkpoint then has no ``lm_head.weight`` (``save_pretrained`` drops the alias).

    The directory appears atomically (written to a sibling temp dir, then renamed), so a
    concurrent reader never sees a half-written checkpoint. An existing non-empty ``out_dir``
    is refused rather than overwritten, to avoid clobbering a real checkpoint.
    """
    out = Path(out_dir)
    if recipe not in RECIPES:
        raise ValueError(f"init_tiny_model: unknown recipe {recipe!r}; one of {RECIPES}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"init_tiny_model: refusing to overwrite non-empty path {out}")
    tok = build_char_tokenizer()
    vlm = recipe == TINY_VLM_RECIPE
    if vlm:
        tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    cfg = _tiny_config(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
    )
    # Fork the RNG so seeding here does not perturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (tiny_vlm(cfg.to_dict(), vocab_size=len(tok)) if vlm
                 else Qwen2ForCausalLM(cfg).to(torch.float32))
    model.generation_config = GenerationConfig(
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        bos_token_id=cfg.bos_token_id,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if vlm:
            (tmp / "preprocessor_config.json").write_text(
                json.dumps(image_processor_config(), indent=2))
        if out.exists():
            out.rmdir()  # empty (checked above); rename cannot replace a directory otherwise
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_model(
    path: str | Path, *, dtype: str = "float32", device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa", revision: str = "main",
) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """Load (model in eval mode, tokenizer) from a folder or a hub id.

    A hub id is resolved through the Hugging Face cache first (`pipeline.hub`: the only
    step that may download; offline it reads the cache), at ``revision``; transformers
    itself then only ever reads a local folder. ``attn_implementation`` is transformers'
    (``sdpa``, ``eager``, ``flash_attention_2``, or a `kernels` hub repo such as
    ``kernels-community/flash-attn2`` on CUDA). A vision-language checkpoint loads whole,
    vision tower included (`pipeline.vlm.auto_class`)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    folder = _local_folder(path, revision)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    model = auto_class(config).from_pretrained(
        folder, dtype=DTYPES[dtype], local_files_only=True,
        attn_implementation=attn_implementation,
    )
    model.to(device)
    model.eval()
    return model, load_tokenizer(folder)


def load_tokenizer(path: str | Path, revision: str = "main") -> PreTrainedTokenizerBase:
    """The tokenizer saved with a model (folder or hub id), via ``AutoTokenizer`` so a
    slow (Python) tokenizer loads as well as a fast one.

    Except a tokenizer saved as a generic one (`GENERIC_TOKENIZERS`, with a
    tokenizer.json): that is loaded verbatim from its tokenizer.json. transformers 5's
    AutoTokenizer swaps in the model type's own class for some types (qwen2 among them,
    to fix Hub repos that declare the wrong class), and that class rebuilds the
    pre-tokenizer: the tiny model's character tokenizer would then split differently from
    the one that was saved. A real checkpoint names its class (``Qwen2Tokenizer``) and
    goes through AutoTokenizer unchanged."""
    folder = Path(_local_folder(path, revision))
    try:
        declared = json.loads((folder / "tokenizer_config.json").read_text()).get(
            "tokenizer_class")
    except (OSError, ValueError):
        declared = None
    if declared in GENERIC_TOKENIZERS and (folder / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _local_folder(path: str | Path, revision: str) -> str:
    from pipeline.hub import resolve_model

    return resolve_model(str(path), revision).local_dir


def model_state_for_publish(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU copies of every state-dict tensor.

    Copies (not views) so that later optimizer steps cannot mutate a published snapshot and
    so that safetensors serialisation (which rejects shared/non-contiguous storage) works.
    """
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------- LoRA


def apply_lora(model: torch.nn.Module, lora: LoraConfig, *, seed: int | None = None) -> PeftModel:
    """Wrap ``model`` in place with a fresh peft LoRA adapter (named ``default``).

    Base parameters are frozen (``requires_grad=False``); only the adapter trains. peft
    initialises ``lora_B`` to zero, so the wrapped model computes exactly what the base
    does until the adapter is trained. ``lora_A`` is random: with ``seed`` it is drawn
    from a forked RNG seeded with it (same seed -> same adapter, the caller's RNG stream
    untouched); with None from the global torch RNG. The train/eval mode is kept.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    training = model.training
    pcfg = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=list(lora.target_modules), bias="none",
                          task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        peft_model = get_peft_model(model, pcfg)
    peft_model.train(training)
    return peft_model


def load_policy(cfg: Config, *, device: str | torch.device = "cpu", dtype: str | None = None,
                trained: bool = False) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """(policy in eval mode, tokenizer): the base model of ``cfg.model``, wrapped with a
    LoRA adapter (seeded by ``run.seed``) when ``cfg.model.lora`` is set and either
    ``trained`` (the trainer's policy) or the run publishes adapters (a role that loads
    versions; with ``lora.sync = "merged"`` it keeps the plain model the full versions
    fit). ``dtype`` overrides ``model.dtype`` (the trainer's float32 master weights).
    Roles started by `sluice` see ``model.path`` as the run's pinned folder already."""
    from pipeline.attention import attention_for

    model, tok = load_model(cfg.model.path, dtype=dtype or cfg.model.dtype, device=device,
                            attn_implementation=attention_for(cfg, device),
                            revision=cfg.model.revision)
    lora = cfg.model.lora if trained else cfg.model.serving_lora
    if lora is not None:
        model = apply_lora(model, lora, seed=cfg.run.seed)
    return model, tok


def is_peft(model: torch.nn.Module) -> bool:
    """True for a peft-wrapped model. Never imports peft (seconds of start-up that
    full-weight runs do not need): a model can only be a PeftModel once peft is loaded."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The active adapter's tensors in peft's saved format, as detached contiguous CPU
    copies (a later optimizer step cannot change them).

    Keys are peft's (``base_model.model.<module>.lora_A.weight``: the adapter name
    removed), which is what ``adapter_model.safetensors`` holds and vLLM loads.
    """
    from peft import get_peft_model_state_dict

    model = _require_peft(model)
    state = get_peft_model_state_dict(model, adapter_name=model.active_adapter)
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}


@torch.no_grad()
def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's ``state_dict`` with the active LoRA adapter merged in, keyed as
    the plain (un-wrapped) model: what a server without LoRA loads as full weights.

    Computed beside the training weights (base + peft's ``get_delta_weight``, scaling
    and fan-in/fan-out included), never by ``merge_adapter``/``unmerge_adapter``: merging
    in place and back would add a rounding error to the frozen base at every version.
    Tensors that no adapter touches are the model's own (not copies); the caller casts
    or copies (`pipeline.weights.shards.publishable`). Tied weights stay aliases.
    """
    from peft.tuners.lora import LoraLayer

    model = _require_peft(model)
    name = model.active_adapter
    base = model.get_base_model()
    deltas = {f"{mod_name}.weight": mod.get_delta_weight(name)
              for mod_name, mod in base.named_modules()
              if isinstance(mod, LoraLayer) and name in mod.lora_A}
    out: dict[str, torch.Tensor] = {}
    for key, t in base.state_dict(keep_vars=False).items():
        if ".lora_" in key:  # lora_A / lora_B / lora_embedding_* / lora_magnitude_*
            continue
        plain = key.replace(".base_layer.", ".")
        delta = deltas.get(plain)
        out[plain] = t if delta is None else t + delta.to(t.dtype)
    missing = set(deltas) - set(out)
    if missing:
        raise ValueError(f"LoRA deltas without a base weight: {sorted(missing)[:3]}")
    return out


def adapter_to_model_keys(model: torch.nn.Module,
                          state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Re-key an adapter state (peft's saved format) to ``model.state_dict()`` keys.

    The result covers exactly the active adapter's tensors, so it can be loaded with
    ``load_state_dict(strict=False)`` without leaving any adapter tensor stale. Raises
    ValueError when ``model`` is not a peft model, or when the keys or shapes differ from
    the model's adapter (another rank or target_modules), before anything is changed.
    """
    from peft import get_peft_model_state_dict

    model = _require_peft(model)
    name = model.active_adapter
    own = model.state_dict()
    saved = get_peft_model_state_dict(model, state_dict=own, adapter_name=name)
    key_of = {k.replace(f".{name}", ""): k for k in own if k.replace(f".{name}", "") in saved}
    if set(state) != set(key_of):
        missing, extra = sorted(set(key_of) - set(state)), sorted(set(state) - set(key_of))
        raise ValueError(f"adapter does not match the model's LoRA adapter: "
                         f"missing {missing[:3]} ({len(missing)}), "
                         f"unexpected {extra[:3]} ({len(extra)})")
    out = {key_of[k]: v for k, v in state.items()}
    for k, v in out.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise ValueError(f"adapter tensor {k} has shape {tuple(v.shape)}, "
                             f"the model's has {tuple(own[k].shape)} (another rank?)")
    return out


def _require_peft(model: torch.nn.Module) -> PeftModel:
    if not is_peft(model):
        raise ValueError(f"expected a peft (LoRA) model, got {type(model).__name__}: "
                         "is [model.lora] set for this role?")
    return model  # type: ignore[return-value]


def tokenizer_if_present(cfg: Config) -> Any:
    """The policy's tokenizer when the model exists (a folder with config.json, or a hub
    id: resolved through the cache, an offline miss fails naming ``model.path``); None
    when `sluice up` is about to build the tiny model there."""
    from pipeline.hub import is_hub_id

    path = cfg.model.path
    if is_hub_id(path) or (Path(path) / "config.json").is_file():
        return load_tokenizer(path, cfg.model.revision)
    return None
