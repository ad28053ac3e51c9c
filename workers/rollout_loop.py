"""A stateful rollout loop: TRL's ``AsyncRolloutLoop`` hooks as one class whose state
crosses sluice's processes (``generation.rollout_loop = "my_mod:MyLoop"``).

TRL's rollout loop is one process: a subclass's ``setup()``, ``filter_prompt(row_index,
row, epoch)`` and ``compute_advantages(group)`` share ``self``. In sluice the filter runs
in every generator and the advantages in every scorer, so a subclass of `RolloutLoop`
is instantiated once per process (each generator and each scorer; ``self.role`` says
which) and ``setup()`` is called there once. What the two hooks share goes through
``self.state``: a mapping from a dataset row index to a JSON value, stored in one hash
of the run (`pipeline.bus.loop_state`), that every process reads and writes:

- ``filter_prompt(row_index, row, epoch)`` runs in the generator before a group is
  generated; ``self.state`` holds, for reading, the stored values of the rows of the
  batch being filtered (fetched with one HMGET just before).
- ``compute_advantages(group)`` runs in the scorer once the group's rewards are in
  (`LoopGroup`); ``self.state`` holds the values of the rows of the scorer's read.
  Values set there are written to Redis (one HSET per read) before the read's groups
  are handed to the trainer, so a prompt's next admission sees them.

Reading a row the current call was not given raises ``KeyError`` (a value fetched for
an earlier call would be stale). Assigning replaces a row's value whole; a value must be
JSON of at most `pipeline.bus.loop_state.LOOP_VALUE_MAX_BYTES`. A group can be scored
twice (a scorer that died after writing and before handing off: its group is
redelivered), so write what the group determines (``state[i] = pass_rate``), not
increments (``state[i] += 1``) that a replay would count twice. Two scorers scoring the
same row at once: the last write wins. Plain attributes set in ``setup()`` stay per
process (a per-generator cache, a per-scorer counter).

The default hooks keep every prompt and return sluice's group-relative advantages
(``scoring.scale_rewards``), so a subclass overrides only what it needs. What a hook
raises is handled like the one-function hooks it replaces: a filter that raises keeps
its prompt (logged), ``compute_advantages`` that raises (or returns the wrong shape, or
state that is not JSON) dead-letters its group with the reason. A filter that rejects
every prompt of an epoch stops the run with that message (`workers.prompt_filter`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from pipeline.bus.loop_state import encode_value
from pipeline.config import Config, ConfigError
from pipeline.imports import load_callable

Role = Literal["generator", "scorer"]


class RowState:
    """``RolloutLoop.state``: the shared per-row values a hook call may read, and what it
    assigns (module docstring). The framework loads it (`load`) before a call and takes
    its writes (`take_writes`) after; a hook only reads and assigns."""

    def __init__(self) -> None:
        self._values: dict[int, Any] = {}
        self._writes: dict[int, str] = {}

    def load(self, values: dict[int, Any]) -> None:
        """The rows the next calls may read (and nothing else), pending writes dropped."""
        self._values = dict(values)
        self._writes = {}

    def take_writes(self) -> dict[int, str]:
        """The encoded values assigned since `load` or the last take, cleared."""
        out, self._writes = self._writes, {}
        return out

    def mark(self) -> tuple[dict[int, Any], dict[int, str]]:
        """A copy to `restore` if the next call fails (its writes are then dropped)."""
        return dict(self._values), dict(self._writes)

    def restore(self, mark: tuple[dict[int, Any], dict[int, str]]) -> None:
        self._values, self._writes = dict(mark[0]), dict(mark[1])

    def _row(self, row: int) -> int:
        if isinstance(row, bool) or not isinstance(row, int | np.integer):
            raise TypeError(f"rollout loop state is keyed by row index (int), not {row!r}")
        return int(row)

    def __getitem__(self, row: int) -> Any:
        row = self._row(row)
        if row not in self._values:
            raise KeyError(f"row {row} is not one this call was given: filter_prompt reads "
                           "the rows of its batch, compute_advantages those of its read")
        return self._values[row]

    def get(self, row: int, default: Any = None) -> Any:
        """The row's value; ``default`` when it has none yet (``KeyError`` for a row this
        call was not given)."""
        value = self[row]
        return default if value is None else value

    def __setitem__(self, row: int, value: Any) -> None:
        row = self._row(row)
        self._writes[row] = encode_value(row, value)  # refused here, naming the row
        self._values[row] = value

    def __contains__(self, row: object) -> bool:
        try:
            return self._values.get(self._row(row)) is not None  # type: ignore[arg-type]
        except TypeError:
            return False

    def __iter__(self) -> Iterator[int]:
        return iter(r for r, v in self._values.items() if v is not None)


@dataclass
class LoopGroup:
    """One scored group as ``compute_advantages`` sees it. ``advantages`` are sluice's
    group-relative ones (what the default hook returns; 0 everywhere for equal rewards);
    per rollout: ``rewards`` (the weighted total), ``reward_parts`` (each function's
    value, NaN where it gave None), ``completions`` (text), ``completion_ids`` and
    ``mask`` (1 at the policy's tokens)."""

    row_index: int
    epoch: int
    group_id: str
    row: dict[str, Any]
    rewards: np.ndarray
    reward_parts: dict[str, np.ndarray]
    completions: list[str]
    completion_ids: list[list[int]]
    mask: list[list[int]]
    advantages: np.ndarray


class RolloutLoop:
    """Subclass and name it in ``generation.rollout_loop``; override any of `setup`,
    `filter_prompt`, `compute_advantages` (module docstring). The constructor takes no
    arguments; the framework sets ``role``, ``state`` and ``num_generations`` before
    calling `setup`."""

    role: Role
    state: RowState
    num_generations: int

    def setup(self) -> None:
        """Called once per process, before any other hook."""

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        """Whether to generate dataset row ``row_index`` (its prompt dict ``row``) in
        ``epoch``; False retires its group `filtered` without generating it."""
        return True

    def compute_advantages(self, group: LoopGroup) -> Any:
        """One advantage per rollout, or per rollout a list with one per token."""
        return group.advantages


def load_loop(cfg: Config, role: Role) -> RolloutLoop | None:
    """The ``generation.rollout_loop`` instance of this process, set up (None when the
    key is empty); ``ConfigError`` naming the key when it does not import, is not a
    `RolloutLoop` subclass, or its constructor or ``setup()`` fails."""
    path = cfg.generation.rollout_loop
    if not path:
        return None
    key = "generation.rollout_loop"
    try:
        cls = load_callable(path, key)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not (inspect.isclass(cls) and issubclass(cls, RolloutLoop)):
        raise ConfigError(f"{key}: {path!r} is not a subclass of "
                          "workers.rollout_loop.RolloutLoop")
    if inspect.iscoroutinefunction(cls.filter_prompt):  # its bool would always be True
        raise ConfigError(f"{key}: {path}.filter_prompt must be a plain function, not "
                          "async (it reads only self.state, which is fetched for it)")
    try:
        loop = cls()
        loop.role, loop.state = role, RowState()
        loop.num_generations = cfg.generation.num_generations
        loop.setup()
    except Exception as e:
        raise ConfigError(f"{key}: {path} could not be set up: {e!r}") from e
    return loop
