"""Publishing casts the live model to the serving dtype one tensor at a time: the `file`
transport moves each cast tensor to the CPU as it is made and drops it, so the GPU holds
one cast tensor beyond the live model, not a second copy of it (~15 GB at 7B in bf16).

On the CPU a float32 -> bf16 cast is the "GPU" copy: every tensor a cast makes is tracked
(weakly), and ``.to("cpu")`` of one returns a new tensor as a device transfer would, so
what stays alive is what a GPU would hold."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pipeline.weights.file import FileTransport
from pipeline.weights.shards import publishable, read_full

_TO = torch.Tensor.to


class CastCounter:
    """Patches ``Tensor.to``: counts the cast tensors alive at each new cast."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.cast: list[weakref.ref[torch.Tensor]] = []
        self.peak = 0
        counter = self

        def to(t: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            tracked = any(r() is t for r in counter.cast)
            out = _TO(t, *args, **kwargs)
            if tracked and out.device.type == "cpu":  # the device transfer: a new tensor
                return out.clone()
            if out.dtype == torch.bfloat16 and t.dtype != torch.bfloat16:
                counter.cast.append(weakref.ref(out))
                counter.peak = max(counter.peak, counter.alive())
            return out

        monkeypatch.setattr(torch.Tensor, "to", to)

    def alive(self) -> int:
        return sum(r() is not None for r in self.cast)


def _model() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    embed = torch.randn(32, 8)
    state = {f"layers.{i}.weight": torch.randn(8, 8) for i in range(6)}
    return {"embed.weight": embed, **state, "steps": torch.arange(3),
            "lm_head.weight": embed}  # tied: an alias, published as its own copy


def test_the_file_transport_holds_one_cast_tensor_at_a_time(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    source = _model()
    expected = publishable(source, torch.bfloat16)
    counter = CastCounter(monkeypatch)
    transport = FileTransport(tmp_path / "w", dtype=torch.bfloat16, max_shard_bytes=300)
    msg = transport.write(source, version=1, step=1)
    assert len(counter.cast) == 8  # every floating tensor was cast once
    assert counter.peak == 1
    monkeypatch.undo()
    got = read_full(transport.store.verify(msg))
    assert sorted(got) == sorted(expected)
    for k, t in expected.items():
        assert torch.equal(got[k], t) and got[k].dtype == t.dtype, k


def test_serving_items_yields_one_cast_tensor_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What a push to the engines should iterate (`FileTransport.serving_items`): a
    consumer that sends each tensor and drops it holds one cast tensor at a time."""
    counter = CastCounter(monkeypatch)
    items: Iterator[tuple[str, torch.Tensor]] = FileTransport(
        "unused", dtype=torch.bfloat16).serving_items(_model())
    names = []
    for name, t in items:
        names.append(name)
        assert counter.alive() == int(t.dtype == torch.bfloat16)
        del t
    assert counter.peak == 1 and names == list(_model())
    # all at once (`serving_state`) is what the transport used to write from
    monkeypatch.undo()
    counter = CastCounter(monkeypatch)
    state = publishable(_model(), torch.bfloat16)
    assert counter.peak == 8 and len(state) == 9


def test_tied_tensors_are_own_copies_in_the_stream_too() -> None:
    from pipeline.weights.shards import serving_items

    items = dict(serving_items(_model()))  # no cast: the alias must still be a copy
    assert items["lm_head.weight"].data_ptr() != items["embed.weight"].data_ptr()
    assert torch.equal(items["lm_head.weight"], items["embed.weight"])
