"""The archive's row: one scored group as a Parquet row, and back (docs/archive.md).

Invariants:

- ``scored_group(table_of([row_of(sg, ...)]).to_pylist()[0]) == sg`` field for field:
  every array keeps its dtype (token ids and versions int32, logprobs, rewards and
  advantages float32, mask uint8), floats are stored as they are (never through text),
  candidate sets, the sampler's top logprobs and per-token advantages survive, and the
  reward functions keep their order. So a replay trains on the very bytes the original
  trainer trained on.
- What a `scored` entry does not carry (docs/wire-format.md) is rebuilt, never guessed:
  the prompt dict is the task's row ``prompt_index`` (tasks are pure functions of the
  config, `workers.tasks.catalog`), and each completion's text is
  ``tokenizer.decode(ids, skip_special_tokens=True)``, the call the generator made for
  the rollout's ``text`` (`workers.episodes.Episode.to_rollout`). The archiver does both.
- A row names where it came from: the lane and entry id in `scored` (the archiver's
  de-duplication key after a crash) and the archiver that wrote it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from pipeline.bus.schema import PromptValue, ScoredGroup, TrainGroup, TrainRollout

_I32, _F32, _U8 = pa.int32(), pa.float32(), pa.uint8()

SCHEMA = pa.schema([
    ("gid", pa.string()),
    ("epoch", pa.int64()),
    ("prompt_index", pa.int64()),
    ("prompt", pa.string()),  # JSON of the prompt dict the reward functions got
    ("prompt_ids", pa.list_(_I32)),
    ("completions", pa.list_(pa.string())),  # decoded text of each completion
    ("completion_ids", pa.list_(pa.list_(_I32))),
    ("logprobs", pa.list_(pa.list_(_F32))),  # behaviour logprob of each token
    ("versions", pa.list_(pa.list_(_I32))),  # weight version that sampled each token
    ("mask", pa.list_(pa.list_(_U8))),
    ("clipped", pa.list_(pa.bool_())),
    ("candidate_ids", pa.list_(pa.list_(_I32))),  # null rows: no candidate sets recorded
    ("candidate_counts", pa.list_(pa.list_(_I32))),
    ("top_k", pa.int32()),  # null: no top logprobs (generation.num_sampler_logprobs = 0)
    ("top_ids", pa.list_(pa.list_(_I32))),  # per completion its [T, top_k], row-major
    ("top_logprobs", pa.list_(pa.list_(_F32))),
    ("rewards", pa.list_(_F32)),
    ("reward_parts", pa.list_(pa.struct([("name", pa.string()), ("values", pa.list_(_F32))]))),
    ("advantages", pa.list_(_F32)),
    ("token_advantages", pa.list_(pa.list_(_F32))),  # null: one advantage per completion
    ("scorer", pa.string()),
    ("min_version", pa.int32()),
    ("max_version", pa.int32()),
    ("t_scored", pa.float64()),
    ("t_handed_off", pa.float64()),  # the `scored` entry id's time (Redis clock)
    ("t_archived", pa.float64()),
    ("lane", pa.int32()),
    ("entry_id", pa.string()),
    ("archiver", pa.string()),
])
"""Column order and types of every ``groups/*.parquet`` file."""


def split_gid(gid: str) -> tuple[int, int]:
    """``"<epoch>:<prompt index>"`` -> (epoch, prompt index); (-1, -1) if not of that form."""
    epoch, sep, idx = gid.partition(":")
    try:
        return (int(epoch), int(idx)) if sep else (-1, -1)
    except ValueError:
        return -1, -1


def entry_time(entry_id: str) -> float:
    """A stream entry id's time in Unix seconds (its milliseconds part: the Redis clock at
    the append)."""
    return int(entry_id.split("-", 1)[0]) / 1000


@dataclass
class Item:
    """One group on its way into a file: what `table_of` turns into a row."""

    sg: ScoredGroup
    texts: list[str]  # each completion decoded
    prompt: dict[str, PromptValue] | None  # the task's prompt dict (None: unknown)
    lane: int
    entry_id: str
    archiver: str
    t_archived: float


def row_of(sg: ScoredGroup, *, texts: list[str], prompt: dict[str, PromptValue] | None,
           lane: int, entry_id: str, archiver: str, t_archived: float) -> Item:
    """The archive row of ``sg``, read from lane ``lane`` as ``entry_id`` (`table_of`
    builds the columns); ``texts`` are its completions decoded, ``prompt`` the task's
    prompt dict (None: unknown)."""
    return Item(sg, list(texts), prompt, lane, entry_id, archiver, t_archived)


def table_of(items: list[Item]) -> pa.Table:
    """Items as one Arrow table of `SCHEMA`, column by column from the arrays' buffers:
    no float goes through a Python float, no token id through a Python int."""
    gs = [i.sg for i in items]
    ros = [i.sg.group.rollouts for i in items]
    split = [split_gid(g.group.group_id) for g in gs]
    cand = [None if all(r.candidate_ids is None for r in x) else
            [r.candidate_ids for r in x] for x in ros]
    ncand = [None if c is None else [r.candidate_counts for r in x] for c, x in zip(cand, ros,
                                                                              strict=True)]
    tops = [None if any(r.top_ids is None for r in x) else x for x in ros]
    spans = [[int(f(r.versions)) for r in x if len(r.versions)] for x in ros
             for f in (np.min, np.max)]
    cols: dict[str, pa.Array] = {
        "gid": pa.array([g.group.group_id for g in gs], pa.string()),
        "epoch": pa.array([e for e, _ in split], pa.int64()),
        "prompt_index": pa.array([i for _, i in split], pa.int64()),
        "prompt": pa.array([None if i.prompt is None else json.dumps(i.prompt,
                                                                      ensure_ascii=False)
                            for i in items], pa.string()),
        "prompt_ids": _lists([g.group.prompt_ids for g in gs], np.int32),
        "completions": pa.array([i.texts for i in items], pa.list_(pa.string())),
        "completion_ids": _nested([[r.completion_ids for r in x] for x in ros], np.int32),
        "logprobs": _nested([[r.logprobs for r in x] for x in ros], np.float32),
        "versions": _nested([[r.versions for r in x] for x in ros], np.int32),
        "mask": _nested([[r.mask for r in x] for x in ros], np.uint8),
        "clipped": pa.array([[bool(r.clipped) for r in x] for x in ros], pa.list_(pa.bool_())),
        "candidate_ids": _nested(cand, np.int32),
        "candidate_counts": _nested(ncand, np.int32),
        "top_k": pa.array([None if t is None or not t else int(t[0].top_ids.shape[1])
                           for t in tops], pa.int32()),
        "top_ids": _nested([None if t is None else [r.top_ids.ravel() for r in t]
                            for t in tops], np.int32),
        "top_logprobs": _nested([None if t is None else [r.top_logprobs.ravel() for r in t]
                                 for t in tops], np.float32),
        "rewards": _lists([g.rewards for g in gs], np.float32),
        "reward_parts": pa.array([[{"name": k, "values": v.astype(np.float32)}
                                   for k, v in g.reward_parts.items()] for g in gs],
                                 SCHEMA.field("reward_parts").type),
        "advantages": _lists([g.advantages for g in gs], np.float32),
        "token_advantages": _nested([g.token_advantages for g in gs], np.float32),
        "scorer": pa.array([g.scorer for g in gs], pa.string()),
        "min_version": pa.array([min(s, default=0) for s in spans[0::2]], pa.int32()),
        "max_version": pa.array([max(s, default=0) for s in spans[1::2]], pa.int32()),
        "t_scored": pa.array([float(g.t_scored) for g in gs], pa.float64()),
        "t_handed_off": pa.array([entry_time(i.entry_id) for i in items], pa.float64()),
        "t_archived": pa.array([i.t_archived for i in items], pa.float64()),
        "lane": pa.array([i.lane for i in items], pa.int32()),
        "entry_id": pa.array([i.entry_id for i in items], pa.string()),
        "archiver": pa.array([i.archiver for i in items], pa.string()),
    }
    return pa.Table.from_arrays([cols[f.name] for f in SCHEMA], schema=SCHEMA)


def _offsets(lengths: list[int]) -> pa.Array:
    return pa.array(np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32))


def _lists(arrays: list[np.ndarray | None], dtype: type) -> pa.Array:
    """``list<dtype>``, one list per array (None: a null list)."""
    present = [a for a in arrays if a is not None]
    values = np.concatenate(present).astype(dtype, copy=False) if present else \
        np.zeros(0, dtype)
    mask = [a is None for a in arrays]
    return pa.ListArray.from_arrays(_offsets([0 if a is None else len(a) for a in arrays]),
                                    pa.array(values),
                                    mask=pa.array(mask) if any(mask) else None)


def _nested(groups: list[list[np.ndarray | None] | None], dtype: type) -> pa.Array:
    """``list<list<dtype>>``: per group (None: null) one list per completion (None:
    null)."""
    inner = [a for g in groups if g is not None for a in g]
    mask = [g is None for g in groups]
    return pa.ListArray.from_arrays(_offsets([0 if g is None else len(g) for g in groups]),
                                    _lists(inner, dtype),
                                    mask=pa.array(mask) if any(mask) else None)


def _arr(values: Any, dtype: type) -> np.ndarray:
    return np.asarray(values if values is not None else [], dtype=dtype)


def scored_group(row: dict[str, Any]) -> ScoredGroup:
    """The `ScoredGroup` a row was made of (the inverse of `row_of`)."""
    n = len(row["completion_ids"])
    cand, ncand = row.get("candidate_ids"), row.get("candidate_counts")
    k, top, toplp = row.get("top_k"), row.get("top_ids"), row.get("top_logprobs")
    ros = [TrainRollout(
        completion_ids=_arr(row["completion_ids"][i], np.int32),
        logprobs=_arr(row["logprobs"][i], np.float32),
        versions=_arr(row["versions"][i], np.int32),
        mask=_arr(row["mask"][i], np.uint8),
        clipped=bool(row["clipped"][i]),
        candidate_ids=None if cand is None or cand[i] is None else _arr(cand[i], np.int32),
        candidate_counts=None if ncand is None or ncand[i] is None
        else _arr(ncand[i], np.int32),
        top_ids=None if k is None else _arr(top[i], np.int32).reshape(-1, k),
        top_logprobs=None if k is None else _arr(toplp[i], np.float32).reshape(-1, k))
        for i in range(n)]
    tadv = row.get("token_advantages")
    return ScoredGroup(
        group=TrainGroup(row["gid"], _arr(row["prompt_ids"], np.int32), ros),
        rewards=_arr(row["rewards"], np.float32),
        reward_parts={p["name"]: _arr(p["values"], np.float32) for p in row["reward_parts"]},
        advantages=_arr(row["advantages"], np.float32), scorer=row["scorer"],
        t_scored=float(row["t_scored"]),
        token_advantages=None if tadv is None else [_arr(a, np.float32) for a in tadv])
