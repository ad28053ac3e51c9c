"""The archiver's decoder gives the generator's text exactly, with or without
transformers (`pipeline.textdecode`)."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.model import load_tokenizer
from pipeline.textdecode import light_decoder, light_reason
from workers.archiver import decoder_and_task
from workers.tasks.catalog import task_from_config

ROOT = Path(__file__).parents[2]


def archiver_decoder(folder: Path, *sets: str) -> tuple[object, str]:
    """The archiver's decoder of a run on the model at ``folder`` and its kind."""
    cfg = load_config(ROOT / "examples" / "copy.toml", [f"model.path={folder}", *sets])
    decode, _, kind = decoder_and_task(cfg)
    return decode, kind


def test_the_tiny_tokenizer_decodes_light_and_identically(tiny_model_dir: Path) -> None:
    decode, kind = archiver_decoder(tiny_model_dir)
    assert kind == "light"
    assert light_reason(tiny_model_dir) is None
    tok = load_tokenizer(tiny_model_dir)
    rng = random.Random(0)
    n = len(tok)
    batch = [[i] for i in range(n)]  # every id alone, the special ones included
    batch += [[rng.randrange(n) for _ in range(rng.randrange(0, 40))] for _ in range(300)]
    assert decode(batch) == [tok.decode(ids, skip_special_tokens=True) for ids in batch]
    assert decode([]) == []
    # the special tokens really are dropped (the comparison above is not vacuous)
    assert decode([[tok.eos_token_id, tok.convert_tokens_to_ids("a")]]) == ["a"]


def _edited(src: Path, dst: Path, **config: object) -> Path:
    shutil.copytree(src, dst)
    p = dst / "tokenizer_config.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), **config}))
    return dst


@pytest.mark.parametrize(("edit", "why"), [
    ({"tokenizer_class": "Qwen2Tokenizer"}, "not generic"),
    ({"clean_up_tokenization_spaces": True}, "clean_up_tokenization_spaces"),
    ({"additional_special_tokens": ["7"]}, "additional_special_tokens"),
    ({"eos_token": "7"}, "eos_token '7' is not a special token"),
])
def test_a_tokenizer_transformers_would_change_decodes_through_transformers(
        tiny_model_dir: Path, tmp_path: Path, edit: dict[str, object], why: str) -> None:
    folder = _edited(tiny_model_dir, tmp_path / "m", **edit)
    reason = light_reason(folder)
    assert reason is not None and why in reason
    with pytest.raises(ValueError, match="would not decode as transformers does"):
        light_decoder(folder)
    decode, kind = archiver_decoder(folder)
    assert kind == f"full: {reason}"
    tok = load_tokenizer(folder)
    ids = [[tok.convert_tokens_to_ids(c) for c in "7 + 7"], [1, 2, 3]]
    assert decode(ids) == tok.batch_decode(ids, skip_special_tokens=True)


def test_a_task_filtered_by_prompt_length_makes_the_archiver_load_the_tokenizer(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """The prompt indices depend on the rendered lengths: the archiver's task must drop
    what the generators' drops, so it is built with the tokenizer."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": "x" * (2 + i % 9), "answer": "1"}) + "\n"
                            for i in range(40)))
    sets = ("task.name=hf", f"task.dataset={data}", "task.max_prompt_tokens=6")
    cfg = load_config(ROOT / "examples" / "copy.toml", [f"model.path={tiny_model_dir}", *sets])
    _, task, kind = decoder_and_task(cfg)
    assert kind == "full: task.max_prompt_tokens"
    generators = task_from_config(cfg, load_tokenizer(tiny_model_dir))
    assert 0 < len(task) == len(generators) < 40
    assert [task.prompt(i) for i in range(len(task))] == \
        [generators.prompt(i) for i in range(len(task))]


def test_the_archiver_role_imports_neither_torch_nor_transformers() -> None:
    code = ("import sys, workers.archiver, sluice.cli; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parents[2])
    assert out.stdout.strip() == "[]"
