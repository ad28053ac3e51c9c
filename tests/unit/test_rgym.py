"""reasoning-gym as a task (offline, procedural) and its verifier as a reward."""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError, load_config
from workers.tasks.catalog import task_from_config
from workers.tasks.rgym import reasoning_gym_score

pytest.importorskip("reasoning_gym")
ARGS = ["task.name=reasoning_gym", "task.dataset=spell_backward", "task.num_prompts=300",
        "task.dataset_args={min_word_len=3, max_word_len=5}"]


def test_task_is_deterministic_disjoint_and_its_heldout_grows_by_prefix() -> None:
    cfg = load_config(None, ARGS)
    a, b = task_from_config(cfg), task_from_config(cfg)
    assert len(a) == 300 and a.prompt(7) == b.prompt(7)
    p = a.prompt(0)
    assert p["text"].startswith("Spell this word backward") and 3 <= len(p["answer"]) <= 5
    assert p["answer"] == p["text"].rsplit(": ", 1)[1][::-1]
    held = a.heldout(40)
    assert held[:10] == b.heldout(10)
    train = {a.prompt(i)["text"] for i in range(len(a))}
    assert len({h["text"] for h in held}) == 40 and not train & {h["text"] for h in held}


def test_reward_is_the_datasets_own_verifier_called_by_keyword() -> None:
    p = task_from_config(load_config(None, ARGS)).prompt(3)
    answer = p["answer"]
    scores = reasoning_gym_score(completions=[answer, f" {answer}\n", "", answer[:-1] + "#"],
                                 rg_entry=[p["rg_entry"]] * 4, answer=[answer] * 4)
    assert scores[0] == scores[1] == 1.0 and scores[2] == 0.0
    assert 0.0 < scores[3] < 1.0  # spell_backward gives credit per character
    conv = reasoning_gym_score(completions=[[{"role": "assistant", "content": answer}]],
                               rg_entry=[p["rg_entry"]])
    assert conv == [1.0]


def test_bad_dataset_or_arguments_fail_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"task\.dataset: 'no_such' is not a reasoning-gym"):
        task_from_config(load_config(None, [*ARGS[:1], "task.dataset=no_such"]))
    with pytest.raises(ValueError, match=r"task\.dataset_args for 'spell_backward'"):
        task_from_config(load_config(None, [*ARGS[:3], "task.dataset_args={bogus=2}"]))
    with pytest.raises(ConfigError, match=r"task\.dataset: the reasoning_gym task needs"):
        load_config(None, ["task.name=reasoning_gym"])
