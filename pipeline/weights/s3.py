"""The weight store in an S3-compatible bucket (``weights.store = "s3://bucket/prefix"``),
for roles that share no filesystem: AWS S3, SeaweedFS, MinIO, Ceph RGW.

Layout: the directory store's (`pipeline.weights.store`), as objects:
``<prefix>/v<N>/<file>`` and ``<prefix>/v<N>/manifest.json``; an announcement's URI is
``s3://bucket/<prefix>/v<N>``.

Publishing (the trainer): each file is uploaded as it is produced, hashed on the way and
never read back; the manifest goes last. A version is complete once its manifest is
there, and it is announced only after that. Re-publishing a version first deletes its
old manifest, then its other objects. Retention is the directory store's (``keep``,
``keep_from``): an expired version loses its manifest first, then its files.

Receiving (generators, the evaluator): `S3WeightStore.verify` downloads an announced
version into the local cache, ``root`` = ``weights.cache_dir`` (``<cache>/v<N>/``,
written under a temporary name and renamed into place, so processes sharing the cache
never see half a download), checks it exactly as the directory store checks its own
(every file's sha256 and size against the manifest, the manifest's file table against
the announcement, nothing unlisted, the format's layout) and returns that local
directory: engines, vLLM servers included, load from local disk. A cached copy that
still verifies is not downloaded again. A URI other than this store's own for the
version, a missing object, an object larger than its manifest says, an unreachable
endpoint: each raises `WeightError`, as a bad directory does, and the engine keeps its
weights. Old cache entries are pruned like the store.

Client: boto3 (its standard credential chain: ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, the shared
credentials file or ``AWS_SHARED_CREDENTIALS_FILE``, an instance role), never
credentials from the config; ``weights.endpoint_url`` for a non-AWS server (path-style
addressing, checksums only where the API requires them, which S3-compatible servers
accept). `check` is the roles' start-up check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pipeline.bus.schema import WeightsPublished
from pipeline.config import ConfigError
from pipeline.weights.store import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    WeightError,
    WeightStore,
    expired,
    table_sha256,
    tallied,
)

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 120.0


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> (``bucket``, ``a/b/``); the prefix ends with / unless empty."""
    if not url.startswith("s3://"):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


def make_client(endpoint_url: str | None, *, attempts: int = 3,
                connect_timeout_s: float = CONNECT_TIMEOUT_S) -> Any:
    """A boto3 S3 client (thread-safe; credentials from boto3's standard chain)."""
    import boto3
    from botocore.config import Config as BotoConfig

    cfg = BotoConfig(connect_timeout=connect_timeout_s, read_timeout=READ_TIMEOUT_S,
                     retries={"max_attempts": attempts, "mode": "standard"},
                     s3={"addressing_style": "path"} if endpoint_url else None,
                     request_checksum_calculation="when_required",
                     response_checksum_validation="when_required")
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url or None, config=cfg)


@contextlib.contextmanager
def s3_errors(what: str) -> Iterator[None]:
    """botocore's errors as `WeightError` (a missing object says "does not exist")."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        if code in ("404", "NoSuchKey", "NotFound", "NoSuchBucket"):
            raise WeightError(f"{what} does not exist ({code})") from None
        raise WeightError(f"{what}: {e}") from None
    except BotoCoreError as e:
        raise WeightError(f"{what}: {e}") from None


class S3WeightStore(WeightStore):
    """Versions under ``s3://bucket/prefix``; ``root`` is the local cache of downloads."""

    def __init__(self, url: str, *, cache_dir: str | Path, keep: int = 4,
                 endpoint_url: str | None = None, client: Any = None) -> None:
        super().__init__(cache_dir, keep=keep)
        self.url = url.rstrip("/")
        self.bucket, self.prefix = split_url(url)
        self.endpoint_url = endpoint_url or None
        self._client = client
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = make_client(self.endpoint_url)
            return self._client

    @property
    def location(self) -> str:
        return self.url

    def key_for(self, version: int) -> str:
        """The object key prefix of ``version`` (ends with /)."""
        return f"{self.prefix}v{version:08d}/"

    def uri_for(self, version: int) -> str:
        return f"s3://{self.bucket}/{self.key_for(version).rstrip('/')}"

    # ------------------------------------------------------------------ writing
    def commit(self, files: Iterable[tuple[str, bytes]], *, fmt: str, version: int,
               step: int, keep_from: int | None = None) -> WeightsPublished:
        """Upload ``files`` (name, bytes; lazily) under ``v<version>/``, the manifest
        last; then prune (module docstring)."""
        from boto3.s3.transfer import TransferConfig

        key = self.key_for(version)
        what = f"publishing weights v{version} to {self.uri_for(version)}"
        transfer = TransferConfig(multipart_threshold=64 * 2**20, multipart_chunksize=64 * 2**20)
        digests: dict[str, str] = {}
        sizes: dict[str, int] = {}
        self._check()  # the trainer lock's fence (`WeightStore.guard`)
        with s3_errors(what):
            self._delete_version(key)  # a re-publish: the old manifest goes first
            try:
                for name, data in tallied(files, digests, sizes):
                    self.client.upload_fileobj(io.BytesIO(data), self.bucket, key + name,
                                               Config=transfer)
                    del data
                manifest = json.dumps({"version": version, "step": step, "format": fmt,
                                       "files": digests, "bytes": sizes},
                                      indent=1, sort_keys=True).encode()
                self._check()  # the manifest is the commit point
                self.client.put_object(Bucket=self.bucket, Key=key + MANIFEST, Body=manifest)
            except BaseException:
                with contextlib.suppress(Exception):
                    self._delete_version(key)
                raise
        self.prune(version, keep_from)
        return WeightsPublished(version=version, step=step, uri=self.uri_for(version),
                                format=fmt, sha256=table_sha256(digests),
                                nbytes=sum(sizes.values()), t=time.time())

    def clean_temp(self) -> list[Path]:
        """Nothing: the local folder is a download cache other processes share."""
        return []

    def published(self) -> list[int]:
        """The version numbers that have objects under the prefix (complete or not)."""
        out = []
        with s3_errors(f"listing {self.url}"):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix, Delimiter="/")
            for page in pages:
                for p in page.get("CommonPrefixes", []):
                    name = p["Prefix"][len(self.prefix):].rstrip("/")
                    if name.startswith("v") and name[1:].isdigit():
                        out.append(int(name[1:]))
        return sorted(out)

    def prune(self, newest: int, keep_from: int | None = None) -> None:
        """Expired versions leave the bucket (manifest first) and the local cache."""
        for v in self.published():
            if expired(v, newest, self.keep, keep_from):
                with s3_errors(f"pruning {self.uri_for(v)}"):
                    self._delete_version(self.key_for(v))
        self.prune_cache(newest, keep_from)

    def prune_cache(self, newest: int, keep_from: int | None = None) -> None:
        super().prune(newest, keep_from)

    def _delete_version(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=key + MANIFEST)
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=key)
        for page in pages:
            objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if objects:
                self.client.delete_objects(Bucket=self.bucket,
                                           Delete={"Objects": objects, "Quiet": True})

    # ------------------------------------------------------------------ reading
    def verify(self, msg: WeightsPublished) -> Path:
        """The local cache's verified copy of the announced version (module docstring).
        Blocking: download + hashing."""
        if msg.uri != self.uri_for(msg.version):
            raise WeightError(f"weight URI {msg.uri!r} lies outside the weight store "
                              f"{self.url} (v{msg.version} is {self.uri_for(msg.version)})")
        final = self.dir_for(msg.version)
        if final.is_dir():
            with contextlib.suppress(WeightError, OSError):
                return super().verify(dataclasses.replace(msg, uri=final.as_uri()))
        self.root.mkdir(parents=True, exist_ok=True)
        tag = f"{os.getpid()}-{threading.get_ident()}-{uuid.uuid4().hex[:6]}"
        tmp = self.root / f".tmp-v{msg.version:08d}-{tag}"
        try:
            tmp.mkdir()
            self._download(msg, tmp)
            super().verify(dataclasses.replace(msg, uri=tmp.as_uri()))
            if final.exists():  # an older copy that no longer verifies: replace it
                old = self.root / f".old-v{msg.version:08d}-{tag}"
                with contextlib.suppress(OSError):
                    os.replace(final, old)
                shutil.rmtree(old, ignore_errors=True)
            try:
                os.replace(tmp, final)
            except OSError:  # another process put its verified copy there first
                if not final.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        path = super().verify(dataclasses.replace(msg, uri=final.as_uri()))
        self.prune_cache(msg.version)
        return path

    def _download(self, msg: WeightsPublished, into: Path) -> None:
        """The manifest, checked against the announcement, then every file it lists,
        each refused if its object's size is not the manifest's."""
        key, what = self.key_for(msg.version), f"weights v{msg.version}"
        with s3_errors(f"{what}: {self.uri_for(msg.version)}/{MANIFEST}"):
            head = self.client.head_object(Bucket=self.bucket, Key=key + MANIFEST)
            if int(head["ContentLength"]) > MAX_MANIFEST_BYTES:
                raise WeightError(f"{what}: {MANIFEST} is larger than {MAX_MANIFEST_BYTES} "
                                  "bytes")
            body = self.client.get_object(Bucket=self.bucket, Key=key + MANIFEST)["Body"]
            (into / MANIFEST).write_bytes(body.read(MAX_MANIFEST_BYTES + 1))
        _, man = self.manifest(dataclasses.replace(msg, uri=into.as_uri()))
        sizes = man.get("bytes") or {}
        for name in sorted(man["files"]):
            with s3_errors(f"{what}: {self.uri_for(msg.version)}/{name}"):
                size = int(self.client.head_object(Bucket=self.bucket,
                                                   Key=key + name)["ContentLength"])
                if name in sizes and size != sizes[name]:
                    raise WeightError(f"{what}: {name} has {size} bytes, the manifest says "
                                      f"{sizes[name]}")
                self.client.download_file(self.bucket, key + name, str(into / name))


def check(url: str, endpoint_url: str | None, *, write: bool) -> None:
    """Start-up check of an s3:// store, before any role starts: credentials exist, the
    endpoint answers, the bucket exists and can be listed (and, with ``write``, the
    trainer can put and delete an object under the prefix). Raises `ConfigError` naming
    the key at fault (``weights.store`` or ``weights.endpoint_url``)."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError

    bucket, prefix = split_url(url)
    where = (endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
             or os.environ.get("AWS_ENDPOINT_URL") or "AWS")
    if boto3.session.Session().get_credentials() is None:
        raise ConfigError(
            f"weights.store: {url} needs S3 credentials and found none: set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment, or AWS_PROFILE "
            "/ AWS_SHARED_CREDENTIALS_FILE naming a credentials file (never in the config)")
    client = make_client(endpoint_url, attempts=2, connect_timeout_s=3.0)
    step = "reading the bucket"
    try:
        client.head_bucket(Bucket=bucket)
        client.list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1)
        if write:
            step = "writing under the prefix"
            probe = f"{prefix}.sluice-preflight-{uuid.uuid4().hex}"
            client.put_object(Bucket=bucket, Key=probe, Body=b"sluice preflight")
            client.delete_object(Bucket=bucket, Key=probe)
    except ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        if code in ("404", "NoSuchBucket", "NotFound"):
            raise ConfigError(f"weights.store: bucket {bucket!r} does not exist at {where} "
                              "(create it first: sluice never creates buckets)") from None
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            raise ConfigError(f"weights.store: {where} refused {step} of {url} ({code}): "
                              "check the credentials and the bucket's policy") from None
        raise ConfigError(f"weights.store: {step} of {url} at {where} failed: {e}") from None
    except EndpointConnectionError as e:
        key = "weights.endpoint_url" if endpoint_url else "weights.store"
        raise ConfigError(f"{key}: cannot reach the S3 endpoint {where} for {url}: {e}"
                          ) from None
    except BotoCoreError as e:
        key = "weights.endpoint_url" if endpoint_url else "weights.store"
        raise ConfigError(f"{key}: the S3 endpoint {where} did not answer for {url}: {e}"
                          ) from None
