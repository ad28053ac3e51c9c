"""`sluice tail` lines: a `scored` entry carries no text (docs/wire-format.md), so its line shows
versions, lengths, the clipped count, rewards and advantages; `rollouts` shows the text."""

from __future__ import annotations

import numpy as np

from pipeline.bus.codec import decode, encode
from pipeline.bus.schema import ScoredGroup
from sluice.monitor import describe
from tests.helpers import make_group


def test_tail_describes_a_decoded_scored_entry_without_text() -> None:
    g = make_group("0:3", texts=("123", "12"), version=2)
    g.rollouts[1].finish_reason = "length"
    sg = ScoredGroup(group=g.for_training(), rewards=np.array([1.0, 0.5], np.float32),
                     reward_parts={}, advantages=np.array([0.7, -0.7], np.float32),
                     scorer="s", t_scored=0.0)
    line = describe("scored", decode(encode(sg)))
    assert "0:3" in line and "v2-2" in line and "len 3-4" in line and "clipped 1" in line
    assert "rewards [1.00 0.50]" in line and "adv [+0.70 -0.70]" in line
    assert "prompt" not in line and "texts" not in line
    rollout_line = describe("rollouts", decode(encode(g)))
    assert "prompt '123='" in rollout_line and "texts '123' '12'" in rollout_line
