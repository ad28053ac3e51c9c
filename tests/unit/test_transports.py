"""pipeline.weights.FileWeightStore: atomic publish, verified load, confinement, pruning."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest
import torch

from pipeline.weights import MANIFEST, WEIGHTS_FILE, FileWeightStore, WeightError, sha256_file


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(4, 3, generator=g),
        "layer.bias": torch.randn(4, generator=g).to(torch.bfloat16),
        "counter": torch.arange(5, dtype=torch.int64) + seed,
        "view": torch.randn(3, 6, generator=g).t(),  # non-contiguous input
    }


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def test_publish_then_load_round_trips_tensors(tmp_path: Path) -> None:
    store = FileWeightStore(tmp_path / "w")
    state = _state()
    msg = store.publish(state, version=3, step=6)
    assert (msg.version, msg.step, msg.format) == (3, 6, "safetensors")
    _assert_equal(store.load(msg), state)


def test_a_second_store_on_the_same_root_loads_the_announcement(tmp_path: Path) -> None:
    msg = FileWeightStore(tmp_path / "w").publish(_state(), version=1, step=1)
    _assert_equal(FileWeightStore(tmp_path / "w").load(msg), _state())


def test_announced_sha256_and_size_are_those_of_the_file(tmp_path: Path) -> None:
    store = FileWeightStore(tmp_path / "w")
    msg = store.publish(_state(), version=2, step=2)
    f = store.dir_for(2) / WEIGHTS_FILE
    assert msg.uri == store.dir_for(2).as_uri()
    assert msg.sha256 == hashlib.sha256(f.read_bytes()).hexdigest() == sha256_file(f)
    assert msg.nbytes == f.stat().st_size
    manifest = (store.dir_for(2) / MANIFEST).read_text()
    assert msg.sha256 in manifest


def test_tampered_file_is_refused(tmp_path: Path) -> None:
    store = FileWeightStore(tmp_path / "w")
    msg = store.publish(_state(), version=1, step=1)
    f = store.dir_for(1) / WEIGHTS_FILE
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(WeightError, match=r"sha256 .* does not match"):
        store.load(msg)


def test_wrong_announced_sha256_is_refused(tmp_path: Path) -> None:
    store = FileWeightStore(tmp_path / "w")
    msg = store.publish(_state(), version=1, step=1)
    with pytest.raises(WeightError, match="does not match"):
        store.load(dataclasses.replace(msg, sha256="0" * 64))


@pytest.mark.parametrize(
    "uri",
    ["file:///etc", "file:///etc/passwd", "file://{root}/../outside", "file://{root}/v1/../../x",
     "file://{root}-sibling/v00000001"],
    ids=["etc", "passwd", "dotdot", "nested-dotdot", "sibling-prefix"],
)
def test_uri_outside_the_root_is_refused(tmp_path: Path, uri: str) -> None:
    store = FileWeightStore(tmp_path / "w")
    msg = store.publish(_state(), version=1, step=1)
    with pytest.raises(WeightError, match="outside the weight store"):
        store.load(dataclasses.replace(msg, uri=uri.format(root=store.root)))


def test_symlink_escaping_the_root_is_refused(tmp_path: Path) -> None:
    outside = FileWeightStore(tmp_path / "other")
    msg = outside.publish(_state(), version=1, step=1)
    store = FileWeightStore(tmp_path / "w")
    store.root.mkdir()
    (store.root / "v00000001").symlink_to(outside.dir_for(1))
    with pytest.raises(WeightError, match="outside the weight store"):
        store.load(dataclasses.replace(msg, uri=store.dir_for(1).as_uri()))


def test_weight_file_symlinked_out_of_the_root_is_refused(tmp_path: Path) -> None:
    """The version directory is inside the store, but its weight file points elsewhere
    (whose sha256 is even announced correctly): still refused."""
    outside = FileWeightStore(tmp_path / "other")
    msg = outside.publish(_state(), version=1, step=1)
    store = FileWeightStore(tmp_path / "w")
    store.dir_for(1).mkdir(parents=True)
    (store.dir_for(1) / WEIGHTS_FILE).symlink_to(outside.dir_for(1) / WEIGHTS_FILE)
    with pytest.raises(WeightError, match="outside the weight store"):
        store.load(dataclasses.replace(msg, uri=store.dir_for(1).as_uri()))


@pytest.mark.parametrize("uri", ["http://host/w/v00000001", "s3://bucket/v1", "/abs/path",
                                 "nccl://group"])
def test_non_file_scheme_is_refused(tmp_path: Path, uri: str) -> None:
    store = FileWeightStore(tmp_path / "w")
    msg = store.publish(_state(), version=1, step=1)
    with pytest.raises(WeightError, match="unsupported weight URI scheme"):
        store.load(dataclasses.replace(msg, uri=uri))


def test_missing_weights_file_is_refused(tmp_path: Path) -> None:
    store = FileWeightStore(tmp_path / "w")
    msg = store.publish(_state(), version=1, step=1)
    (store.dir_for(1) / WEIGHTS_FILE).unlink()
    with pytest.raises(WeightError, match="does not exist"):
        store.load(msg)


def test_pruning_keeps_only_versions_at_least_newest_minus_keep(tmp_path: Path) -> None:
    store = FileWeightStore(tmp_path / "w", keep=2)
    msgs = {v: store.publish(_state(v), version=v, step=v) for v in range(7)}
    assert sorted(p.name for p in store.root.iterdir()) == [
        "v00000004", "v00000005", "v00000006"]
    for v in (4, 5, 6):
        _assert_equal(store.load(msgs[v]), _state(v))
    with pytest.raises(WeightError, match="does not exist"):
        store.load(msgs[3])


def test_no_temporary_directories_are_left_behind(tmp_path: Path) -> None:
    store = FileWeightStore(tmp_path / "w")
    for v in range(3):
        store.publish(_state(v), version=v, step=v)
    store.publish(_state(9), version=2, step=9)
    names = [p.name for p in store.root.iterdir()]
    assert not [n for n in names if n.startswith(".tmp")], names
    assert sorted(names) == ["v00000000", "v00000001", "v00000002"]
    assert sorted(p.name for p in store.dir_for(1).iterdir()) == [MANIFEST, WEIGHTS_FILE]


def test_republishing_a_version_replaces_it(tmp_path: Path) -> None:
    store = FileWeightStore(tmp_path / "w")
    first = store.publish(_state(1), version=5, step=10)
    second = store.publish(_state(2), version=5, step=11)
    assert first.sha256 != second.sha256
    assert first.uri == second.uri
    _assert_equal(store.load(second), _state(2))
    with pytest.raises(WeightError, match="does not match"):
        store.load(first)
    assert [p.name for p in store.root.iterdir()] == ["v00000005"]
