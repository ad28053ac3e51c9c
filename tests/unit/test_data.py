"""Data tasks through the real `datasets` package (offline, built locally): columns like
TRL's, conversational prompts, splits, the length filter, and errors naming the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pytest

from pipeline.config import load_config
from pipeline.model import load_tokenizer
from workers.data import load_hf_task
from workers.prompts import render_prompt
from workers.tasks import task_from_config

CHAT = ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}={% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")  # characters the tiny vocab has


def _conv(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"what is {i} + {i}?"}]


def _rows(n: int) -> list[dict[str, Any]]:
    return [{"prompt": _conv(i), "solution": str(2 * i), "level": i % 3} for i in range(n)]


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def chat_tokenizer(tiny_model_dir: Path) -> Any:
    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = CHAT
    return tok


def test_hf_task_from_a_data_file_keeps_columns_and_conversations(tmp_path: Path) -> None:
    task = load_hf_task(_jsonl(tmp_path / "d.jsonl", _rows(300)), answer_column="solution")
    train, held = [task.prompt(i) for i in range(len(task))], task.heldout(1000)
    assert len(train) + len(held) == 300 and 0 < len(held) < 50  # ~5% by hash
    p = train[0]
    assert set(p) == {"text", "solution", "answer", "level"}
    assert p["text"][0]["role"] == "user" and p["answer"] == p["solution"]
    keys = {json.dumps(x["text"]) for x in train}
    assert not keys & {json.dumps(x["text"]) for x in held}  # disjoint
    again = load_hf_task(str(tmp_path / "d.jsonl"), answer_column="solution")
    assert again.heldout(1000) == held and again.prompt(5) == task.prompt(5)  # stable


def test_saved_dataset_dict_with_an_eval_split(tmp_path: Path) -> None:
    rows = _rows(40)
    test_rows = [rows[0], _rows(50)[45], _rows(50)[45], _rows(50)[46]]  # 1 in train, 1 twice
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(test_rows)}
                         ).save_to_disk(str(tmp_path / "saved"))
    task = load_hf_task(str(tmp_path / "saved"), eval_split="test")
    assert len(task) == 40  # every train row trains when the held-out set is a split
    assert [p["text"] for p in task.heldout(10)] == [_conv(45), _conv(46)]
    assert task.dropped == {"heldout_in_train": 1, "heldout_duplicate": 1}
    with pytest.raises(ValueError, match=r"task.eval_split: no split 'dev'.*\['test', 'train'\]"):
        load_hf_task(str(tmp_path / "saved"), eval_split="dev")


def test_split_slices_and_unknown_splits(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", _rows(30))
    assert len(load_hf_task(path, "train[:10]").heldout(100)) + \
        len(load_hf_task(path, "train[:10]")) == 10
    with pytest.raises(ValueError, match=r"task.split: .*Unknown split \"test\""):
        load_hf_task(path, "test")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"prompt_column": "question"},
     r"task.prompt_column: no column 'question' in .*columns: \['prompt', 'solution', 'level'\]"),
    ({"answer_column": "answer"}, r"task.answer_column: no column 'answer'"),
    ({"prompt_column": "level"}, r"row 0: task.prompt_column 'level': a prompt must be a string"),
])
def test_bad_columns_fail_naming_the_key(tmp_path: Path, kwargs: dict[str, str],
                                         message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_hf_task(_jsonl(tmp_path / "d.jsonl", _rows(5)), **kwargs)


def test_empty_split_missing_path_and_offline_hub_id(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "header_only.csv").write_text("prompt,answer\n")
    with pytest.raises(ValueError, match=r"task.split: split 'train' of .* is empty"):
        load_hf_task(str(tmp_path / "header_only.csv"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"task.split: .*empty.jsonl has no rows"):
        load_hf_task(str(tmp_path / "empty.jsonl"))
    with pytest.raises(ValueError, match=r"task.dataset: ./nope: no such file"):
        load_hf_task("./nope")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=r"task.dataset: cannot load 'no-org/no-such-set' from "
                                         r"the hub \(offline: HF_HUB_OFFLINE"):
        load_hf_task("no-org/no-such-set")


def test_task_from_config_renders_conversations_and_drops_long_prompts(
        tmp_path: Path, tiny_model_dir: Path, chat_tokenizer: Any) -> None:
    rows = [{"prompt": [{"role": "user", "content": "x" * (5 + i)}], "answer": str(i)}
            for i in range(60)]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    cfg = load_config(None, ["task.name=hf", f"task.dataset={path}",
                             "task.max_prompt_tokens=40", "task.system_prompt=S"])
    task = task_from_config(cfg, chat_tokenizer)
    lengths = [len(render_prompt(chat_tokenizer, task.prompt(i)["text"], "S"))
               for i in range(len(task))]
    assert lengths and max(lengths) <= 40
    assert len(task) + len(task.heldout(100)) + task.dropped["too_long"] + \
        task.dropped["heldout_too_long"] == 60 and task.dropped["too_long"] > 0
    again = task_from_config(cfg, chat_tokenizer)
    assert [again.prompt(i) for i in range(len(again))] == \
        [task.prompt(i) for i in range(len(task))]  # every role agrees on the indices
    text = chat_tokenizer.decode(render_prompt(chat_tokenizer, task.prompt(0)["text"], "S"))
    assert text.startswith("system:S=user:xxxxx") and text.endswith("=assistant:")
    # no chat template: a conversation cannot be rendered, found when the task is built
    with pytest.raises(ValueError, match="need a tokenizer with a chat template"):
        task_from_config(cfg, load_tokenizer(tiny_model_dir))
    too_short = load_config(None, ["task.name=hf", f"task.dataset={path}",
                                   "task.max_prompt_tokens=2"])
    with pytest.raises(ValueError, match=r"task.max_prompt_tokens: all .* longer than 2"):
        task_from_config(too_short, chat_tokenizer)
