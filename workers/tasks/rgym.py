"""reasoning-gym datasets as a sluice task, and their verifiers as a reward function.

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ generates its datasets
procedurally and offline (item ``i`` of a dataset with seed ``s`` is a pure function of
``s + i``) and ships a verifier per dataset (``score_answer(answer, entry) -> [0, 1]``,
some with partial credit). Config (``task.name = "reasoning_gym"``):

- ``task.dataset``: the reasoning-gym dataset name (``spell_backward``, ``chain_sum``, …);
- ``task.dataset_args``: its keyword arguments (``{min_word_len = 3, max_word_len = 5}``);
- ``task.num_prompts``: training items, generated with ``run.seed``.

Held-out prompts come from the same generator with another seed (``seed + 10**7``) and
skip every question text that is also a training question, so the held-out set never
overlaps training; ``heldout(n)`` is a prefix of ``heldout(m)`` for ``n <= m``.

Each prompt carries the entry as JSON in the ``rg_entry`` column (the question, answer and
metadata the verifier needs); the reward ``workers.tasks.rgym:reasoning_gym_score`` calls the
dataset's own verifier on each completion. ``reasoning-gym`` is imported lazily (the
``reasoning`` extra): a run that does not use it never needs it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

HELDOUT_SEED_OFFSET = 10**7
_HELDOUT_SCAN_FACTOR = 20  # held-out candidates scanned per prompt wanted before giving up


def _import_rg() -> Any:
    try:
        import reasoning_gym
    except ImportError as e:
        raise ValueError("task.name = reasoning_gym needs the reasoning-gym package: "
                         "pip install 'sluice[reasoning]'") from e
    return reasoning_gym


class ReasoningGymTask:
    """Training and held-out prompts of one reasoning-gym dataset (see module docstring)."""

    name = "reasoning_gym"

    def __init__(self, dataset: str, *, num_prompts: int, seed: int,
                 dataset_args: dict[str, Any] | None = None) -> None:
        rg = _import_rg()
        if dataset not in rg.factory.DATASETS:
            raise ValueError(f"task.dataset: {dataset!r} is not a reasoning-gym dataset; "
                             f"known: {', '.join(sorted(rg.factory.DATASETS))}")
        args = dict(dataset_args or {})
        try:
            self._train = rg.create_dataset(dataset, size=num_prompts, seed=seed, **args)
            self._held = rg.create_dataset(dataset, size=num_prompts * _HELDOUT_SCAN_FACTOR,
                                           seed=seed + HELDOUT_SEED_OFFSET, **args)
        except (TypeError, ValueError, AssertionError) as e:
            raise ValueError(f"task.dataset_args for {dataset!r}: {e}") from e
        self.dataset = dataset
        self.num_prompts = num_prompts
        self.default_rewards = ["workers.tasks.rgym:reasoning_gym_score"]
        self._train_texts: set[str] | None = None

    def __len__(self) -> int:
        return self.num_prompts

    def _prompt(self, entry: dict[str, Any]) -> dict[str, Any]:
        return {"text": str(entry["question"]), "answer": str(entry["answer"]),
                "task": self.name, "rg_dataset": self.dataset,
                "rg_entry": json.dumps(entry, default=str)}

    def prompt(self, index: int) -> dict[str, Any]:
        if not 0 <= index < self.num_prompts:
            raise IndexError(f"reasoning_gym: prompt index {index} not in "
                             f"[0, {self.num_prompts})")
        return self._prompt(self._train[index])

    def heldout(self, n: int) -> list[dict[str, Any]]:
        if self._train_texts is None:
            self._train_texts = {str(self._train[i]["question"])
                                 for i in range(self.num_prompts)}
        out: list[dict[str, Any]] = []
        seen: set[str] = set()
        for i in range(len(self._held)):
            if len(out) >= n:
                break
            entry = self._held[i]
            text = str(entry["question"])
            if text in self._train_texts or text in seen:
                continue
            seen.add(text)
            out.append(self._prompt(entry))
        return out


@functools.lru_cache(maxsize=64)
def _verifier(dataset: str) -> Callable[[str | None, dict[str, Any]], float]:
    return _import_rg().get_score_answer_fn(dataset)


def reasoning_gym_score(completions: list[Any], rg_entry: list[str], **kwargs: Any
                        ) -> list[float | None]:
    """reasoning-gym's own verifier of each completion's dataset, in [0, 1] (TRL keyword
    convention: ``rg_entry`` is the task's column). Conversational completions (message
    lists) are scored on their last message's content."""
    out: list[float | None] = []
    for completion, raw in zip(completions, rg_entry, strict=True):
        if raw is None:
            out.append(None)
            continue
        entry = json.loads(raw)
        if isinstance(completion, list):
            completion = completion[-1]["content"] if completion else ""
        answer = str(completion).strip()
        out.append(float(_verifier(entry["metadata"]["source_dataset"])(answer, entry)))
    return out
