"""Prompts as the model sees them and as reward functions see them.

A prompt (the ``text`` key of a task's prompt dict) is either a plain string or, as in
TRL's *conversational* format, a list of messages ``[{"role": ..., "content": ...}]``.

- ``render_prompt`` turns either into token ids. A string goes through the tokenizer's
  chat template as one user turn when the tokenizer has a template, else it is tokenized
  as is; a message list always goes through the template (no template: an error, since
  there is no faithful plain-text rendering of a conversation). ``system_prompt`` is
  added as a leading system message at render time only, so reward functions see the
  prompt exactly as it is in the data (a conversation that already opens with a system
  message keeps its own).
- A prompt with an image or video content part is refused (`refuse_images`): training
  is text only, vision-language models included (docs/vlm.md).
- ``completion_for`` gives reward functions a completion in the prompt's format, as
  TRL's GRPOTrainer does: the text for a string prompt, ``[{"role": "assistant",
  "content": text}]`` for a conversational one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Messages = list[dict[str, Any]]


def is_conversational(prompt: object) -> bool:
    """True for a message list (TRL's conversational format), False for a string."""
    return isinstance(prompt, list)


def check_messages(value: object, where: str) -> Messages:
    """``value`` if it is a non-empty list of ``{"role": str, "content": str | list}``
    maps, else ``ValueError`` naming ``where`` and the first bad message."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: expected a non-empty list of messages, got "
                         f"{type(value).__name__}")
    for i, m in enumerate(value):
        if not isinstance(m, Mapping):
            raise ValueError(f"{where}[{i}]: a message must be a map with role and content, "
                             f"got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"{where}[{i}]: message has no string 'role'")
        if not isinstance(m.get("content"), str | list):
            raise ValueError(f"{where}[{i}]: message has no 'content' (string or list of "
                             "parts)")
    return value


IMAGE_PARTS = frozenset({"image", "image_url", "input_image", "video", "video_url"})
"""Content-part types that carry an image or a video (TRL's ``{"type": "image"}``, the
OpenAI API's ``image_url`` / ``input_image``, and their video forms)."""
IMAGE_COLUMNS = ("image", "images", "video", "videos")
"""Dataset columns TRL's GRPOTrainer reads images from (``image``, ``images``), and videos."""
TEXT_ONLY = ("sluice trains vision-language models on text only: images are not "
             "supported yet (the packed trainer layouts have no 3D M-RoPE positions for "
             "image tokens; docs/vlm.md)")


def refuse_images(messages: Messages, where: str) -> None:
    """``ValueError`` naming ``where`` and the message when a content part is an image
    or a video (`IMAGE_PARTS`); text parts pass."""
    for i, m in enumerate(messages):
        content = m.get("content")
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind in IMAGE_PARTS:
                raise ValueError(f"{where}[{i}]: a {kind!r} content part: {TEXT_ONLY}")


def check_prompt(value: object, where: str) -> str | Messages:
    """A prompt value: a string, or a valid message list (`check_messages`)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        refuse_images(check_messages(value, where), where)
        return value
    raise ValueError(f"{where}: a prompt must be a string or a list of messages "
                     f"[{{'role': ..., 'content': ...}}], got {type(value).__name__}")


def messages_of(prompt: str | Messages, system_prompt: str = "") -> Messages:
    """The conversation a prompt stands for, with ``system_prompt`` in front unless the
    conversation already opens with a system message."""
    msgs: Messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                      else [dict(m) for m in prompt])
    if system_prompt and msgs[0].get("role") != "system":
        msgs.insert(0, {"role": "system", "content": system_prompt})
    return msgs


def render_prompt(tokenizer: Any, prompt: str | Messages, system_prompt: str = "") -> list[int]:
    """Token ids of a prompt (see the module docstring for the rules)."""
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(messages_of(prompt, system_prompt),
                                                 add_generation_prompt=True, tokenize=False)
        return list(tokenizer(rendered, add_special_tokens=False).input_ids)
    if not isinstance(prompt, str):
        raise ValueError("conversational prompts (message lists) need a tokenizer with a "
                         "chat template; this model's tokenizer has none")
    if system_prompt:
        raise ValueError("task.system_prompt needs a tokenizer with a chat template; this "
                         "model's tokenizer has none")
    return list(tokenizer(prompt, add_special_tokens=False).input_ids)


def completion_for(prompt: object, text: str) -> str | Messages:
    """A completion as TRL hands it to reward functions for this prompt's format."""
    return [{"role": "assistant", "content": text}] if is_conversational(prompt) else text


def completion_text(completion: str | Sequence[Mapping[str, Any]]) -> str:
    """The text of a completion in either format (the last message's content)."""
    if isinstance(completion, str):
        return completion
    content = completion[-1].get("content", "") if completion else ""
    return content if isinstance(content, str) else ""
