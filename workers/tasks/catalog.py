"""Tasks: where prompts come from, and in which order the generators admit them.

A *prompt* is a plain dict that travels on the wire (msgpack) and reaches the reward
functions as keyword columns: ``{"text": str | messages, "answer": str, ...}``.
``text`` is what the model sees (a string, or a TRL-style conversation rendered with the
chat template: ``workers.tasks.prompts``); ``answer`` is the expected answer sluice's built-in
rewards compare to; other keys are dataset columns under their own names.

Built-in procedural tasks (no download, rewards are verifiable):

- ``copy``:    ``"48213="``  -> ``"48213"``
- ``reverse``: ``"48213:"``  -> ``"31284"``
- ``add``:     ``"123+45="`` -> ``"168"``
- ``compare``: ``"Which number is larger, 473 or 896? Reply with the number only."``
  -> ``"896"`` (or "smaller"): a question in words for a pretrained instruct model.

Invariants of every task:

- ``prompt(i)`` is a pure function of the constructor arguments (same seed, same prompt).
- ``heldout(n)`` is deterministic, ``heldout(n)`` is a prefix of ``heldout(m)`` for
  ``n <= m``, its prompts are distinct, and no held-out ``text`` is a training ``text``.
  It returns fewer than ``n`` prompts only when no more exist.

User data (``jsonl``, ``hf``: ``workers.tasks.data``) maps columns like TRL; it is split into
train/held-out by a hash of the prompt (stable when rows are appended or reordered; a
prompt that occurs twice never lands on both sides) or by ``task.eval_split``.
``task_from_config`` builds the configured task; given the tokenizer, it also drops
prompts over ``task.max_prompt_tokens`` (the same indices in every process).

Order: the admission gate hands out a global ``cursor``; ``prompt_for_cursor`` maps it to
``(epoch, prompt_index)`` through a fresh seeded permutation per epoch, so every prompt
is admitted exactly once per epoch and any process computes the same mapping.
"""

from __future__ import annotations

import functools
import logging
import operator
from typing import Any, Protocol, runtime_checkable

import numpy as np

from workers.tasks.data import JsonlTask, Prompt, RecordsTask, load_hf_task
from workers.tasks.prompts import render_prompt

log = logging.getLogger("sluice.tasks")
__all__ = ["JsonlTask", "Prompt", "RecordsTask", "Task", "load_hf_task", "make_task",
           "task_from_config"]

# Sub-streams of one seed: SeedSequence([seed, stream, ...]) keeps them independent.
_TRAIN_STREAM = 0
_HELDOUT_STREAM = 1
_ORDER_STREAM = 2
_HELDOUT_BATCH = 1024  # fixed, so heldout(n) is a prefix of heldout(m)
_HELDOUT_MAX_FRUITLESS = 64  # consecutive batches without a new prompt => space exhausted


@runtime_checkable
class Task(Protocol):
    """What generators, scorers and the evaluator need from a source of prompts."""

    name: str
    default_rewards: list[str]  # import paths, e.g. "workers.tasks.rewards:copy_reward"

    def __len__(self) -> int:
        """Number of training prompts (the epoch length)."""
        ...

    def prompt(self, index: int) -> Prompt:
        """Training prompt ``index`` in ``[0, len(self))``."""
        ...

    def heldout(self, n: int) -> list[Prompt]:
        """Up to ``n`` deterministic prompts disjoint from the training set."""
        ...


def _check_int(name: str, value: int, minimum: int) -> int:
    value = operator.index(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class _ProceduralTask:
    """Shared machinery: eager training set, lazily grown held-out set.

    Subclasses implement ``_generate(rng, n) -> list[(text, answer)]``. The training set
    may repeat a text (small spaces such as 4-digit strings); held-out prompts are unique
    and rejection-sampled from their own stream against every training text.
    """

    name = ""
    _DEFAULT_REWARDS: tuple[str, ...] = ("workers.tasks.rewards:match_reward",)

    def __init__(self, num_prompts: int, seed: int) -> None:
        self.num_prompts = _check_int("num_prompts", num_prompts, 1)
        self.seed = _check_int("seed", seed, 0)
        self.default_rewards = list(self._DEFAULT_REWARDS)
        train_rng = np.random.default_rng([self.seed, _TRAIN_STREAM])
        self._train = self._generate(train_rng, self.num_prompts)
        self._train_texts = frozenset(text for text, _ in self._train)
        self._heldout_rng = np.random.default_rng([self.seed, _HELDOUT_STREAM])
        self._heldout: list[tuple[str, str]] = []
        self._heldout_texts: set[str] = set()
        self._exhausted = False

    def _generate(self, rng: np.random.Generator, n: int) -> list[tuple[str, str]]:
        raise NotImplementedError

    def _make(self, text: str, answer: str) -> Prompt:
        return {"text": text, "answer": answer, "task": self.name}

    def __len__(self) -> int:
        return self.num_prompts

    def prompt(self, index: int) -> Prompt:
        index = operator.index(index)
        if not 0 <= index < self.num_prompts:
            raise IndexError(f"{self.name}: prompt index {index} not in [0, {self.num_prompts})")
        return self._make(*self._train[index])

    def heldout(self, n: int) -> list[Prompt]:
        n = _check_int("n", n, 0)
        fruitless = 0
        while len(self._heldout) < n and not self._exhausted:
            before = len(self._heldout)
            for text, answer in self._generate(self._heldout_rng, _HELDOUT_BATCH):
                if text not in self._train_texts and text not in self._heldout_texts:
                    self._heldout_texts.add(text)
                    self._heldout.append((text, answer))
            fruitless = fruitless + 1 if len(self._heldout) == before else 0
            self._exhausted = fruitless >= _HELDOUT_MAX_FRUITLESS
        return [self._make(text, answer) for text, answer in self._heldout[:n]]


class _DigitStringTask(_ProceduralTask):
    """k uniform random digits (leading zeros allowed), k uniform in [min, max]."""

    _marker = ""

    def __init__(
        self, num_prompts: int = 20000, seed: int = 0, min_digits: int = 4, max_digits: int = 6
    ) -> None:
        self.min_digits = _check_int("min_digits", min_digits, 1)
        self.max_digits = _check_int("max_digits", max_digits, self.min_digits)
        super().__init__(num_prompts, seed)

    def _answer(self, digits: str) -> str:
        raise NotImplementedError

    def _generate(self, rng: np.random.Generator, n: int) -> list[tuple[str, str]]:
        lengths = rng.integers(self.min_digits, self.max_digits + 1, size=n)
        digits = rng.integers(0, 10, size=(n, self.max_digits), dtype=np.uint8) + ord("0")
        out = []
        for row, k in zip(digits, lengths.tolist(), strict=True):
            s = row[:k].tobytes().decode("ascii")
            out.append((s + self._marker, self._answer(s)))
        return out


class CopyTask(_DigitStringTask):
    """``"48213="`` -> ``"48213"``: the easiest task, learnable by a tiny model."""

    name = "copy"
    _marker = "="

    def _answer(self, digits: str) -> str:
        return digits


class ReverseTask(_DigitStringTask):
    """``"48213:"`` -> ``"31284"``: copy with the digits reversed."""

    name = "reverse"
    _marker = ":"

    def _answer(self, digits: str) -> str:
        return digits[::-1]


class AddTask(_ProceduralTask):
    """``"123+45="`` -> ``"168"``: each operand has k digits (no leading zero),
    k uniform in [min, max] independently per operand."""

    name = "add"

    def __init__(
        self, num_prompts: int = 20000, seed: int = 0, min_digits: int = 1, max_digits: int = 3
    ) -> None:
        self.min_digits = _check_int("min_digits", min_digits, 1)
        self.max_digits = _check_int("max_digits", max_digits, self.min_digits)
        if self.max_digits > 18:
            raise ValueError(f"max_digits must be <= 18 (int64), got {self.max_digits}")
        super().__init__(num_prompts, seed)

    def _operands(self, rng: np.random.Generator, n: int) -> np.ndarray:
        k = rng.integers(self.min_digits, self.max_digits + 1, size=n)
        high = np.power(10, k, dtype=np.int64)
        low = np.where(k == 1, 0, high // 10)
        return rng.integers(low, high)

    def _generate(self, rng: np.random.Generator, n: int) -> list[tuple[str, str]]:
        a, b = self._operands(rng, n).tolist(), self._operands(rng, n).tolist()
        return [(f"{x}+{y}=", str(x + y)) for x, y in zip(a, b, strict=True)]


class CompareTask(_ProceduralTask):
    """``"Which number is larger, 473 or 896? Reply with the number only."`` -> ``"896"``,
    "larger" or "smaller" with equal probability, the two numbers distinct and uniform in
    [10, 999]: a task in words for a pretrained instruct model (the prompt is a user turn,
    rendered with the chat template). The answer is always one of the two numbers, so
    a model that names either one at random scores 0.5; a 135M instruct model starts
    below that because it explains instead of answering (docs/real-model.md)."""

    name = "compare"
    _DEFAULT_REWARDS = ("workers.tasks.rewards:first_number_reward",)
    LO, HI = 10, 999

    def _generate(self, rng: np.random.Generator, n: int) -> list[tuple[str, str]]:
        a = rng.integers(self.LO, self.HI + 1, size=n)
        b = rng.integers(self.LO, self.HI, size=n)
        b = b + (b >= a)  # uniform over [LO, HI] minus {a}
        larger = rng.integers(0, 2, size=n).astype(bool)
        out = []
        for x, y, big in zip(a.tolist(), b.tolist(), larger.tolist(), strict=True):
            word, answer = ("larger", max(x, y)) if big else ("smaller", min(x, y))
            out.append((f"Which number is {word}, {x} or {y}? Reply with the number only.",
                        str(answer)))
        return out


class GuessTask:
    """Games of guess-the-number (`workers.environments.builtin.GuessNumber`): the text
    ``"4821?"`` is only a game id, the number (``answer``, in [``lo``, ``hi``] = [0, 9]) is
    hidden, so the model can only find it from the environment's higher/lower answers.

    Game ids with ``id % 5 == 0`` are held out and the training prompts draw from the
    others, so no held-out text is a training text; ``heldout(n)`` is a fixed permutation's
    prefix (2,000 games at most), each game's number drawn from the held-out stream."""

    name = "guess"
    HI = 9

    def __init__(self, num_prompts: int = 20000, seed: int = 0) -> None:
        self.num_prompts = _check_int("num_prompts", num_prompts, 1)
        self.seed = _check_int("seed", seed, 0)
        self.default_rewards = ["workers.tasks.rewards:env_reward"]
        rng = np.random.default_rng([self.seed, _TRAIN_STREAM])
        games = rng.integers(0, 8000, size=self.num_prompts)
        games = games + games // 4 + 1  # skips every multiple of 5: 1-4, 6-9, ...
        self._train = list(zip(games.tolist(),
                               rng.integers(0, self.HI + 1, size=self.num_prompts).tolist(),
                               strict=True))
        hrng = np.random.default_rng([self.seed, _HELDOUT_STREAM])
        held = (hrng.permutation(2000) * 5).tolist()
        self._heldout = list(zip(held, hrng.integers(0, self.HI + 1, size=2000).tolist(),
                                 strict=True))

    def _make(self, game: int, secret: int) -> Prompt:
        return {"text": f"{game:04d}?", "answer": str(secret), "lo": 0, "hi": self.HI,
                "task": "guess"}

    def __len__(self) -> int:
        return self.num_prompts

    def prompt(self, index: int) -> Prompt:
        index = operator.index(index)
        if not 0 <= index < self.num_prompts:
            raise IndexError(f"guess: prompt index {index} not in [0, {self.num_prompts})")
        return self._make(*self._train[index])

    def heldout(self, n: int) -> list[Prompt]:
        return [self._make(*x) for x in self._heldout[:_check_int("n", n, 0)]]


_PROCEDURAL: dict[str, type[_ProceduralTask] | type[GuessTask]] = {
    "copy": CopyTask,
    "reverse": ReverseTask,
    "add": AddTask,
    "compare": CompareTask,
    "guess": GuessTask,
}
TASK_NAMES: tuple[str, ...] = (*_PROCEDURAL, "jsonl", "hf", "reasoning_gym")


def make_task(
    name: str,
    *,
    seed: int,
    num_prompts: int,
    path: str | None = None,
    split: str = "train",
    eval_split: str = "",
    prompt_column: str = "prompt",
    answer_column: str = "",
    dataset_args: dict[str, Any] | None = None,
    eval_dataset: str = "",
    rename_columns: dict[str, str] | None = None,
    conversational: bool = False,
) -> Task:
    """Build a task by name. ``num_prompts``/``seed`` shape procedural tasks only; data
    tasks (``jsonl``: a JSONL file; ``hf``: anything ``workers.tasks.data.load_split`` loads)
    need ``path`` and use every row of it."""
    key = name.strip().lower()
    if key in _PROCEDURAL:
        if path is not None:
            raise ValueError(f"task {name!r} is procedural and takes no path (got {path!r})")
        return _PROCEDURAL[key](num_prompts=num_prompts, seed=seed)
    if key in ("jsonl", "hf"):
        if not path:
            raise ValueError(f"task {name!r} needs data: task.dataset (or task.path for jsonl)")
        if key == "jsonl":
            return JsonlTask(path, prompt_column=prompt_column, answer_column=answer_column)
        return load_hf_task(path, split, eval_split=eval_split, prompt_column=prompt_column,
                            answer_column=answer_column, eval_dataset=eval_dataset,
                            dataset_args=dataset_args, rename_columns=rename_columns,
                            conversational=conversational)
    if key == "reasoning_gym":
        from workers.tasks.rgym import ReasoningGymTask

        if not path:
            raise ValueError("task.dataset: the reasoning_gym task needs a dataset name")
        return ReasoningGymTask(path, num_prompts=num_prompts, seed=seed,
                                dataset_args=dataset_args)
    raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASK_NAMES)}")


def task_from_config(cfg: Any, tokenizer: Any = None) -> Task:
    """The run's task (``cfg.task``). With ``tokenizer`` and ``task.max_prompt_tokens``
    set, prompts whose rendered length is above it are dropped from both sides and the
    count is logged; every role that needs indices (generators) passes the tokenizer, so
    all agree. Roles that only need a prompt to probe with (scorers) may pass None."""
    t = cfg.task
    task = make_task(t.name, seed=cfg.run.seed, num_prompts=t.num_prompts,
                     path=(t.dataset or t.path) or None, split=t.split,
                     eval_split=t.eval_split, prompt_column=t.prompt_column,
                     answer_column=t.answer_column, dataset_args=t.dataset_args,
                     eval_dataset=t.eval_dataset, rename_columns=t.rename_columns,
                     conversational=t.conversational)
    if tokenizer is not None:
        render_prompt(tokenizer, task.prompt(0)["text"], t.system_prompt)  # fails at start
        if t.max_prompt_tokens:
            if not isinstance(task, RecordsTask):
                raise ValueError("task.max_prompt_tokens: only data tasks (jsonl, hf) are "
                                 "filtered by length")
            task.limit_prompt_tokens(
                lambda text: len(render_prompt(tokenizer, text, t.system_prompt)),
                t.max_prompt_tokens)
            log.info("task %s: %d prompts over task.max_prompt_tokens=%d left out (%d "
                     "held-out); %d remain", task.name, task.dropped["too_long"],
                     t.max_prompt_tokens, task.dropped["heldout_too_long"], len(task))
    return task


def epoch_order(num_prompts: int, seed: int, epoch: int) -> np.ndarray:
    """The permutation of ``range(num_prompts)`` used in ``epoch``: a pure function of its
    arguments, independent across epochs."""
    num_prompts = _check_int("num_prompts", num_prompts, 1)
    rng = np.random.default_rng(
        [_check_int("seed", seed, 0), _ORDER_STREAM, _check_int("epoch", epoch, 0)]
    )
    return rng.permutation(num_prompts)


@functools.lru_cache(maxsize=2)  # current epoch and, around a boundary, the previous one
def _cached_order(num_prompts: int, seed: int, epoch: int) -> np.ndarray:
    order = epoch_order(num_prompts, seed, epoch)
    order.flags.writeable = False
    return order


def prompt_for_cursor(cursor: int, num_prompts: int, seed: int) -> tuple[int, int]:
    """Map the gate's global cursor to ``(epoch, prompt_index)``: cursors
    ``[e*n, (e+1)*n)`` visit every index exactly once, in ``epoch_order(n, seed, e)``."""
    cursor = _check_int("cursor", cursor, 0)
    num_prompts = _check_int("num_prompts", num_prompts, 1)
    epoch, offset = divmod(cursor, num_prompts)
    return epoch, int(_cached_order(num_prompts, operator.index(seed), epoch)[offset])
