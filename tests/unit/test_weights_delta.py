"""Delta versions (pipeline/weights/delta.py) through the directory store.

What a delta must guarantee: applying it to its base reproduces the published state bit
for bit; a full version every K; the chain from the newest full version is never pruned;
a receiver rebuilds from the version it holds, replays the chain from the full version
when it holds another one (or a wrong one: detected by the state hash), and refuses
(`WeightError`) what it cannot rebuild; a delta announcement keeps the wire compatible.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path

import msgpack
import pytest
import torch

from pipeline.bus.codec import DecodeError, decode, encode
from pipeline.bus.schema import WeightsPublished
from pipeline.config import ConfigError, load_config
from pipeline.weights import FileTransport, WeightError, engine_format, make_transport, read_full
from pipeline.weights.delta import apply_delta, diff, state_sha256

torch.set_num_threads(1)


def _master(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(300, 64, generator=g) * 0.02,
            "norm": torch.ones(64), "ids": torch.arange(6)}


def _step(state: dict[str, torch.Tensor], lr: float, seed: int) -> None:
    """An Adam-like update: every float element moves by about ``lr``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in state.values():
            if t.is_floating_point():
                t.add_(lr * torch.sign(torch.randn(t.shape, generator=g)))


def _served(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: t.to(torch.bfloat16) if t.is_floating_point() else t for k, t in state.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def _receiver(root: Path, cache: Path) -> FileTransport:
    return FileTransport(root, cache_dir=cache)


def _get(t: FileTransport, msg: WeightsPublished) -> dict[str, torch.Tensor]:
    return read_full(asyncio.run(t.receive(msg)))


def test_a_delta_applied_to_its_base_is_the_new_state_bit_for_bit() -> None:
    prev = _served(_master())
    new = {k: v.clone() for k, v in prev.items()}
    new["emb"][3, 5] = -new["emb"][3, 5]
    new["emb"][7, 0] = float("nan")
    new["norm"][0] = -0.0 if new["norm"][0] == 0 else 0.0
    payload, changed = diff(prev, new)
    assert changed == 3 and set(payload) == {"idx/emb", "val/emb", "idx/norm", "val/norm"}
    assert payload["idx/emb"].dtype == torch.int32
    rebuilt = {k: v.clone() for k, v in prev.items()}
    apply_delta(rebuilt, payload)
    assert state_sha256(rebuilt) == state_sha256(new) != state_sha256(prev)
    dense = {k: v + 1 if v.is_floating_point() else v for k, v in prev.items()}
    payload, _ = diff(prev, dense)  # everything changed: whole tensors are smaller
    assert set(payload) == {"all/emb", "all/norm"}


def test_state_hash_covers_names_dtypes_shapes_and_bytes() -> None:
    s = _served(_master())
    h = state_sha256(s)
    assert state_sha256(dict(reversed(list(s.items())))) == h  # order-free
    assert state_sha256({**s, "emb2": s.pop("emb")}) != h
    s = _served(_master())
    assert state_sha256({**s, "norm": s["norm"].float()}) != h
    assert state_sha256({**s, "emb": s["emb"].reshape(600, 32)}) != h


def test_payloads_that_do_not_fit_the_base_are_refused() -> None:
    base = _served(_master())
    bad = [{"idx/nope": torch.tensor([0], dtype=torch.int32), "val/nope": torch.zeros(1)},
           {"idx/emb": torch.tensor([300 * 64], dtype=torch.int32),
            "val/emb": torch.zeros(1, dtype=torch.bfloat16)},
           {"idx/emb": torch.tensor([0], dtype=torch.int32)},
           {"val/emb": torch.zeros(1, dtype=torch.float32),
            "idx/emb": torch.tensor([0], dtype=torch.int32)},
           {"all/norm": torch.zeros(65, dtype=torch.bfloat16)},
           {"odd/emb": torch.zeros(1)}]
    for payload in bad:
        with pytest.raises(WeightError):
            apply_delta({k: v.clone() for k, v in base.items()}, payload)


def test_full_every_k_deltas_between_and_receivers_rebuild_every_version(
        tmp_path: Path) -> None:
    """lr 3e-6 on bf16: a few percent of elements change per step. Versions 1..7 with
    K = 3 go full, delta, delta, full, …; a receiver that takes every version, one that
    skips versions and one that starts late all serve exactly the published bf16."""
    master = _master()
    pub = FileTransport(tmp_path / "w", dtype=torch.bfloat16, full_every=3, keep=10)
    every = _receiver(tmp_path / "w", tmp_path / "c1")
    skipping = _receiver(tmp_path / "w", tmp_path / "c2")
    msgs = []
    for v in range(1, 8):
        _step(master, 3e-6, v)
        msg = pub.write(master, version=v, step=v)
        msgs.append(msg)
        assert _same(_get(every, msg), _served(master))
        if v in (1, 3, 6):
            assert _same(_get(skipping, msg), _served(master))
        assert msg.state == state_sha256(_served(master))
        assert pub.stats["publish_delta"] == float(msg.format == "delta")
    assert [m.format for m in msgs] == ["safetensors", "delta", "delta"] * 2 + ["safetensors"]
    assert [m.base for m in msgs] == [-1, 1, 2, -1, 4, 5, -1]
    assert all(m.nbytes < 0.5 * msgs[0].nbytes for m in msgs if m.format == "delta")
    late = _receiver(tmp_path / "w", tmp_path / "c3")
    _step(master, 3e-6, 8)
    v8 = pub.write(master, version=8, step=8)
    assert v8.format == "delta" and _same(_get(late, v8), _served(master))
    assert engine_format(v8) == "safetensors" and engine_format(msgs[0]) == "safetensors"


def test_a_wrong_base_is_detected_by_the_state_hash_and_rebuilt_from_the_full_version(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    master = _master()
    pub = FileTransport(tmp_path / "w", dtype=torch.bfloat16, full_every=4)
    rec = _receiver(tmp_path / "w", tmp_path / "c")
    v1 = pub.write(master, version=1, step=1)
    _get(rec, v1)
    # the receiver believes it holds v1, but its directory holds other weights
    other = FileTransport(tmp_path / "other").write(_served(_master(seed=9)), version=1, step=1)
    rec.rebuilder.held = (v1, FileTransport(tmp_path / "other").store.dir_for(1))
    assert other.sha256 != v1.sha256
    _step(master, 3e-6, 2)
    v2 = pub.write(master, version=2, step=2)
    with caplog.at_level(logging.WARNING, logger="sluice.weights"):
        assert _same(_get(rec, v2), _served(master))
    assert "falling back to the full version" in caplog.text


def test_what_cannot_be_rebuilt_is_refused(tmp_path: Path) -> None:
    master = _master()
    pub = FileTransport(tmp_path / "w", dtype=torch.bfloat16, full_every=4)
    v1 = pub.write(master, version=1, step=1)
    _step(master, 3e-6, 2)
    v2 = pub.write(master, version=2, step=2)
    wrong_state = dataclasses.replace(v2, state="0" * 64)
    with pytest.raises(WeightError, match=r"is for base v1, the announcement for v1 \(or another"):
        _get(_receiver(tmp_path / "w", tmp_path / "c1"), wrong_state)
    # the chain's full version is gone: a receiver that does not hold v1 cannot rebuild
    import shutil

    shutil.rmtree(pub.store.dir_for(1))
    with pytest.raises(WeightError, match="cannot rebuild"):
        _get(_receiver(tmp_path / "w", tmp_path / "c2"), v2)
    assert v1.format == "safetensors"


def test_retention_keeps_the_chain_from_the_newest_full_version(tmp_path: Path) -> None:
    master = _master()
    pub = FileTransport(tmp_path / "w", dtype=torch.bfloat16, full_every=4, keep=1)
    for v in range(1, 8):
        _step(master, 3e-6, v)
        pub.write(master, version=v, step=v)
    # full at 1 and 5; at 7 the window (keep 1) is 6..7, the chain 5..7
    assert sorted(p.name for p in pub.store.root.iterdir()) == [
        "v00000005", "v00000006", "v00000007"]


def test_a_restarted_publisher_starts_with_a_full_version_and_never_aliases_the_model(
        tmp_path: Path) -> None:
    model = torch.nn.Linear(16, 16)  # float32 served as float32: `publishable` views it
    pub = FileTransport(tmp_path / "w", full_every=5)
    assert pub.write(model, version=1, step=1).format == "safetensors"
    with torch.no_grad():
        model.weight[0, 0] += 1.0
    msg = pub.write(model, version=2, step=2)
    assert msg.format == "delta"
    got = _get(_receiver(tmp_path / "w", tmp_path / "c"), msg)
    assert torch.equal(got["weight"], model.weight.detach())
    again = FileTransport(tmp_path / "w", full_every=5)  # a restarted trainer
    assert again.write(model, version=3, step=3).format == "safetensors"


def test_delta_announcements_on_the_wire() -> None:
    full = WeightsPublished(version=3, step=3, uri="file:///w/v3", format="safetensors",
                            sha256="a" * 64, nbytes=10, t=1.0)
    raw = msgpack.unpackb(encode(full))
    assert "base" not in raw and "state" not in raw  # byte-compatible with schema 3
    assert decode(encode(full)) == full
    delta = dataclasses.replace(full, version=4, format="delta", base=3, state="b" * 64)
    assert decode(encode(delta)) == delta
    stated = dataclasses.replace(full, state="c" * 64)
    assert decode(encode(stated)) == stated
    for bad in ({"format": "delta", "state": "b" * 64}, {"format": "delta", "base": 3},
                {"format": "delta", "base": 4, "state": "b" * 64},
                {"base": 2}, {"state": "xyz"}):
        with pytest.raises(DecodeError):
            decode(msgpack.packb({**raw, "version": 4, **bad}))


def test_config_turns_deltas_on_for_full_weights_only(tmp_path: Path) -> None:
    cfg = load_config(None, [f"run.output_dir={tmp_path}", "weights.full_every=8",
                             "model.dtype=bfloat16"])
    t = make_transport(cfg)
    assert isinstance(t, FileTransport) and t.deltas is not None
    assert t.deltas.full_every == 8 and t.rebuilder.cache_dir == tmp_path / "weights-cache"
    with pytest.raises(ConfigError, match=r"weights\.full_every"):
        load_config(None, ["weights.full_every=2", "model.lora.rank=2"])
    custom = load_config(None, [f"run.output_dir={tmp_path}", f"weights.store={tmp_path}/s"])
    assert make_transport(custom).store.root == (tmp_path / "s").resolve()


def test_the_weights_benchmark_runs_on_a_tiny_model(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import weights

    assert weights.main(["--tiny", "--versions", "3", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "v3: full" in out and "delta / full: bytes" in out, out
