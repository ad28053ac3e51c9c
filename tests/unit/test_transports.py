"""pipeline.weights: one contract test run on every transport that works on CPU
(`file`, `lora`), then what is particular to each: sharding, the index and tied
embeddings (`file`), the push-then-files order (`nccl`, against a fake sync).

The contract (pipeline/weights/base.py): a version is visible complete or not at
all; `receive` returns only a verified directory inside the store (every file hashed
against the manifest, the manifest's table against the announcement, nothing unlisted);
both halves work off the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pipeline.bus.schema import WeightsPublished
from pipeline.config import LoraConfig, load_config
from pipeline.model import adapter_state, apply_lora, init_tiny_model, load_model
from pipeline.weights import (
    INDEX,
    MANIFEST,
    FileTransport,
    LoraTransport,
    WeightError,
    WeightTransport,
    make_transport,
    read_adapter,
    read_full,
    sha256_file,
    table_sha256,
)
from pipeline.weights.file import SINGLE_FILE, shard_name
from pipeline.weights.nccl_transport import NCCLTransport

torch.set_num_threads(1)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(4, 3, generator=g),
        "layer.bias": torch.randn(4, generator=g).to(torch.bfloat16),
        "counter": torch.arange(5, dtype=torch.int64) + seed,
        "view": torch.randn(3, 6, generator=g).t(),  # non-contiguous input
    }


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k])
        for k in a)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0, num_layers=1,
                           hidden_size=32, intermediate_size=64)


@dataclass
class Case:
    """One transport under the contract: ``source(seed)`` is what the trainer hands it,
    ``expected(seed)`` what reading the version back (``read``) must give."""

    transport: WeightTransport
    source: Callable[[int], Any]
    expected: Callable[[int], dict[str, torch.Tensor]]
    read: Callable[[Path], dict[str, torch.Tensor]]

    def publish(self, seed: int, version: int | None = None) -> WeightsPublished:
        v = seed if version is None else version
        return asyncio.run(self.transport.publish(self.source(seed), version=v, step=10 * v))

    def receive(self, msg: WeightsPublished) -> Path:
        return asyncio.run(self.transport.receive(msg))

    @property
    def root(self) -> Path:
        return self.transport.store.root


def _peft(base_dir: Path, seed: int) -> torch.nn.Module:
    model = apply_lora(load_model(base_dir)[0], LoraConfig(rank=2, alpha=4), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    return model


def _case(kind: str, root: Path, base_dir: Path, keep: int = 4) -> Case:
    if kind == "file":
        return Case(FileTransport(root, keep=keep), _state, _state, read_full)
    models: dict[int, torch.nn.Module] = {}

    def model(seed: int) -> torch.nn.Module:
        return models.setdefault(seed, _peft(base_dir, seed))

    return Case(LoraTransport(root, keep=keep, base_model=base_dir), model,
                lambda s: adapter_state(model(s)), read_adapter)


KINDS = ["file", "lora"]


@pytest.fixture(params=KINDS)
def case(request: pytest.FixtureRequest, tmp_path: Path, base_dir: Path) -> Case:
    return _case(request.param, tmp_path / "w", base_dir)


# ------------------------------------------------------------------ the contract


def test_published_version_is_received_verified_and_reads_back_the_source(case: Case) -> None:
    msg = case.publish(3)
    assert (msg.version, msg.step, msg.format) == (3, 30, case.transport.format)
    path = case.receive(msg)
    assert path == case.transport.store.dir_for(3) and msg.uri == path.as_uri()
    assert _equal(case.read(path), case.expected(3))


def test_announced_sha256_is_the_manifests_file_table_as_sha256sum_prints_it(
        case: Case) -> None:
    msg = case.publish(2)
    d = case.receive(msg)
    manifest = json.loads((d / MANIFEST).read_text())
    names = sorted(p.name for p in d.iterdir() if p.name != MANIFEST)
    assert sorted(manifest["files"]) == names  # every file is listed
    table = "".join(f"{hashlib.sha256((d / n).read_bytes()).hexdigest()}  {n}\n" for n in names)
    assert msg.sha256 == hashlib.sha256(table.encode()).hexdigest() == table_sha256(
        manifest["files"])
    assert manifest["files"] == {n: sha256_file(d / n) for n in names}
    assert msg.nbytes == sum((d / n).stat().st_size for n in names) == sum(
        manifest["bytes"].values())
    assert (manifest["version"], manifest["format"]) == (2, msg.format)


def test_every_tampered_file_is_refused(case: Case) -> None:
    msg = case.publish(1)
    d = case.receive(msg)
    for f in sorted(d.iterdir()):
        if f.name == MANIFEST:
            continue
        good = f.read_bytes()
        f.write_bytes(good[:-1] + bytes([good[-1] ^ 0x01]))
        with pytest.raises(WeightError, match=rf"sha256 .* of {f.name} does not match"):
            case.receive(msg)
        f.write_bytes(good)
    assert case.receive(msg) == d


def test_wrong_announcement_or_manifest_is_refused(case: Case) -> None:
    msg = case.publish(1)
    with pytest.raises(WeightError, match="file table does not match the announced"):
        case.receive(dataclasses.replace(msg, sha256="0" * 64))
    with pytest.raises(WeightError, match="the manifest is for v1"):
        case.receive(dataclasses.replace(msg, version=2))  # same directory, other version
    other = "lora" if msg.format == "safetensors" else "safetensors"
    with pytest.raises(WeightError, match="the manifest is for"):
        case.receive(dataclasses.replace(msg, format=other))


def test_unlisted_or_missing_files_are_refused(case: Case) -> None:
    msg = case.publish(1)
    d = case.receive(msg)
    (d / "extra.safetensors").write_bytes(b"x")
    with pytest.raises(WeightError, match="not in the manifest"):
        case.receive(msg)
    (d / "extra.safetensors").unlink()
    victim = next(p for p in sorted(d.iterdir()) if p.name != MANIFEST)
    victim.unlink()
    with pytest.raises(WeightError, match="does not exist"):
        case.receive(msg)
    (d / MANIFEST).unlink()
    with pytest.raises(WeightError, match="does not exist"):
        case.receive(msg)


@pytest.mark.parametrize(
    "uri",
    ["file:///etc", "file:///etc/passwd", "file://{root}/../outside", "file://{root}/v1/../../x",
     "file://{root}-sibling/v00000001", "http://host/w/v00000001", "s3://bucket/v1",
     "/abs/path", "nccl://group"],
    ids=["etc", "passwd", "dotdot", "nested-dotdot", "sibling-prefix", "http", "s3",
         "no-scheme", "nccl"],
)
def test_uri_outside_the_store_is_refused(case: Case, uri: str) -> None:
    msg = case.publish(1)
    with pytest.raises(WeightError, match=r"outside the weight store|unsupported weight URI"):
        case.receive(dataclasses.replace(msg, uri=uri.format(root=case.root)))


def test_symlinks_out_of_the_store_are_refused(tmp_path: Path, base_dir: Path) -> None:
    for kind in KINDS:
        outside = _case(kind, tmp_path / kind / "other", base_dir)
        msg = outside.publish(1)
        inside = _case(kind, tmp_path / kind / "w", base_dir)
        inside.root.mkdir(parents=True)
        link = inside.transport.store.dir_for(1)
        link.symlink_to(outside.transport.store.dir_for(1))  # the version directory
        with pytest.raises(WeightError, match="outside the weight store"):
            inside.receive(dataclasses.replace(msg, uri=link.as_uri()))
        link.unlink()
        link.mkdir()  # a real directory whose files point elsewhere (hashes announced right)
        for f in outside.transport.store.dir_for(1).iterdir():
            (link / f.name).symlink_to(f)
        with pytest.raises(WeightError, match="resolves outside the weight store"):
            inside.receive(dataclasses.replace(msg, uri=link.as_uri()))


def test_pruning_keeps_the_window_and_leaves_no_temporary_directories(
        tmp_path: Path, base_dir: Path) -> None:
    for kind in KINDS:
        c = _case(kind, tmp_path / kind, base_dir, keep=2)
        msgs = {v: c.publish(v) for v in range(6)}
        assert sorted(p.name for p in c.root.iterdir()) == [
            "v00000003", "v00000004", "v00000005"]
        for v in (3, 4, 5):
            assert _equal(c.read(c.receive(msgs[v])), c.expected(v))
        with pytest.raises(WeightError, match="does not exist"):
            c.receive(msgs[2])


def test_republishing_a_version_replaces_it(case: Case) -> None:
    first = case.publish(1, version=5)
    second = case.publish(2, version=5)
    assert first.sha256 != second.sha256 and first.uri == second.uri
    assert _equal(case.read(case.receive(second)), case.expected(2))
    with pytest.raises(WeightError, match="does not match"):
        case.receive(first)
    assert [p.name for p in case.root.iterdir()] == ["v00000005"]


def test_publish_and_receive_leave_the_event_loop_running(
        case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow disk (0.3 s per file written or hashed, blocking) must not stall other
    coroutines: heartbeats and lease renewals keep ticking."""
    store = case.transport.store
    commit, verify = store.commit, store.verify

    def slow(items: Iterator[tuple[str, bytes]]) -> Iterator[tuple[str, bytes]]:
        for item in items:
            time.sleep(0.3)
            yield item

    monkeypatch.setattr(store, "commit", lambda files, **kw: commit(slow(files), **kw))
    monkeypatch.setattr(store, "verify", lambda msg: (time.sleep(0.3), verify(msg))[1])

    async def go() -> tuple[int, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        msg = await case.transport.publish(case.source(1), version=1, step=1)
        during_publish = ticks
        await case.transport.receive(msg)
        t.cancel()
        return during_publish, ticks - during_publish

    during_publish, during_receive = asyncio.run(go())
    assert during_publish >= 20 and during_receive >= 10, (during_publish, during_receive)


def test_publishing_never_reads_a_file_back(case: Case, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    """Hashed while written: the trainer side opens files in the store only to write."""
    import builtins

    real_open = builtins.open
    modes: list[tuple[str, str]] = []

    def spy(file: Any, mode: str = "r", *a: Any, **kw: Any) -> Any:
        modes.append((str(file), mode))
        return real_open(file, mode, *a, **kw)

    source = case.source(1)
    monkeypatch.setattr(builtins, "open", spy)
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail(f"read {self}"))
    case.transport.write(source, version=1, step=1)
    monkeypatch.undo()
    mine = [(f, m) for f, m in modes if f.startswith(str(case.root))]
    assert mine and all("w" in m for _, m in mine), mine


# ------------------------------------------------------------------ file: sharding


def test_shards_follow_the_size_limit_and_the_index_maps_every_tensor(tmp_path: Path) -> None:
    state = {f"t{i}": torch.full((10,), float(i)) for i in range(5)}  # 40 bytes each
    state["big"] = torch.zeros(100)  # 400 bytes: larger than a shard, gets its own
    t = FileTransport(tmp_path / "w", max_shard_bytes=100)
    d = asyncio.run(t.receive(t.write(state, version=1, step=1)))
    names = [shard_name(i, 4) for i in (1, 2, 3, 4)]
    assert names[0] == "model-00001-of-00004.safetensors"
    assert sorted(p.name for p in d.iterdir()) == sorted([*names, INDEX, MANIFEST])
    index = json.loads((d / INDEX).read_text())
    assert index["metadata"]["total_size"] == 5 * 40 + 400
    assert index["weight_map"] == {"t0": names[0], "t1": names[0], "t2": names[1],
                                   "t3": names[1], "t4": names[2], "big": names[3]}
    assert set(load_file(str(d / names[3]))) == {"big"}
    assert load_file(str(d / names[0]))["t1"].tolist() == [1.0] * 10
    assert _equal(read_full(d), state)


def test_versions_are_published_in_the_serving_dtype(tmp_path: Path) -> None:
    """float32 master weights are written in ``model.dtype``: bf16 halves the bytes each
    version costs to write, hash and read; integer tensors are kept; the engine reads
    exactly the master weights cast to bf16."""
    state = {"w": torch.randn(64, 64), "ids": torch.arange(8)}
    t = FileTransport(tmp_path / "w", dtype=torch.bfloat16)
    msg = t.write(state, version=1, step=1)
    back = read_full(asyncio.run(t.receive(msg)))
    assert back["w"].dtype == torch.bfloat16 and back["ids"].dtype == torch.int64
    assert torch.equal(back["w"], state["w"].to(torch.bfloat16))
    full = FileTransport(tmp_path / "full").write(state, version=1, step=1)
    assert msg.nbytes < 0.6 * full.nbytes
    cfg = load_config(None, [f"run.output_dir={tmp_path}/run", "model.dtype=bfloat16"])
    assert make_transport(cfg).dtype == torch.bfloat16  # type: ignore[attr-defined]


def test_a_small_model_is_one_shard_behind_an_index(tmp_path: Path) -> None:
    t = FileTransport(tmp_path / "w")
    d = asyncio.run(t.receive(t.write(_state(), version=1, step=1)))
    assert sorted(p.name for p in d.iterdir()) == sorted(
        [INDEX, MANIFEST, "model-00001-of-00001.safetensors"])
    assert not (d / SINGLE_FILE).exists()


def test_an_index_that_disagrees_with_the_shards_is_refused(tmp_path: Path) -> None:
    """An honest manifest over a wrong index (a buggy publisher): verify refuses it
    before any engine reads it."""
    t = FileTransport(tmp_path / "w", max_shard_bytes=40)
    msg = t.write(_state(), version=1, step=1)
    d = t.store.dir_for(1)
    index = json.loads((d / INDEX).read_text())
    index["weight_map"]["counter"] = "model-00009-of-00009.safetensors"
    (d / INDEX).write_text(json.dumps(index))
    man = json.loads((d / MANIFEST).read_text())
    man["files"][INDEX] = sha256_file(d / INDEX)
    man["bytes"][INDEX] = (d / INDEX).stat().st_size
    (d / MANIFEST).write_text(json.dumps(man))
    forged = dataclasses.replace(msg, sha256=table_sha256(man["files"]))
    with pytest.raises(WeightError, match="the index names shards"):
        asyncio.run(t.receive(forged))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[5, 6, 7, 8, 66]])).logits


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_transformers_loads_the_published_folder_as_a_model(tmp_path: Path,
                                                            tied: bool) -> None:
    """A published version plus the model's config.json is an HF folder:
    ``from_pretrained`` reads the shards through the index. With tied embeddings the
    trainer's state shares storage (which safetensors refuses): published anyway, and
    the reloaded model's lm_head is the trained embedding."""
    src = init_tiny_model(tmp_path / "m", seed=0, tie_word_embeddings=tied)
    model, _ = load_model(src)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    state = model.state_dict()
    assert (state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
            ) is tied
    t = FileTransport(tmp_path / "w", max_shard_bytes=64 * 1024)
    d = asyncio.run(t.receive(asyncio.run(t.publish(model, version=1, step=1))))
    assert len(json.loads((d / INDEX).read_text())["weight_map"]) == len(state)
    assert len({*json.loads((d / INDEX).read_text())["weight_map"].values()}) > 1
    folder = tmp_path / "hf"
    shutil.copytree(d, folder)
    shutil.copy(src / "config.json", folder / "config.json")
    reloaded = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    torch.testing.assert_close(_logits(reloaded), _logits(model), rtol=0, atol=0)
    assert (reloaded.lm_head.weight is reloaded.model.embed_tokens.weight) is tied
    assert not torch.equal(_logits(reloaded), _logits(load_model(src)[0]))


# ------------------------------------------------------------------ nccl: push, then files


class FakeSync:
    """The parts of `NCCLWeightSync` the transport drives."""

    def __init__(self, fail: bool = False) -> None:
        self.group: Any = None
        self.broken: str | None = None
        self.pushed: list[tuple[int, list[str]]] = []
        self.fail, self.closed = fail, False

    async def init(self) -> int:
        self.group = "group"
        return 2

    async def push(self, weights: Any, version: int, info: Any = None) -> float:
        if self.fail:
            raise RuntimeError("peer gone")
        names = [n for n, _ in (weights.items() if isinstance(weights, dict) else weights)]
        assert info is None or info["names"] == names  # what was announced is what is sent
        self.pushed.append((version, names))
        return 0.25

    async def close(self) -> None:
        self.closed = True


def test_nccl_pushes_then_publishes_the_files_and_survives_a_failed_push(
        tmp_path: Path) -> None:
    async def go(sync: FakeSync) -> tuple[NCCLTransport, WeightsPublished]:
        t = NCCLTransport(sync, FileTransport(tmp_path / str(sync.fail)))  # type: ignore[arg-type]
        await t.start()
        msg = await t.publish(_state(1), version=1, step=2)
        assert await t.receive(msg) == t.store.dir_for(1)
        await t.close()
        return t, msg

    t, msg = asyncio.run(go(sync := FakeSync()))
    assert sync.pushed == [(1, list(_state()))] and sync.closed
    assert msg.format == "safetensors" and t.stats["nccl_pause_s"] == 0.25
    assert _equal(t.fallback.load(msg), _state(1))
    t, msg = asyncio.run(go(FakeSync(fail=True)))  # logged; the files still carry it
    assert "nccl_pause_s" not in t.stats and _equal(t.fallback.load(msg), _state(1))


def test_make_transport_follows_the_config(tmp_path: Path, base_dir: Path) -> None:
    def cfg(*sets: str) -> Any:
        return load_config(None, [f"model.path={base_dir}", f"run.output_dir={tmp_path}",
                                  *sets])

    assert type(make_transport(cfg())) is FileTransport
    lora = make_transport(cfg("model.lora.rank=2"))
    assert type(lora) is LoraTransport and lora.base_model == str(base_dir)
    nccl = make_transport(cfg('generation.engine="vllm"', 'generation.vllm.urls=["http://x:1"]',
                              'generation.vllm.weight_transfer="nccl"'))
    assert type(nccl) is NCCLTransport and nccl.sync.servers == ["http://x:1"]
    assert {t.store.root for t in (lora, nccl)} == {(tmp_path / "weights").resolve()}
