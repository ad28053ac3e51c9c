"""Tasks: where prompts come from, and in which order the generators admit them.

A *prompt* is a plain dict that travels on the wire (msgpack) and reaches the reward
functions unchanged: ``{"text": str, "answer": str, ...}``, values str/int/float only.
``text`` is what the model sees; ``answer`` is the reference the reward compares to.

Built-in procedural tasks (no download, rewards are verifiable):

- ``copy``:    ``"48213="``  -> ``"48213"``
- ``reverse``: ``"48213:"``  -> ``"31284"``
- ``add``:     ``"123+45="`` -> ``"168"``

Invariants of every task:

- ``prompt(i)`` is a pure function of the constructor arguments (same seed, same prompt).
- ``heldout(n)`` is deterministic, ``heldout(n)`` is a prefix of ``heldout(m)`` for
  ``n <= m``, its prompts are distinct, and no held-out ``text`` is a training ``text``.
  It returns fewer than ``n`` prompts only when no more exist.

User data: ``JsonlTask`` (a JSONL file) and ``load_hf_dataset`` (a *local* Hugging Face
dataset; nothing is ever downloaded). Both split rows into train/held-out by a hash of
the prompt text, so the split is stable when rows are appended or reordered and a text
that occurs twice never lands on both sides.

Order: the admission gate hands out a global ``cursor``; ``prompt_for_cursor`` maps it to
``(epoch, prompt_index)`` through a fresh seeded permutation per epoch, so every prompt
is admitted exactly once per epoch and any process computes the same mapping.
"""

from __future__ import annotations

import functools
import hashlib
import json
import operator
import os
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

Prompt = dict[str, str | int | float]

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
    default_rewards: list[str]  # import paths, e.g. "workers.rewards:copy_reward"

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
    _DEFAULT_REWARDS: tuple[str, ...] = ("workers.rewards:match_reward",)

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


def _record_to_prompt(record: Any, where: str, text_field: str, answer_field: str) -> Prompt:
    """Validate one user row. Keeps other str/int/float fields; drops the rest, and drops
    fields named ``text``/``answer`` that would collide with the canonical keys."""
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for field in (text_field, answer_field):
        if field not in record:
            raise ValueError(f"{where}: missing field {field!r}")
    text, answer = record[text_field], record[answer_field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field {text_field!r} must be a string")
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise ValueError(f"{where}: field {answer_field!r} must be a string or a number")
    prompt: Prompt = {"text": text, "answer": str(answer)}
    for key, value in record.items():
        if key in (text_field, answer_field, "text", "answer"):
            continue
        if isinstance(key, str) and isinstance(value, str | int | float):
            prompt[key] = value
    return prompt


def _is_heldout(text: str, fraction: float) -> bool:
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64 < fraction


class RecordsTask:
    """A task over already-validated user prompts, split by a hash of ``text``.

    The held-out share is ``heldout_fraction`` in expectation (not exactly): a tiny file
    may have no held-out prompt. An empty training side is an error.
    """

    def __init__(
        self,
        prompts: Iterable[Prompt],
        *,
        source: str,
        name: str = "records",
        heldout_fraction: float = 0.05,
        default_rewards: list[str] | None = None,
    ) -> None:
        if not 0.0 <= heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
        self.name = name
        self.source = source
        self.default_rewards = list(default_rewards or ["workers.rewards:exact_match"])
        self._train: list[Prompt] = []
        self._heldout: list[Prompt] = []
        for p in prompts:
            side = self._heldout if _is_heldout(str(p["text"]), heldout_fraction) else self._train
            side.append(p)
        if not self._train:
            raise ValueError(f"{source}: no training prompts (file empty or all held out)")

    def __len__(self) -> int:
        return len(self._train)

    def prompt(self, index: int) -> Prompt:
        index = operator.index(index)
        if not 0 <= index < len(self._train):
            raise IndexError(f"{self.source}: prompt index {index} not in [0, {len(self)})")
        return dict(self._train[index])

    def heldout(self, n: int) -> list[Prompt]:
        """The first ``n`` held-out rows in file order (fewer if the file has fewer)."""
        n = _check_int("n", n, 0)
        return [dict(p) for p in self._heldout[:n]]


class JsonlTask(RecordsTask):
    """One JSON object per line; blank lines are skipped. Malformed lines and missing
    fields raise ``ValueError("<path>:<line>: ...")``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        text_field: str = "prompt",
        answer_field: str = "answer",
        heldout_fraction: float = 0.05,
    ) -> None:
        path = os.fspath(path)
        prompts = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: invalid JSON: {e.msg}") from e
                prompts.append(_record_to_prompt(record, where, text_field, answer_field))
        super().__init__(prompts, source=path, name="jsonl", heldout_fraction=heldout_fraction)


_HF_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def load_hf_dataset(
    name_or_path: str | os.PathLike[str],
    split: str = "train",
    *,
    text_field: str = "prompt",
    answer_field: str = "answer",
    heldout_fraction: float = 0.05,
) -> RecordsTask:
    """A task from a LOCAL Hugging Face dataset; nothing is downloaded.

    ``name_or_path`` must exist on disk: a ``save_to_disk`` folder (``load_from_disk``),
    a data file (.jsonl/.json/.csv/.parquet) or a folder of data files (``load_dataset``).
    Hub names are refused. Needs the optional ``datasets`` package.
    """
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            "load_hf_dataset needs the optional 'datasets' package (pip install datasets); "
            "for JSONL files use JsonlTask, which has no extra dependency"
        ) from e
    path = os.fspath(name_or_path)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path}: no such local dataset; load_hf_dataset never downloads "
            "(save the dataset with Dataset.save_to_disk, or pass a local data file)"
        )
    saved = any(os.path.exists(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json"))
    if os.path.isdir(path) and saved:
        ds: Any = datasets.load_from_disk(path)
        if isinstance(ds, Mapping):
            if split not in ds:
                raise ValueError(f"{path}: no split {split!r}; have {sorted(ds)}")
            ds = ds[split]
    elif os.path.isfile(path):
        builder = _HF_FILE_BUILDERS.get(os.path.splitext(path)[1].lower())
        if builder is None:
            known = sorted(_HF_FILE_BUILDERS)
            raise ValueError(f"{path}: unsupported file type; use one of {known}")
        ds = datasets.load_dataset(builder, data_files=path, split=split)
    else:
        ds = datasets.load_dataset(path, split=split)
    source = f"{path}[{split}]"
    prompts = [
        _record_to_prompt(row, f"{source} row {i}", text_field, answer_field)
        for i, row in enumerate(ds)
    ]
    return RecordsTask(prompts, source=source, name="hf", heldout_fraction=heldout_fraction)


_PROCEDURAL: dict[str, type[_DigitStringTask] | type[AddTask]] = {
    "copy": CopyTask,
    "reverse": ReverseTask,
    "add": AddTask,
}
TASK_NAMES: tuple[str, ...] = (*_PROCEDURAL, "jsonl", "hf")


def make_task(
    name: str,
    *,
    seed: int,
    num_prompts: int,
    path: str | None = None,
    text_field: str = "prompt",
    answer_field: str = "answer",
) -> Task:
    """Build a task by name. ``num_prompts``/``seed`` shape procedural tasks only; data
    tasks (``jsonl``, ``hf``) need ``path`` and use every row of it."""
    key = name.strip().lower()
    if key in _PROCEDURAL:
        if path is not None:
            raise ValueError(f"task {name!r} is procedural and takes no path (got {path!r})")
        return _PROCEDURAL[key](num_prompts=num_prompts, seed=seed)
    if key in ("jsonl", "hf"):
        if not path:
            raise ValueError(f"task {name!r} needs a path to local data")
        if key == "jsonl":
            return JsonlTask(path, text_field=text_field, answer_field=answer_field)
        return load_hf_dataset(path, text_field=text_field, answer_field=answer_field)
    raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASK_NAMES)}")


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
