"""User data as tasks: JSONL files and Hugging Face datasets, mapped like TRL's.

A row becomes a prompt dict (see ``workers.tasks.catalog``):

- the prompt column (``task.prompt_column``, default ``prompt``) moves to ``text``: a
  string, or a conversation ``[{"role": ..., "content": ...}]`` (TRL's conversational
  format; rendered with the tokenizer's chat template, ``workers.tasks.prompts``);
- every other column travels under its own name, so a reward function gets it as a
  keyword argument exactly as in TRL (``solution=[...]``);
- the answer column (``task.answer_column``; empty = the column named ``answer`` if
  there is one) is also available as ``answer``, as a string (None where the row has
  none): sluice's built-in rewards and the evaluator read ``answer``.

A row carrying an image or a video (a non-empty ``image``/``images``/``video``/``videos``
column, TRL's names, or such a content part in a conversation) is refused: training is
text only (`workers.tasks.prompts.refuse_images`, docs/vlm.md).

Values must be able to travel on the wire (msgpack: strings, numbers, booleans, None,
lists and string-keyed maps of these). Anything else, an unknown column (the message
lists the available ones), a prompt of the wrong type, a column whose name a reward call
reserves, an unknown or empty split, or a hub id that cannot be loaded (offline) fails
when the task is built, naming the config key: at start, not in a running role.

Held-out prompts (the evaluator's), with the invariants of ``workers.tasks.catalog``:

- without ``task.eval_split``: rows split by a hash of the prompt (its canonical JSON for
  a conversation), so the split is stable when rows are appended or reordered and a
  prompt that occurs twice never lands on both sides; about ``heldout_fraction`` of them;
- with ``task.eval_split``: that split's rows in order, minus duplicates and minus any
  prompt that is also a training prompt (counted in ``dropped``).

``task.max_prompt_tokens``: `RecordsTask.limit_prompt_tokens` drops prompts whose
rendered length is above it from both sides, deterministically (the same tokenizer and
data give the same indices in every process), and counts them in ``dropped``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pipeline.bus.codec import check_prompt_value
from workers.tasks.prompts import IMAGE_COLUMNS, TEXT_ONLY, check_prompt

log = logging.getLogger("sluice.data")

Prompt = dict[str, Any]

RESERVED_COLUMNS = frozenset({"finish_reason", "prompts", "completions", "completion_ids",
                              "trainer_state", "log_extra", "log_metric", "environments"})
"""Names a reward call passes itself (TRL's keywords, plus sluice's ``finish_reason``)."""

def row_to_prompt(row: Mapping[str, Any], where: str, prompt_column: str = "prompt",
                  answer_column: str = "", conversational: bool = False) -> Prompt:
    """One row as a prompt dict (module docstring). ``conversational``: a string prompt
    becomes one user message, so rewards get prompts and completions as message lists
    (TRL's conversational format). ``ValueError`` naming the row."""
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected a JSON object (a row), got {type(row).__name__}")
    for key, column in (("task.prompt_column", prompt_column),
                        ("task.answer_column", answer_column)):
        if column and column not in row:
            raise ValueError(f"{where}: {key}: no column {column!r}; columns: {sorted(row)}")
    images = [c for c in IMAGE_COLUMNS if row.get(c) not in (None, [], "")]
    if images:
        raise ValueError(f"{where}: column {images[0]!r} holds an image or video: "
                         f"{TEXT_ONLY}; drop the column for text-only training")
    clashes = sorted(RESERVED_COLUMNS & set(row))
    if "text" in row and prompt_column != "text":
        clashes.append("text")
    if answer_column not in ("", "answer") and "answer" in row:
        clashes.append("answer")
    if clashes:
        raise ValueError(f"{where}: column(s) {clashes} clash with names sluice sets itself "
                         "(text = the prompt, answer = task.answer_column, and the keywords "
                         "of a reward call); rename or drop them")
    text = row[prompt_column]
    if conversational and isinstance(text, str):
        text = [{"role": "user", "content": text}]
    prompt: Prompt = {"text": check_prompt(text,
                                           f"{where}: task.prompt_column {prompt_column!r}")}
    for key, value in row.items():
        if key == prompt_column:
            continue
        if not isinstance(key, str):
            raise ValueError(f"{where}: column names must be strings, got {key!r}")
        check_prompt_value(value, f"{where}: column {key!r}")
        prompt[key] = list(value) if isinstance(value, tuple) else value
    answer_key = answer_column or "answer"
    if answer_key in row:
        answer = row[answer_key]
        if isinstance(answer, bool) or not isinstance(answer, str | int | float | type(None)):
            raise ValueError(f"{where}: the answer column {answer_key!r} must hold strings or "
                             f"numbers, got {type(answer).__name__}")
        prompt["answer"] = None if answer is None else str(answer)
    return prompt


def prompt_key(text: Any) -> str:
    """What identifies a prompt for splitting and de-duplication: the string itself, or a
    conversation's canonical JSON."""
    return text if isinstance(text, str) else json.dumps(text, sort_keys=True,
                                                          ensure_ascii=False)


def _is_heldout(key: str, fraction: float) -> bool:
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64 < fraction


class RecordsTask:
    """A task over validated prompt dicts (module docstring: the held-out rules).

    An empty training side is an error. ``dropped`` counts prompts left out, by reason.
    """

    def __init__(self, prompts: Iterable[Prompt], *, source: str, name: str = "records",
                 heldout_fraction: float = 0.05, heldout_prompts: Iterable[Prompt] | None = None,
                 default_rewards: list[str] | None = None) -> None:
        if not 0.0 <= heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
        self.name = name
        self.source = source
        self.default_rewards = list(default_rewards or ["workers.tasks.rewards:exact_match"])
        self.dropped: dict[str, int] = {}
        self._train: list[Prompt] = []
        held: list[Prompt] = []
        for p in prompts:
            split_off = heldout_prompts is None and _is_heldout(prompt_key(p["text"]),
                                                                heldout_fraction)
            (held if split_off else self._train).append(p)
        if not self._train:
            raise ValueError(f"{source}: no training prompts (empty, or all held out)")
        train_keys = {prompt_key(p["text"]) for p in self._train}
        self._heldout: list[Prompt] = []
        seen: set[str] = set()
        for p in held if heldout_prompts is None else heldout_prompts:
            key = prompt_key(p["text"])
            if key in seen or key in train_keys:
                reason = "heldout_duplicate" if key in seen else "heldout_in_train"
                self.dropped[reason] = self.dropped.get(reason, 0) + 1
                continue
            seen.add(key)
            self._heldout.append(p)

    def limit_prompt_tokens(self, count_tokens: Callable[[Any], int], max_tokens: int) -> None:
        """Drop prompts whose ``count_tokens(text)`` exceeds ``max_tokens`` (both sides),
        counting them in ``dropped``; an error if no training prompt is left."""
        n_train, n_held = len(self._train), len(self._heldout)
        self._train = [p for p in self._train if count_tokens(p["text"]) <= max_tokens]
        self._heldout = [p for p in self._heldout if count_tokens(p["text"]) <= max_tokens]
        self.dropped["too_long"] = n_train - len(self._train)
        self.dropped["heldout_too_long"] = n_held - len(self._heldout)
        if not self._train:
            raise ValueError(f"task.max_prompt_tokens: all {n_train} training prompts of "
                             f"{self.source} are longer than {max_tokens} tokens")

    def __len__(self) -> int:
        return len(self._train)

    def prompt(self, index: int) -> Prompt:
        index = operator.index(index)
        if not 0 <= index < len(self._train):
            raise IndexError(f"{self.source}: prompt index {index} not in [0, {len(self)})")
        return dict(self._train[index])

    def heldout(self, n: int) -> list[Prompt]:
        """The first ``n`` held-out prompts in data order (fewer if there are fewer)."""
        n = operator.index(n)
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return [dict(p) for p in self._heldout[:n]]


class JsonlTask(RecordsTask):
    """One JSON object per line; blank lines are skipped. Malformed lines and missing
    columns raise ``ValueError("<path>:<line>: ...")``."""

    def __init__(self, path: str | os.PathLike[str], prompt_column: str = "prompt",
                 answer_column: str = "", heldout_fraction: float = 0.05) -> None:
        path = os.fspath(path)
        prompts = []
        try:
            f = open(path, encoding="utf-8")  # closed by the with below
        except OSError as e:
            raise ValueError(f"task.path: cannot read {path}: {e.strerror or e}") from None
        with f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: invalid JSON: {e.msg}") from e
                prompts.append(row_to_prompt(record, where, prompt_column, answer_column))
        super().__init__(prompts, source=path, name="jsonl", heldout_fraction=heldout_fraction)


_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet",
                  ".arrow": "arrow", ".txt": "text"}


def _hub_offline() -> bool:
    import datasets

    return bool(getattr(datasets.config, "HF_HUB_OFFLINE", False))


def _load(dataset: str, key: str, *args: Any, **kwargs: Any) -> Any:
    """``datasets.load_dataset`` of local data, its errors naming the config key."""
    import datasets

    try:
        return datasets.load_dataset(*args, **kwargs)
    except StopIteration:  # the json builder on an empty file
        raise ValueError(f"{key}: {dataset} has no rows") from None
    except TypeError as e:  # an argument of task.dataset_args the builder does not take
        raise ValueError(f"task.dataset_args: {dataset}: {e}") from None
    except ValueError as e:
        if "corresponds to no data" in str(e):
            raise ValueError(f"{key}: split {kwargs.get('split')!r} of {dataset} is empty"
                             ) from None
        if "split" in str(e).lower():
            raise ValueError(f"{key}: {dataset}: {e}") from None
        raise ValueError(f"task.dataset: cannot load {dataset}: {e}") from None
    except Exception as e:  # malformed files raise the builders' own error types
        raise ValueError(f"task.dataset: cannot load {dataset}: {type(e).__name__}: {e}"
                         ) from None


def load_split(dataset: str, split: str, key: str = "task.split",
               args: Mapping[str, Any] | None = None) -> Any:
    """One split of a dataset as a ``datasets.Dataset``: a ``save_to_disk`` folder
    (``load_from_disk``; a single saved Dataset is split ``train``), a data file, a folder
    of data files, or a hub id (through the HF cache; slices such as ``train[:1000]`` work
    except for saved folders). ``args`` go to ``datasets.load_dataset`` (``task.
    dataset_args``: e.g. ``name`` = a configuration such as GSM8K's "main"). Errors name
    ``task.dataset`` or ``key``."""
    import datasets

    args = dict(args or {})
    for reserved in ("path", "split"):
        if reserved in args:
            raise ValueError(f"task.dataset_args: {reserved!r} is set by task.dataset / "
                             "task.split")

    path = os.path.expanduser(dataset)
    if os.path.isdir(path) and any(os.path.exists(os.path.join(path, f))
                                   for f in ("dataset_dict.json", "state.json")):
        try:
            saved = datasets.load_from_disk(path)
        except Exception as e:
            raise ValueError(f"task.dataset: cannot load the saved dataset {dataset}: "
                             f"{type(e).__name__}: {e}") from None
        if args:
            raise ValueError("task.dataset_args: a save_to_disk folder takes no arguments")
        splits = dict(saved) if isinstance(saved, Mapping) else {"train": saved}
        if split not in splits:
            raise ValueError(f"{key}: no split {split!r} in {dataset}; have {sorted(splits)}")
        return splits[split]
    if os.path.isfile(path):
        builder = _FILE_BUILDERS.get(os.path.splitext(path)[1].lower())
        if builder is None:
            raise ValueError(f"task.dataset: {dataset}: unsupported file type; use one of "
                             f"{sorted(_FILE_BUILDERS)}")
        return _load(dataset, key, builder, data_files=path, split=split, **args)
    if os.path.isdir(path):
        return _load(dataset, key, path, split=split, **args)
    if path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise ValueError(f"task.dataset: {dataset}: no such file or directory")
    try:
        return datasets.load_dataset(dataset, split=split, **args)
    except TypeError as e:  # an argument load_dataset or the builder does not take
        raise ValueError(f"task.dataset_args: {e}") from None
    except ValueError as e:
        if "split" in str(e).lower():
            raise ValueError(f"{key}: {dataset}: {e}") from None
        raise ValueError(f"task.dataset: cannot load {dataset!r}: {e}") from None
    except Exception as e:  # hub errors come in many types (connection, not found, auth)
        offline = (" (offline: HF_HUB_OFFLINE is set and there is no cached copy; load it "
                   "once online, or give a local path)" if _hub_offline() else "")
        raise ValueError(f"task.dataset: cannot load {dataset!r} from the hub{offline}: "
                         f"{type(e).__name__}: {e}") from None


def load_hf_task(dataset: str, split: str = "train", *, eval_split: str = "",
                 prompt_column: str = "prompt", answer_column: str = "",
                 heldout_fraction: float = 0.05, eval_dataset: str = "",
                 dataset_args: Mapping[str, Any] | None = None,
                 rename_columns: Mapping[str, str] | None = None,
                 conversational: bool = False) -> RecordsTask:
    """The ``hf`` task (module docstring). Held-out prompts: ``eval_split`` of
    ``eval_dataset`` (a file or dataset of their own, same columns; split "train" when
    ``eval_split`` is empty), else ``eval_split`` of ``dataset``, else a hash split of
    ``split``. ``dataset_args`` and ``rename_columns`` (old -> new name, before the column
    keys are looked up) apply to both datasets."""
    if eval_dataset and not eval_split:
        eval_split = "train"
    parts = {"task.split": split, **({"task.eval_split": eval_split} if eval_split else {})}
    rows: dict[str, list[Prompt]] = {}
    for key, name in parts.items():
        source = eval_dataset if key == "task.eval_split" and eval_dataset else dataset
        ds = load_split(source, name, key, dataset_args)
        if rename_columns:
            missing = sorted(set(rename_columns) - set(ds.column_names))
            if missing:
                raise ValueError(f"task.rename_columns: no column {missing} in {source}"
                                 f"[{name}]; columns: {list(ds.column_names)}")
            ds = ds.rename_columns(dict(rename_columns))
        columns = list(ds.column_names)
        for ckey, column in (("task.prompt_column", prompt_column),
                             ("task.answer_column", answer_column)):
            if column and column not in columns:
                raise ValueError(f"{ckey}: no column {column!r} in {source}[{name}]; "
                                 f"columns: {columns}")
        if len(ds) == 0:
            raise ValueError(f"{key}: split {name!r} of {source} is empty")
        rows[key] = [row_to_prompt(r, f"{source}[{name}] row {i}", prompt_column,
                                   answer_column, conversational)
                     for i, r in enumerate(ds.to_list())]
    task = RecordsTask(rows["task.split"], source=f"{dataset}[{split}]", name="hf",
                       heldout_fraction=heldout_fraction,
                       heldout_prompts=rows.get("task.eval_split"))
    if task.dropped:
        log.info("%s: left out %s", task.source, task.dropped)
    return task
