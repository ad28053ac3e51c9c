"""The pieces of the rollout loop (`workers.rollout_loop`, `pipeline.bus.loop_state`):
the per-row state a hook may read and write, its bounds, loading the class named in the
config, and ``compute_advantages``' result checked with its writes dropped on failure.
No Redis: tests/integration/test_rollout_loop.py runs the loop through the real roles."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np
import pytest

from pipeline.bus.loop_state import LOOP_VALUE_MAX_BYTES, decode_value, encode_value
from pipeline.config import ConfigError, load_config
from tests.helpers import make_group
from workers.group_scores import loop_advantages
from workers.rollout_loop import LoopGroup, RolloutLoop, RowState, load_loop

HERE = "tests.unit.test_rollout_loop"


class Counting(RolloutLoop):
    def setup(self) -> None:
        self.calls = 0

    def compute_advantages(self, group: LoopGroup) -> Any:
        self.calls += 1
        self.state[group.row_index] = {"calls": self.calls}
        return [0.5] * len(group.rewards) if group.epoch == 0 else [1.0]  # epoch 1: wrong


class SetupFails(RolloutLoop):
    def setup(self) -> None:
        raise RuntimeError("no data")


class AsyncFilter(RolloutLoop):
    async def filter_prompt(self, row_index: int, row: dict[str, Any],  # type: ignore[override]
                            epoch: int) -> bool:
        return False


class NotALoop:
    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        return True


def test_a_hook_reads_the_rows_it_was_given_and_nothing_stale() -> None:
    st = RowState()
    st.load({3: 0.5, 4: None})
    assert st[3] == 0.5 and st.get(4) is None and st.get(4, 1.0) == 1.0
    assert 3 in st and np.int64(3) in st and 4 not in st and "3" not in st
    assert list(st) == [3]
    with pytest.raises(KeyError, match="row 5 is not one this call was given"):
        st.get(5)
    st[5] = [1, 2]  # a write makes the row readable in the same call
    assert st[5] == [1, 2] and st.take_writes() == {5: "[1,2]"} and st.take_writes() == {}
    st.load({5: None})  # the next call: only its rows, no pending write
    with pytest.raises(KeyError):
        st[3]
    with pytest.raises(TypeError, match="row index"):
        st[True] = 1.0


def test_state_values_are_bounded_json_and_refused_naming_the_row() -> None:
    st = RowState()
    st.load({})
    for bad, why in [(float("nan"), "not JSON"), ({"x": math.inf}, "not JSON"),
                     (object(), "not JSON"), ("x" * LOOP_VALUE_MAX_BYTES, "more than")]:
        with pytest.raises(ValueError, match=f"state of row 7: .*{why}"):
            st[7] = bad
    assert st.take_writes() == {}
    assert decode_value(encode_value(1, {"rate": 0.25, "n": [1, 2]})) == {"rate": 0.25, "n": [1, 2]}
    assert decode_value(None) is None and decode_value(b"not json{") is None
    assert len(encode_value(1, "x" * (LOOP_VALUE_MAX_BYTES - 2))) == LOOP_VALUE_MAX_BYTES


def test_mark_and_restore_drop_a_failed_calls_writes() -> None:
    st = RowState()
    st.load({1: 0.0})
    st[1] = 0.5
    mark = st.mark()
    st[1] = 0.9
    st[2] = 0.1
    st.restore(mark)
    assert st[1] == 0.5 and st.take_writes() == {1: "0.5"}


def test_the_class_is_loaded_and_set_up_once_per_role_or_refused_naming_the_key() -> None:
    assert load_loop(load_config(None), "scorer") is None
    loop = load_loop(load_config(None, [f"generation.rollout_loop={HERE}:Counting"]),
                     "generator")
    assert isinstance(loop, Counting) and loop.role == "generator" and loop.calls == 0
    assert loop.num_generations == 8 and isinstance(loop.state, RowState)
    for path, msg in [(f"{HERE}:NotALoop", "not a subclass of workers.rollout_loop"),
                      (f"{HERE}:SetupFails", "could not be set up: RuntimeError"),
                      (f"{HERE}:AsyncFilter", "filter_prompt must be a plain function"),
                      (f"{HERE}:Nope", "has no attribute 'Nope'")]:
        cfg = load_config(None, [f"generation.rollout_loop={path}"])
        with pytest.raises(ConfigError, match=rf"^generation\.rollout_loop: .*{msg}"):
            load_loop(cfg, "scorer")


@pytest.mark.parametrize("hook", ["generation.filter_prompt", "scoring.advantages"])
def test_a_loop_and_the_hooks_it_replaces_are_refused_together(hook: str) -> None:
    with pytest.raises(ConfigError, match=r"generation\.rollout_loop: .*replace"):
        load_config(None, [f"generation.rollout_loop={HERE}:Counting", f"{hook}=a.b:c"])


def test_compute_advantages_gets_the_group_and_a_wrong_result_drops_its_writes() -> None:
    loop = load_loop(load_config(None, [f"generation.rollout_loop={HERE}:Counting"]), "scorer")
    assert loop is not None
    g = make_group("0:1")
    total = np.array([1.0, 0.0, 0.5, 0.5])
    adv = total - total.mean()
    loop.state.load({g.prompt_index: None})
    got, per_token = asyncio.run(loop_advantages(loop, g, total, {"f": total}, adv))
    assert per_token is None and np.allclose(got, 0.5)
    assert loop.state.take_writes() == {g.prompt_index: '{"calls":1}'}

    g1 = make_group("1:1")  # epoch 1: one advantage for four rollouts
    loop.state.load({g1.prompt_index: None})
    with pytest.raises(ValueError, match="compute_advantages must return 4 advantages"):
        asyncio.run(loop_advantages(loop, g1, total, {"f": total}, adv))
    assert loop.state.take_writes() == {}  # the failed call's write is gone
