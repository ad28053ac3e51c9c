"""The TRL side of benchmarks/vs_trl_real.py sees the tokens sluice's generators see: TRL's
own prompt tokenization (``GRPOTrainer._tokenize_prompts``, the call its generation
makes) on CompareTask's prompts given as conversations equals sluice's `render_prompt`
of the same strings, token for token, on SmolLM2's real tokenizer and chat template
(which adds a system prompt of its own); and the check the benchmark runs before
training refuses TRL's rendering of plain string prompts, which skips the template."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

trl = pytest.importorskip("trl")

from benchmarks.trl_real import check_rendering  # noqa: E402
from workers.tasks.catalog import make_task  # noqa: E402


def _trl_like(tokenizer: object) -> SimpleNamespace:
    """What `GRPOTrainer._tokenize_prompts` reads of its trainer, for a text model
    without tools or environments (trl_real.py's trainer), with TRL's method bound."""
    ns = SimpleNamespace(processing_class=tokenizer, _is_vlm=False, environment_factories=None,
                         tools=None, chat_template=None, chat_template_kwargs={})
    ns._tokenize_prompts = lambda prompts: trl.GRPOTrainer._tokenize_prompts(ns, prompts)
    return ns


def test_trl_renders_compare_prompts_as_sluice_does(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    task = make_task("compare", seed=1, num_prompts=500)
    prompts = [task.prompt(i) for i in range(100)] + task.heldout(100)
    assert check_rendering(_trl_like(tok), tok, prompts, "") == \
        "200 prompts: identical token ids"
    assert check_rendering(_trl_like(tok), tok, prompts[:20], "Answer tersely.") == \
        "20 prompts: identical token ids"

    raw = SimpleNamespace(_tokenize_prompts=lambda convs: (
        tok(text=[c[-1]["content"] for c in convs])["input_ids"], None, {}))
    with pytest.raises(SystemExit, match="TRL renders"):  # string prompts: no template
        check_rendering(raw, tok, prompts[:5], "")
