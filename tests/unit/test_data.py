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
from workers.tasks.catalog import task_from_config
from workers.tasks.data import load_hf_task
from workers.tasks.prompts import render_prompt

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


def test_an_eval_file_of_its_own_and_dataset_args(tmp_path: Path) -> None:
    train = _jsonl(tmp_path / "train.jsonl", _rows(40))
    held = _jsonl(tmp_path / "held.jsonl", _rows(60)[40:])  # 20 prompts never in training
    task = load_hf_task(train, eval_dataset=held, answer_column="solution")
    assert len(task) == 40  # no hash split: every training row trains
    assert [p["solution"] for p in task.heldout(100)] == [str(2 * i) for i in range(40, 60)]
    # dataset_args reach datasets.load_dataset; one it does not take names the key
    cfg = load_config(None, ["task.name=hf", f"task.dataset={train}",
                             "task.answer_column=solution", "task.dataset_args={nonsense=1}"])
    with pytest.raises(ValueError, match=r"task\.dataset_args"):
        task_from_config(cfg)
    cfg = load_config(None, ["task.name=hf", f"task.dataset={train}",
                             "task.dataset_args={split='x'}"])
    with pytest.raises(ValueError, match=r"task\.dataset_args: 'split' is set by"):
        task_from_config(cfg)


def test_gsm8k_shaped_rows_reach_trls_accuracy_reward_unchanged(tmp_path: Path) -> None:
    """The GPU recipe's data path on a local GSM8K-shaped file: `question`/`answer` columns,
    the answer renamed to TRL's `solution`, string prompts made conversational."""
    import asyncio

    import numpy as np

    from workers.tasks.rewards import load_reward, reward_matrix

    pytest.importorskip("math_verify")
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = <<{i}+{i}={2 * i}>>"
             f"{2 * i}.\n#### {2 * i}"} for i in range(1, 30)]
    cfg = load_config(None, ["task.name=hf", f"task.dataset={_jsonl(tmp_path / 'g.jsonl', rows)}",
                             "task.prompt_column=question", "task.answer_column=solution",
                             "task.rename_columns={answer='solution'}",
                             "task.conversational=true"])
    p = task_from_config(cfg).prompt(0)
    assert p["text"] == [{"role": "user", "content": p["text"][0]["content"]}]
    assert p["solution"].endswith("#### " + p["answer"].rsplit(" ", 1)[1])
    gold = p["solution"].rsplit(" ", 1)[1]
    acc = load_reward("trl.rewards:accuracy_reward")
    m = asyncio.run(reward_matrix([acc], [p, p], [f"so \\boxed{{{gold}}}", "\\boxed{-1}"],
                                  [[1], [1]], ["stop", "stop"], timeout_s=30))
    assert np.array_equal(m[:, 0], [1.0, 0.0])
    bad = load_config(None, ["task.name=hf", f"task.dataset={tmp_path / 'g.jsonl'}",
                             "task.prompt_column=question", "task.rename_columns={ans='x'}"])
    with pytest.raises(ValueError, match=r"task\.rename_columns: no column \['ans'\]"):
        task_from_config(bad)
