"""Token ids back to text, as the generator decoded them, without importing transformers
where that is exact.

The generator's text of a completion is ``tokenizer.decode(ids, skip_special_tokens=True)``
with the tokenizer `pipeline.model.load_tokenizer` returns. The archiver needs the same
strings for every completion it keeps, and nothing else of transformers; importing it (and
torch under it) costs seconds of CPU per start, and its fast tokenizer's ``batch_decode``
loops in Python over one Rust call per sequence. So a decoder is either

- **light**: the ``tokenizers`` library alone, ``Tokenizer.from_file("tokenizer.json")``
  and one ``decode_batch`` call per batch, used only where it is provably the same
  function: the folder declares a generic tokenizer class (`GENERIC_TOKENIZERS`, which
  `pipeline.model.load_tokenizer` loads verbatim from tokenizer.json), turns
  ``clean_up_tokenization_spaces`` off (transformers' only post-processing of the Rust
  decode, ``PreTrainedTokenizerFast._decode``), sets no tokenizer_config key outside
  `_INERT_KEYS`, and every special token it names is already a special added token of
  tokenizer.json (so transformers adds none that ``skip_special_tokens`` would drop and
  the Rust decoder would keep). The tiny model's tokenizer is such a folder.
- **full**: anything else goes through `pipeline.model.load_tokenizer` and its
  ``batch_decode``, unchanged (`full_decoder`; the caller loads the tokenizer, so this
  module imports neither transformers nor `pipeline.model`).

tests/unit/test_textdecode.py checks the light decoder against the full one on every id
of the vocabulary and on random sequences, and that each rule above sends a folder to the
full one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""``tokenizer_class`` values that say "tokenizer.json is the whole tokenizer"."""

_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token",
                 "cls_token", "mask_token")
_INERT_KEYS = {"backend", "tokenizer_class", "clean_up_tokenization_spaces",
               "model_max_length", "padding_side", "truncation_side", "model_input_names",
               *_SPECIAL_KEYS}
"""tokenizer_config.json keys that do not change what ``decode`` returns (the special
tokens are checked against tokenizer.json separately)."""

Decoder = Callable[[list[list[int]]], list[str]]
"""Token ids of each sequence (plain lists, as the archiver makes them) -> their texts."""


def light_reason(folder: str | Path) -> str | None:
    """Why the folder's tokenizer needs transformers to decode exactly (module rules), or
    None when the light decoder is exact."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        spec = json.loads((folder / "tokenizer.json").read_text())
    except (OSError, ValueError) as e:
        return f"no readable tokenizer_config.json and tokenizer.json ({e})"
    if config.get("tokenizer_class") not in GENERIC_TOKENIZERS:
        return f"tokenizer_class {config.get('tokenizer_class')!r} is not generic"
    if config.get("clean_up_tokenization_spaces", True) is not False:
        return "clean_up_tokenization_spaces is not false"
    extra = sorted(set(config) - _INERT_KEYS)
    if extra:
        return f"tokenizer_config.json sets {extra}"
    special = {t.get("content") for t in spec.get("added_tokens", []) if t.get("special")}
    for key in _SPECIAL_KEYS:
        token = config.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        if token is not None and token not in special:
            return f"{key} {token!r} is not a special token of tokenizer.json"
    return None


def light_decoder(folder: str | Path) -> Decoder:
    """The ``tokenizers``-only decoder of a folder `light_reason` passes (module rules):
    ``decode(batch) == [tokenizer.decode(ids, skip_special_tokens=True) for ids in
    batch]``, one ``decode_batch`` call."""
    why = light_reason(folder)
    if why is not None:
        raise ValueError(f"{folder}: the tokenizers library alone would not decode as "
                         f"transformers does: {why}")
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))

    def light(batch: list[list[int]]) -> list[str]:
        return tk.decode_batch(batch, skip_special_tokens=True)

    return light


def full_decoder(tokenizer: Any) -> Decoder:
    """The decoder of a loaded transformers tokenizer (one ``batch_decode`` per batch)."""

    def full(batch: list[list[int]]) -> list[str]:
        if not batch:
            return []
        return [str(t) for t in tokenizer.batch_decode(batch, skip_special_tokens=True)]

    return full
