"""A group's ``min_version`` (what the trainer's staleness test reads) from its tokens
only: a completion with no tokens was sampled by no version, so it neither ages its group
nor makes it look fresh (`pipeline.bus.schema`)."""

from __future__ import annotations

import numpy as np

from pipeline.bus.schema import TrainGroup, TrainRollout
from tests.helpers import make_group
from trainer.reader import is_stale


def _empty(r: TrainRollout) -> TrainRollout:
    return TrainRollout(r.completion_ids[:0], r.logprobs[:0], r.versions[:0], r.mask[:0],
                        clipped=True)


def test_an_empty_completion_does_not_make_its_group_stale() -> None:
    g = make_group("0:1", version=5).for_training()
    g.rollouts[2] = _empty(g.rollouts[2])
    assert g.rollouts[2].min_version is None
    assert g.min_version == 5
    assert not is_stale(6, g.min_version, max_staleness=1)
    rg = make_group("0:1", version=5)
    rg.rollouts[0].versions = rg.rollouts[0].versions[:0]
    assert rg.min_version == 5


def test_the_oldest_token_of_any_completion_dates_the_group() -> None:
    g = make_group("0:1", version=5).for_training()
    g.rollouts[1].versions = np.array([7, 3, 7, 7], dtype=np.int32)
    assert g.min_version == 3


def test_a_group_with_no_token_at_all_is_dated_zero() -> None:
    """Nothing to train and nothing to date it by: version 0, so it retires ``stale``
    once the trainer is past ``max_staleness`` rather than being trained on no tokens."""
    g = make_group("0:1", version=5).for_training()
    g = TrainGroup(g.group_id, g.prompt_ids, [_empty(r) for r in g.rollouts])
    assert g.min_version == 0
