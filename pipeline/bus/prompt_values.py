"""What a group's ``prompt`` dict may hold on the wire, and the codec's error type.

Split from `pipeline.bus.codec` (which re-exports both names): the one rule for prompt
values, shared by the decoder and by `workers.tasks.data` (what a dataset row may carry).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


class DecodeError(ValueError):
    """A message failed validation; ``str(err)`` is the reason recorded in the dlq."""


_MAX_PROMPT_DEPTH = 16


def check_prompt_value(x: Any, where: str, depth: int = 0) -> None:
    """A prompt column that can travel on the wire: a scalar, None, or lists (tuples) and
    string-keyed maps of these, at most 16 levels deep; floats finite. The one rule for
    what a dataset row may carry (`workers.tasks.data`) and what a decoded message may hold.
    Raises `DecodeError` (a ValueError) naming ``where``."""
    if depth > _MAX_PROMPT_DEPTH:
        raise DecodeError(f"{where}: nested deeper than {_MAX_PROMPT_DEPTH} levels")
    if x is None or isinstance(x, str | int | bool):
        return
    if isinstance(x, float):
        if not math.isfinite(x):
            raise DecodeError(f"{where}: not finite ({x})")
        return
    if isinstance(x, list | tuple):
        for i, v in enumerate(x):
            check_prompt_value(v, f"{where}[{i}]", depth + 1)
        return
    if isinstance(x, Mapping):
        for k, v in x.items():
            if not isinstance(k, str):
                raise DecodeError(f"{where}: map keys must be str, got {type(k).__name__}")
            check_prompt_value(v, f"{where}.{k}", depth + 1)
        return
    raise DecodeError(f"{where}: {type(x).__name__} is not a prompt value (strings, numbers, "
                      "booleans, None, lists and maps only)")


def decode_prompt(v: Any, where: str) -> dict[str, Any]:
    """The prompt dict: string keys; ``text`` (if present) a string or a conversation
    (non-empty list of maps with a str ``role`` and a str-or-list ``content``); other
    values JSON-like (`check_prompt_value`)."""
    if not isinstance(v, dict):
        raise DecodeError(f"{where}.prompt: expected a map")
    for k, x in v.items():
        if not isinstance(k, str):
            raise DecodeError(f"{where}.prompt: keys must be str")
        check_prompt_value(x, f"{where}.prompt.{k}")
    text = v.get("text", "")
    if isinstance(text, list):
        if not text:
            raise DecodeError(f"{where}.prompt.text: empty conversation")
        for i, m in enumerate(text):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str | list)):
                raise DecodeError(f"{where}.prompt.text[{i}]: a message needs a str role and "
                                  "a str or list content")
    elif not isinstance(text, str):
        raise DecodeError(f"{where}.prompt.text: expected a string or a list of messages")
    return dict(v)
