"""Tasks: deterministic prompts, disjoint held-out sets, exactly-once epoch order."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgpack
import numpy as np
import pytest

from workers.tasks.catalog import (
    TASK_NAMES,
    AddTask,
    CompareTask,
    CopyTask,
    JsonlTask,
    ReverseTask,
    Task,
    epoch_order,
    make_task,
    prompt_for_cursor,
)


def _all_prompts(task: Task) -> list[dict]:
    return [task.prompt(i) for i in range(len(task))]


@pytest.mark.parametrize("cls", [CopyTask, ReverseTask, AddTask, CompareTask])
def test_prompts_are_deterministic_per_seed(cls: type) -> None:
    a, b, c = cls(num_prompts=300, seed=7), cls(num_prompts=300, seed=7), cls(300, seed=8)
    assert _all_prompts(a) == _all_prompts(b)
    assert _all_prompts(a) != _all_prompts(c)
    assert a.heldout(50) == b.heldout(50)
    assert isinstance(a, Task) and len(a) == 300


def test_copy_prompt_format() -> None:
    task = CopyTask(num_prompts=2000, seed=0, min_digits=4, max_digits=6)
    lengths = set()
    for p in _all_prompts(task):
        assert p["text"] == p["answer"] + "="
        assert p["answer"].isdigit() and p["task"] == "copy"
        lengths.add(len(p["answer"]))
    assert lengths == {4, 5, 6}


def test_reverse_and_add_answers() -> None:
    for p in _all_prompts(ReverseTask(num_prompts=200, seed=1)):
        assert p["text"].endswith(":") and p["answer"] == p["text"][:-1][::-1]
    for p in _all_prompts(AddTask(num_prompts=200, seed=1, min_digits=1, max_digits=3)):
        left, right = p["text"].removesuffix("=").split("+")
        assert p["answer"] == str(int(left) + int(right))
        assert all(len(s) <= 3 and (s == "0" or not s.startswith("0")) for s in (left, right))


def test_compare_questions_and_answers() -> None:
    words, positions = set(), set()
    pattern = re.compile(r"Which number is (larger|smaller), (\d+) or (\d+)\? "
                         r"Reply with the number only\.")
    for p in _all_prompts(CompareTask(num_prompts=2000, seed=1)):
        word, a, b = pattern.fullmatch(p["text"]).groups()  # type: ignore[union-attr]
        x, y = int(a), int(b)
        assert x != y and all(10 <= v <= 999 for v in (x, y))
        assert p["answer"] == str(max(x, y) if word == "larger" else min(x, y))
        words.add(word)
        positions.add(p["answer"] == a)  # the answer comes first and second in the text
    assert words == {"larger", "smaller"} and positions == {True, False}


def test_prompts_survive_msgpack() -> None:
    p = CopyTask(num_prompts=10).prompt(3)
    assert msgpack.unpackb(msgpack.packb(p)) == p


@pytest.mark.parametrize("cls", [CopyTask, ReverseTask, AddTask, CompareTask])
def test_heldout_disjoint_unique_and_prefix_stable(cls: type) -> None:
    task = cls(num_prompts=5000, seed=3)
    train = {p["text"] for p in _all_prompts(task)}
    held = task.heldout(500)
    texts = [p["text"] for p in held]
    assert len(held) == 500 and len(set(texts)) == 500
    assert not train & set(texts)
    assert cls(num_prompts=5000, seed=3).heldout(100) == held[:100]


def test_heldout_stops_when_space_is_exhausted() -> None:
    # 1-digit strings: 10 texts in all, most of them already in the training set.
    task = CopyTask(num_prompts=5, seed=0, min_digits=1, max_digits=1)
    train = {p["text"] for p in _all_prompts(task)}
    held = task.heldout(100)
    assert len(held) == 10 - len(train)
    assert {p["text"] for p in held} | train == {f"{d}=" for d in range(10)}


def test_prompt_index_out_of_range() -> None:
    task = CopyTask(num_prompts=10)
    with pytest.raises(IndexError):
        task.prompt(10)
    with pytest.raises(IndexError):
        task.prompt(-1)


def test_bad_task_arguments() -> None:
    with pytest.raises(ValueError, match="num_prompts"):
        CopyTask(num_prompts=0)
    with pytest.raises(ValueError, match="max_digits"):
        CopyTask(min_digits=5, max_digits=4)


def test_epoch_order_is_a_permutation_that_changes_per_epoch() -> None:
    orders = [epoch_order(100, seed=0, epoch=e) for e in range(3)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(100))
    assert not np.array_equal(orders[0], orders[1])
    assert not np.array_equal(orders[1], orders[2])
    assert np.array_equal(orders[0], epoch_order(100, seed=0, epoch=0))
    assert not np.array_equal(orders[0], epoch_order(100, seed=1, epoch=0))


def test_prompt_for_cursor_covers_every_index_once_per_epoch() -> None:
    n = 37
    seen: dict[int, list[int]] = {}
    for cursor in range(3 * n):
        epoch, index = prompt_for_cursor(cursor, n, seed=5)
        assert epoch == cursor // n
        assert index == int(epoch_order(n, 5, epoch)[cursor % n])
        seen.setdefault(epoch, []).append(index)
    assert sorted(seen) == [0, 1, 2]
    for indices in seen.values():
        assert sorted(indices) == list(range(n))
    with pytest.raises(ValueError, match="cursor"):
        prompt_for_cursor(-1, n, seed=5)


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_task_loads_splits_and_keeps_scalars(tmp_path: Path) -> None:
    rows = [{"prompt": f"q{i}", "answer": i, "level": "easy", "tags": ["x", None]}
            for i in range(400)]
    task = JsonlTask(_write_jsonl(tmp_path / "d.jsonl", rows), heldout_fraction=0.25)
    train, held = _all_prompts(task), task.heldout(1000)
    assert len(train) + len(held) == 400
    assert 40 < len(held) < 160  # hash split: 25% in expectation
    assert not {p["text"] for p in train} & {p["text"] for p in held}
    p = train[0]
    assert set(p) == {"text", "answer", "level", "tags"}  # lists travel too
    assert p["answer"] == p["text"][1:] and p["level"] == "easy" and p["tags"] == ["x", None]
    again = JsonlTask(tmp_path / "d.jsonl", heldout_fraction=0.25)
    assert _all_prompts(again) == train and again.heldout(1000) == held


def test_jsonl_custom_fields_and_blank_lines(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [{"q": "2+2", "a": "4"}, "", {"q": "1+1", "a": "2"}])
    task = JsonlTask(path, prompt_column="q", answer_column="a", heldout_fraction=0.0)
    # the answer column also travels under its own name (a reward may ask for `a`)
    assert _all_prompts(task) == [{"text": "2+2", "a": "4", "answer": "4"},
                                  {"text": "1+1", "a": "2", "answer": "2"}]
    assert task.heldout(5) == []


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "invalid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"answer": "1"}', r"task.prompt_column: no column 'prompt'; columns: \['answer'\]"),
        ('{"prompt": 3, "answer": "1"}', "'prompt': a prompt must be a string or a list"),
        ('{"prompt": [{"content": "x"}]}', r"'prompt'\[0\]: message has no string 'role'"),
        ('{"prompt": "x", "answer": [1]}', "'answer' must hold strings or numbers"),
        ('{"prompt": "x", "text": "y"}', r"\['text'\] clash with names sluice sets"),
        ('{"prompt": "x", "completions": 1}', r"\['completions'\] clash"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path: Path, bad: str, message: str) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "answer": "b"}, "", bad])
    with pytest.raises(ValueError, match=message) as info:
        JsonlTask(path)
    assert f"{path}:3:" in str(info.value)


def test_jsonl_empty_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no training prompts"):
        JsonlTask(tmp_path / "e.jsonl")


def test_make_task(tmp_path: Path) -> None:
    task = make_task("copy", seed=1, num_prompts=50)
    assert isinstance(task, CopyTask) and len(task) == 50
    assert task.default_rewards == ["workers.tasks.rewards:match_reward"]
    assert isinstance(make_task("Reverse", seed=1, num_prompts=5), ReverseTask)
    path = _write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "b"}])
    assert len(make_task("jsonl", seed=0, num_prompts=1, path=str(path))) == 1
    with pytest.raises(ValueError,
                       match="known tasks: copy, reverse, add, compare, guess, jsonl, hf, "
                             "reasoning_gym"):
        make_task("nope", seed=0, num_prompts=1)
    with pytest.raises(ValueError, match="needs data"):
        make_task("jsonl", seed=0, num_prompts=1)
    with pytest.raises(ValueError, match="takes no path"):
        make_task("copy", seed=0, num_prompts=1, path=str(path))
    assert TASK_NAMES == ("copy", "reverse", "add", "compare", "guess", "jsonl", "hf",
                          "reasoning_gym")
