"""The weight store in a bucket, against a real S3 server (SeaweedFS, `tests.seaweed`).

The transport contract of ``tests/unit/test_transports.py`` on an s3:// store (`file`
and `lora`): a published version is received verified and reads back the source; the
announced sha256 is the manifest's file table; every tampered object, a wrong
announcement, a missing object or manifest and a URI outside the store are refused;
pruning keeps the window in the bucket and in the cache; republishing replaces. Then
what is particular to a bucket: the receiver's copy lives in its own cache directory
(no shared disk), a damaged cached copy is downloaded again, deltas travel through it.
Bad input fails at start naming the key (no credentials, wrong credentials, an endpoint
nobody answers, a bucket that does not exist), through `sluice up` too, before any role
starts; and a real `Generator` meeting a missing or corrupt object keeps its version and
applies the version once the object is back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.bus.schema import WeightsPublished
from pipeline.config import ConfigError, load_config
from pipeline.model import adapter_state, init_tiny_model
from pipeline.ports import free_port
from pipeline.weights import (
    MANIFEST,
    FileTransport,
    LoraTransport,
    WeightError,
    check_store,
    make_transport,
    read_adapter,
    read_full,
    table_sha256,
)
from pipeline.weights.s3 import S3WeightStore
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun
from tests.helpers import ROOT
from tests.seaweed import SeaweedFS
from tests.unit.test_transports import _equal, _peft, _state
from workers.generator import Generator

pytestmark = pytest.mark.integration
torch.set_num_threads(1)

AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
            "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_PROFILE")


@pytest.fixture
def s3(seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> SeaweedFS:
    """The session's server with this test's environment holding its credentials (and
    no AWS configuration of the machine's)."""
    for k in AWS_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    for k, v in seaweedfs.env.items():
        monkeypatch.setenv(k, v)
    return seaweedfs


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0, num_layers=1,
                           hidden_size=32, intermediate_size=64)


@dataclasses.dataclass
class S3Case:
    """A publisher and a receiver of one s3:// store, each with its own local directory
    (they share nothing but the bucket)."""

    publisher: Any
    receiver: Any
    source: Any
    expected: Any
    read: Any
    server: SeaweedFS
    bucket: str
    prefix: str

    def publish(self, seed: int, version: int | None = None) -> WeightsPublished:
        v = seed if version is None else version
        return arun(self.publisher.publish(self.source(seed), version=v, step=10 * v))

    def receive(self, msg: WeightsPublished) -> Path:
        return arun(self.receiver.receive(msg))

    def key(self, msg: WeightsPublished, name: str) -> str:
        return f"{self.prefix}/v{msg.version:08d}/{name}"

    def objects(self, sub: str = "") -> list[str]:
        pages = self.server.client().get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=f"{self.prefix}/{sub}")
        return sorted(o["Key"] for p in pages for o in p.get("Contents", []))

    def get(self, key: str) -> bytes:
        return self.server.client().get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def put(self, key: str, data: bytes) -> None:
        self.server.client().put_object(Bucket=self.bucket, Key=key, Body=data)


def _store(server: SeaweedFS, bucket: str, cache: Path, keep: int = 4) -> S3WeightStore:
    return S3WeightStore(f"s3://{bucket}/runs/r1", cache_dir=cache, keep=keep,
                         endpoint_url=server.endpoint)


def _s3_case(kind: str, server: SeaweedFS, tmp: Path, base_dir: Path, keep: int = 4,
             **file_kw: Any) -> S3Case:
    bucket = server.bucket()
    pub = _store(server, bucket, tmp / "trainer-machine" / "cache", keep)
    rec = _store(server, bucket, tmp / "generator-machine" / "cache", keep)
    if kind == "file":
        return S3Case(FileTransport(pub, **file_kw),
                      FileTransport(rec, cache_dir=tmp / "generator-machine" / "cache"),
                      _state, _state, read_full, server, bucket, "runs/r1")
    models: dict[int, torch.nn.Module] = {}

    def model(seed: int) -> torch.nn.Module:
        return models.setdefault(seed, _peft(base_dir, seed))

    return S3Case(LoraTransport(pub, base_model=base_dir), LoraTransport(rec), model,
                  lambda s: adapter_state(model(s)), read_adapter, server, bucket, "runs/r1")


@pytest.fixture(params=["file", "lora"])
def case(request: pytest.FixtureRequest, s3: SeaweedFS, tmp_path: Path,
         base_dir: Path) -> S3Case:
    return _s3_case(request.param, s3, tmp_path, base_dir)


# ------------------------------------------------------------------ the contract


def test_published_version_is_received_verified_into_the_receivers_cache(case: S3Case,
                                                                         tmp_path: Path) -> None:
    msg = case.publish(3)
    assert msg.uri == f"s3://{case.bucket}/runs/r1/v00000003"
    assert (msg.version, msg.step, msg.format) == (3, 30, case.publisher.format)
    path = case.receive(msg)
    assert path == tmp_path / "generator-machine" / "cache" / "v00000003"
    assert _equal(case.read(path), case.expected(3))
    assert not list((tmp_path / "trainer-machine").rglob("*.safetensors"))  # nothing local


def test_announced_sha256_is_the_manifests_file_table(case: S3Case) -> None:
    msg = case.publish(2)
    man = json.loads(case.get(case.key(msg, MANIFEST)))
    keys = case.objects("v00000002/")
    names = sorted(k.rsplit("/", 1)[1] for k in keys if not k.endswith(MANIFEST))
    assert sorted(man["files"]) == names
    assert man["files"] == {n: hashlib.sha256(case.get(case.key(msg, n))).hexdigest()
                            for n in names}
    assert msg.sha256 == table_sha256(man["files"])
    assert msg.nbytes == sum(man["bytes"].values())
    d = case.receive(msg)
    assert sorted(p.name for p in d.iterdir() if p.name != MANIFEST) == names


def test_every_tampered_object_is_refused_and_a_restored_one_accepted(case: S3Case) -> None:
    msg = case.publish(1)
    for name in json.loads(case.get(case.key(msg, MANIFEST)))["files"]:
        good = case.get(case.key(msg, name))
        case.put(case.key(msg, name), good[:-1] + bytes([good[-1] ^ 0x01]))
        with pytest.raises(WeightError, match=rf"sha256 .* of {name} does not match"):
            case.receive(msg)
        case.put(case.key(msg, name), good + b"!")  # and a longer one
        with pytest.raises(WeightError, match=rf"{name} has \d+ bytes"):
            case.receive(msg)
        case.put(case.key(msg, name), good)
    assert _equal(case.read(case.receive(msg)), case.expected(1))


def test_wrong_announcements_are_refused(case: S3Case) -> None:
    msg = case.publish(1)
    with pytest.raises(WeightError, match="file table does not match the announced"):
        case.receive(dataclasses.replace(msg, sha256="0" * 64))
    other = "lora" if msg.format == "safetensors" else "safetensors"
    with pytest.raises(WeightError, match="the manifest is for"):
        case.receive(dataclasses.replace(msg, format=other))
    with pytest.raises(WeightError, match="does not exist"):  # v2's place holds nothing
        case.receive(dataclasses.replace(msg, version=2, uri=msg.uri[:-1] + "2"))


def test_missing_objects_are_refused_and_unlisted_ones_never_downloaded(case: S3Case) -> None:
    msg = case.publish(1)
    case.put(case.key(msg, "extra.safetensors"), b"x")
    d = case.receive(msg)
    assert not (d / "extra.safetensors").exists()
    name = next(n for n in json.loads(case.get(case.key(msg, MANIFEST)))["files"])
    case.server.client().delete_object(Bucket=case.bucket, Key=case.key(msg, name))
    (d / name).unlink()  # the cached copy no longer verifies either
    with pytest.raises(WeightError, match=rf"{name} does not exist"):
        case.receive(msg)
    case.server.client().delete_object(Bucket=case.bucket, Key=case.key(msg, MANIFEST))
    with pytest.raises(WeightError, match=rf"{MANIFEST} does not exist"):
        case.receive(msg)


@pytest.mark.parametrize("uri", [
    "s3://{bucket}/runs/r2/v00000001", "s3://{bucket}/runs/v00000001",
    "s3://other-bucket/runs/r1/v00000001", "s3://{bucket}/runs/r1/v00000001/../../x",
    "s3://{bucket}/runs/r1/v00000002", "file:///etc", "http://host/runs/r1/v00000001"])
def test_uri_outside_the_store_is_refused(case: S3Case, uri: str) -> None:
    msg = case.publish(1)
    with pytest.raises(WeightError, match="outside the weight store"):
        case.receive(dataclasses.replace(msg, uri=uri.format(bucket=case.bucket)))


def test_pruning_keeps_the_window_in_the_bucket_and_the_cache(s3: SeaweedFS, tmp_path: Path,
                                                              base_dir: Path) -> None:
    c = _s3_case("file", s3, tmp_path, base_dir, keep=2)
    msgs = {}
    for v in range(6):
        msgs[v] = c.publish(v)
        c.receive(msgs[v])
    assert sorted({k.split("/")[2] for k in c.objects()}) == [
        "v00000003", "v00000004", "v00000005"]
    cache = tmp_path / "generator-machine" / "cache"
    assert sorted(p.name for p in cache.iterdir()) == ["v00000003", "v00000004", "v00000005"]
    with pytest.raises(WeightError, match="does not exist"):
        c.receive(msgs[2])


def test_republishing_a_version_replaces_it(case: S3Case) -> None:
    first = case.publish(1, version=5)
    assert _equal(case.read(case.receive(first)), case.expected(1))
    second = case.publish(2, version=5)
    assert first.sha256 != second.sha256 and first.uri == second.uri
    assert _equal(case.read(case.receive(second)), case.expected(2))  # the cache is updated
    with pytest.raises(WeightError, match="does not match"):
        case.receive(first)


def test_a_damaged_cached_copy_is_downloaded_again(s3: SeaweedFS, tmp_path: Path,
                                                   base_dir: Path) -> None:
    c = _s3_case("file", s3, tmp_path, base_dir)
    msg = c.publish(1)
    d = c.receive(msg)
    shard = next(p for p in d.iterdir() if p.name.startswith("model-"))
    shard.write_bytes(b"garbage")
    assert c.receive(msg) == d and _equal(read_full(d), _state(1))


def test_deltas_travel_through_the_bucket(s3: SeaweedFS, tmp_path: Path, base_dir: Path) -> None:
    """Full, delta, delta, full: the receiver (its own cache) rebuilds each delta from the
    version it holds; a delta's objects are a fraction of a full version's."""
    c = _s3_case("file", s3, tmp_path, base_dir, full_every=3, dtype=torch.bfloat16)
    state = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    msgs: list[WeightsPublished] = []
    for v in range(1, 5):
        state["w"][v, :4] += 1.0  # a few elements change
        msgs.append(msg := arun(c.publisher.publish(state, version=v, step=v)))
        got = read_full(c.receive(msg))
        assert all(torch.equal(got[k], state[k].to(torch.bfloat16)) for k in state)
    formats = [m.format for m in msgs]
    assert all(m.nbytes < 0.2 * msgs[0].nbytes for m in msgs[1:3])
    assert formats == ["safetensors", "delta", "delta", "safetensors"]
    fresh = FileTransport(_store(s3, c.bucket, tmp_path / "late" / "cache"),
                          cache_dir=tmp_path / "late" / "cache")
    state["w"][0, 0] += 1.0
    v5 = arun(c.publisher.publish(state, version=5, step=5))
    assert v5.format == "delta"  # a late receiver holds nothing: it replays from v4
    assert torch.equal(read_full(arun(fresh.receive(v5)))["w"], state["w"].to(torch.bfloat16))


# ------------------------------------------------------------------ bad input at start


def _cfg(tmp_path: Path, store: str, endpoint: str, *sets: str) -> Any:
    return load_config(None, [f"run.output_dir={tmp_path / 'out'}", f"weights.store={store}",
                              f"weights.endpoint_url={endpoint}", *sets])


def test_preflight_accepts_a_good_store_and_names_the_key_for_each_bad_input(
        s3: SeaweedFS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = s3.bucket()
    good = _cfg(tmp_path, f"s3://{bucket}/p", s3.endpoint)
    check_store(good, write=True)
    check_store(good, write=False)
    assert not (tmp_path / "out").exists()  # checked, nothing created
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^weights\.cache_dir: cannot create or write"):
        check_store(_cfg(tmp_path, f"s3://{bucket}/p", s3.endpoint,
                         f"weights.cache_dir={tmp_path / 'file' / 'cache'}"), write=False)
    assert not S3WeightStore(f"s3://{bucket}/p", cache_dir=tmp_path / "c",
                             endpoint_url=s3.endpoint).published()  # the probe is gone
    with pytest.raises(ConfigError, match=r"^weights.store: bucket 'no-such-bucket' does not "
                                          "exist"):
        check_store(_cfg(tmp_path, "s3://no-such-bucket/p", s3.endpoint), write=False)
    nobody = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError, match=r"^weights.endpoint_url: cannot reach the S3 "
                                          rf"endpoint {nobody}"):
        check_store(_cfg(tmp_path, f"s3://{bucket}/p", nobody), write=True)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(ConfigError, match=r"^weights.store: .* refused .*check the credentials"):
        check_store(good, write=False)
    for k in AWS_VARS:
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ConfigError, match=r"^weights.store: .* needs S3 credentials"):
        check_store(good, write=False)


def test_sluice_up_refuses_a_bad_store_before_any_role_starts(s3: SeaweedFS,
                                                              tmp_path: Path) -> None:
    """`sluice up` runs every role's preflight first: exit 2, the key named, no run
    directory made, no process started. Credentials travel in the environment only."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update({"PYTHONPATH": str(ROOT), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_EC2_METADATA_DISABLED": "true"})
    base = [sys.executable, "-m", "sluice.cli", "up", str(ROOT / "examples/copy.toml"),
            "--set", f"run.output_dir={out}", "--set", f"weights.endpoint_url={s3.endpoint}"]
    bucket = s3.bucket()
    for store, extra_env, want in [
            ("s3://no-such-bucket/p", s3.env,
             "sluice: weights.store: bucket 'no-such-bucket' does not exist"),
            (f"s3://{bucket}/p", {},
             f"sluice: weights.store: s3://{bucket}/p needs S3 credentials"),
    ]:
        p = subprocess.run([*base, "--set", f"weights.store={store}"], cwd=tmp_path,
                           env={**env, **extra_env}, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and want in p.stderr, p.stderr[-2000:]
        assert not out.exists()


# ------------------------------------------------------------------ a real generator


def test_generator_keeps_its_version_on_a_missing_or_corrupt_object_and_retries(
        s3: SeaweedFS, redis_server: EmbeddedRedis, run_name: str, tmp_path: Path,
        tiny_model_dir: Path) -> None:
    bucket = s3.bucket()
    cfg = load_config(None, [
        f"run.name={run_name}", f"run.output_dir={tmp_path / 'generator-side'}",
        f"bus.redis_url={redis_server.url}", f"model.path={tiny_model_dir}", "model.init=''",
        f"weights.store=s3://{bucket}/run", f"weights.endpoint_url={s3.endpoint}"])
    trainer_cfg = cfg.model_copy(deep=True)
    trainer_cfg.run.output_dir = str(tmp_path / "trainer-side")
    publisher = make_transport(trainer_cfg)
    gen = Generator(cfg, "g0")
    client = s3.client()

    def weights(shift: float) -> dict[str, torch.Tensor]:
        return {k: v + shift if v.is_floating_point() else v.clone()
                for k, v in gen.engine.model.state_dict().items()}  # type: ignore[attr-defined]

    def serving() -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in gen.engine.model.state_dict().items()}  # type: ignore[attr-defined]

    async def go() -> None:
        v1 = await publisher.publish(weights(1.0), version=1, step=1)
        await gen.apply(v1)
        assert gen.engine.version == 1
        served = serving()
        v2 = await publisher.publish(weights(1.0), version=2, step=2)
        shard = "run/v00000002/model-00001-of-00001.safetensors"
        good = client.get_object(Bucket=bucket, Key=shard)["Body"].read()
        for damage in (b"", good[:-1] + b"\x00"):  # missing, then corrupt
            if damage:
                client.put_object(Bucket=bucket, Key=shard, Body=damage)
            else:
                client.delete_object(Bucket=bucket, Key=shard)
            before = gen.rejected_weights
            await gen.apply(v2)
            assert gen.engine.version == 1 and gen.rejected_weights == before + 1
            assert _equal(serving(), served)
        client.put_object(Bucket=bucket, Key=shard, Body=good)
        await gen.apply(v2)  # the same announcement again: applied now
        assert gen.engine.version == 2
        assert (tmp_path / "generator-side" / "weights-cache" / "v00000002").is_dir()
        assert not (tmp_path / "trainer-side").exists()

    arun(go())



def test_a_vision_language_model_s_versions_hold_no_tower_in_the_bucket(
        s3: SeaweedFS, tmp_path: Path) -> None:
    """The tiny Qwen2.5-VL's versions, full and delta, as the trainer publishes them
    (`Trainer.weights`: its frozen vision tower left out): no object in the bucket holds
    a tower tensor, and the receiver rebuilds every trained tensor (docs/vlm.md)."""
    from safetensors.torch import load

    from tests.unit.test_vlm import TOWER, _batch, _cfg, _published
    from trainer import setup
    from trainer.step import optimize

    vlm_dir = init_tiny_model(tmp_path / "tiny-vl", seed=3, hidden_size=64,
                              intermediate_size=128, recipe="tiny-char-qwen2_5_vl")
    s = setup.build(_cfg(vlm_dir, tmp_path / "run"))
    c = _s3_case("file", s3, tmp_path, vlm_dir, full_every=2)
    formats = []
    for v in (1, 2, 3):
        optimize(s.fwd, s.optimizer, _batch(seed=v), s.settings)
        source = _published(s)
        msg = arun(c.publisher.publish(source, version=v, step=v))
        formats.append(msg.format)
        got = read_full(c.receive(msg))
        assert got.keys() == source.keys()
        assert all(torch.equal(got[k], t) for k, t in source.items())
    assert formats == ["safetensors", "delta", "safetensors"]
    shards = [k for k in c.objects() if k.endswith(".safetensors")]
    assert len(shards) >= 3
    for key in shards:
        names = [n.partition("/")[2] or n for n in load(c.get(key))]
        assert names and not any(n.startswith(TOWER) for n in names), key
