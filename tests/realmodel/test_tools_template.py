"""SmolLM2-135M-Instruct and `environment.tools`: its chat template (plain ChatML with a
default system prompt) renders a ``tool`` message as a turn of its own but ignores
``tools=`` and an assistant's ``tool_calls``, so the model cannot be shown the tools and
its calls have no format: `check_template` refuses it at start with that reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.environments.tools import check_template

SCHEMA = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "description": "The first integer."},
        "b": {"type": "integer", "description": "The second integer."}},
        "required": ["a", "b"]}}}


def test_smollm2_template_has_no_tool_support(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    user = [{"role": "user", "content": "hi"}]
    with_tools = tok.apply_chat_template(user, tools=[SCHEMA], tokenize=False)
    assert with_tools == tok.apply_chat_template(user, tokenize=False)  # tools= ignored
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    text = tok.apply_chat_template(
        [*user, {"role": "assistant", "content": "", "tool_calls": [call]},
         {"role": "tool", "name": "add", "content": "3"}], tokenize=False)
    assert "<|im_start|>tool\n3<|im_end|>" in text  # a tool message renders
    assert "add" not in text  # the call does not
    with pytest.raises(ValueError, match="does not render tools"):
        check_template(tok, [SCHEMA])
