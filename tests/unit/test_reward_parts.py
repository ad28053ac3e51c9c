"""The trainer's per-part reward means over a step whose groups carry different
``reward_parts`` keys (`trainer.stats.reward_part_means`): a part a group lacks is absent
from that group's share of the mean, never a crash after the step was published."""

from __future__ import annotations

import math

import numpy as np

from pipeline.bus.schema import ScoredGroup
from tests.helpers import make_group
from trainer.stats import reward_part_means


def _scored(gid: str, parts: dict[str, list[float]]) -> ScoredGroup:
    g = make_group(gid)
    return ScoredGroup(group=g.for_training(), rewards=np.zeros(4, np.float32),
                       reward_parts={k: np.array(v, np.float32) for k, v in parts.items()},
                       advantages=np.zeros(4, np.float32), scorer="t", t_scored=0.0)


def test_parts_are_the_union_and_each_mean_covers_only_the_groups_that_have_it() -> None:
    groups = [_scored("0:1", {"a": [1, 1, 1, 1]}),
              _scored("0:2", {"a": [0, 0, 0, 0], "b": [1, 0, 1, 0]}),
              _scored("0:3", {"c": [2, 2, math.nan, 2]})]
    out = reward_part_means(groups)
    means = {k: v for k, v in out.items() if k.count("/") == 1}
    assert means == {"reward/a": 0.5, "reward/b": 0.5, "reward/c": 2.0}
    assert list(means) == ["reward/a", "reward/b", "reward/c"]
    assert (out["reward/a/std"], out["reward/a/min"], out["reward/a/max"]) == (0.5, 0.0, 1.0)
    assert (out["reward/c/std"], out["reward/c/min"], out["reward/c/max"]) == (0.0, 2.0, 2.0)


def test_a_part_with_no_value_in_the_step_is_left_out() -> None:
    groups = [_scored("0:1", {"a": [1, 0, 1, 0], "none": [math.nan] * 4})]
    assert reward_part_means(groups) == {"reward/a": 0.5, "reward/a/std": 0.5,
                                         "reward/a/min": 0.0, "reward/a/max": 1.0}
    assert reward_part_means([]) == {}
    assert reward_part_means([_scored("0:1", {})]) == {}
