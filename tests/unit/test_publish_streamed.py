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


def test_an_nccl_push_casts_one_tensor_at_a_time_and_sends_what_it_announced(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """`NCCLTransport.publish`: the version is announced to the servers from shapes alone
    (`planned_update_info`), then each tensor is cast as the broadcast reaches it and
    dropped once sent (the broadcast here holds none beyond the one it sends)."""
    import asyncio

    from pipeline.weights.nccl import NCCLWeightSync
    from pipeline.weights.nccl_transport import NCCLTransport
    from tests.unit.test_vllm_nccl import Rendezvous, fake_servers

    source = _model()
    expected = publishable(source, torch.bfloat16)
    sent: list[tuple[str, torch.dtype, list[int]]] = []
    peaks: list[int] = []

    async def main() -> None:
        rdv = Rendezvous()

        def broadcast(items: Any) -> None:  # the fake collective: one tensor at a time
            rdv.trainer(None)
            for name, t in items:
                sent.append((name, t.dtype, list(t.shape)))
                peaks.append(counter.alive())
                del t

        async with fake_servers(1, rdv) as (urls, log):
            sync = NCCLWeightSync(urls, "127.0.0.1", 29500, workers_per_server=1,
                                  join=lambda rdv_: "group", broadcast=broadcast)
            sync.group = "group"
            t = NCCLTransport(sync, FileTransport(tmp_path / "w", dtype=torch.bfloat16))
            msg = await t.publish(source, version=1, step=1)
            await t.close()
        assert t.fallbacks == 0 and msg.version == 1
        info = next(b for _, p, _, b in log if p == "/update_weights")["update_info"]
        assert info["names"] == [n for n, _, _ in sent] == list(expected)
        assert info["dtype_names"] == [str(d).removeprefix("torch.") for _, d, _ in sent]
        assert [list(x.shape) for x in expected.values()] == info["shapes"]

    counter = CastCounter(monkeypatch)
    asyncio.run(main())
    assert max(peaks) == 1  # the push's casts, one alive at a time (the store's follow)


def test_a_tensor_that_differs_from_the_announcement_stops_the_push() -> None:
    from pipeline.weights.nccl_binding import as_announced, planned_update_info

    state = _model()
    info = planned_update_info(state, torch.bfloat16)
    items = list(publishable(state, torch.bfloat16).items())
    assert [n for n, _ in as_announced(iter(items), info)] == list(state)
    with pytest.raises(ValueError, match="announced as"):
        list(as_announced(iter([(n, t.float()) for n, t in items]), info))  # wrong dtype
    with pytest.raises(ValueError, match="9 announced"):
        list(as_announced(iter(items[:-1]), info))  # one short
