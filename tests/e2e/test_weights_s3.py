"""Weights across machines: a run whose generator and evaluator share no disk with the
trainer, only a bucket (SeaweedFS) and the Redis bus.

Each side has its own folder (its model copy, its config file, its ``run.output_dir``);
the trainer publishes to ``s3://<bucket>/run`` with deltas (``weights.full_every = 3``),
the generator and the evaluator download every version into their own cache, verify
it there, rebuild the deltas and load them. The run (80 steps at lr 1e-3, as `sluice
up`'s end-to-end test) ends by itself, every role exiting cleanly on the trainer's
`RunFinished`; it must have learned the copy task (the evaluator's held-out reward of the
final version at least double the initial weights', the trainer's reward rising) and the
ledgers of all sides together must pass the audit. Credentials reach the roles through
their environment only.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipeline.bus.audit import audit, live_view, pending_intents
from pipeline.bus.client import Bus
from pipeline.bus.ledger import read_ledgers
from pipeline.ports import free_port
from sluice.embedded import EmbeddedRedis
from tests.helpers import ROOT, wait_for
from tests.seaweed import SeaweedFS

pytestmark = pytest.mark.e2e

CONFIG = """
[run]
name = "{run}"
output_dir = "{out}"
[bus]
redis_url = "{redis}"
block_ms = 200
heartbeat_s = 0.5
[model]
path = "{model}"
init = ""
[task]
name = "copy"
heldout = 64
[generation]
num_generations = 8
max_new_tokens = 8
batch_groups = 8
threads = 1
[scoring]
rewards = [{{ fn = "workers.tasks.rewards:copy_reward" }}]
[trainer]
groups_per_step = 8
max_staleness = 1
lr = 1e-3
max_steps = 80
save_steps = 1000
threads = 1
[eval]
every_s = 3
[weights]
store = "s3://{bucket}/run"
endpoint_url = "{endpoint}"
full_every = 3
"""


class Side:
    """One machine's share of the run: its folder, model copy, config and processes."""

    def __init__(self, root: Path, name: str, model: Path, **fmt: str) -> None:
        self.dir = root / name
        self.dir.mkdir(parents=True)
        shutil.copytree(model, self.dir / "model")
        self.out = self.dir / "out"
        self.config = self.dir / "run.toml"
        self.config.write_text(CONFIG.format(out=self.out, model=self.dir / "model", **fmt))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, role: str, name: str, env: dict[str, str]) -> None:
        log = self.dir / f"{name}.log"
        with open(log, "ab") as f:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "sluice.cli", role, str(self.config),
                 "--name", name], cwd=self.dir, env=env, stdout=f, stderr=subprocess.STDOUT)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}"
                         for p in sorted(self.dir.glob("*.log")))


def _env(server: SeaweedFS, tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    return {**env, **server.env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp / "none"),
            "AWS_CONFIG_FILE": str(tmp / "none")}


def _evals(side: Side) -> list[dict[str, Any]]:
    path = side.out / "eval.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_generators_without_shared_disk_learn_through_the_bucket_and_audit_clean(
        seaweedfs: SeaweedFS, tmp_path: Path, tiny_model_dir: Path) -> None:
    redis = EmbeddedRedis(tmp_path / "redis", port=free_port(), appendonly=False)
    redis.start()
    bucket = seaweedfs.bucket()
    fmt = {"run": "s3e2e", "redis": redis.url, "bucket": bucket,
           "endpoint": seaweedfs.endpoint}
    trainer_side = Side(tmp_path, "trainer-machine", tiny_model_dir, **fmt)
    gen_side = Side(tmp_path, "generator-machine", tiny_model_dir, **fmt)
    sides = (trainer_side, gen_side)
    env = _env(seaweedfs, tmp_path)
    try:
        trainer_side.start("train", "trainer", env)
        trainer_side.start("score", "s0", env)
        gen_side.start("generate", "g0", env)
        gen_side.start("eval", "evaluator", env)

        def codes() -> dict[str, int | None]:
            return {n: p.poll() for s in sides for n, p in s.procs.items()}

        def finished() -> bool:
            bad = {n: c for n, c in codes().items() if c not in (None, 0)}
            assert not bad, f"{bad}\n" + "\n".join(s.logs() for s in sides)
            return all(c == 0 for c in codes().values())

        wait_for(finished, 480, lambda: f"every role to finish the run: {codes()}\n"
                 + "\n".join(s.logs() for s in sides), interval_s=1.0)

        rows = [r for s in sides for r in read_ledgers(s.out)]

        async def view() -> Any:
            bus = Bus.connect(redis.url, "s3e2e")
            try:
                return await live_view(bus, pending_intents(rows))
            finally:
                await bus.close()

        report = audit(trainer_side.out, live=asyncio.run(view()), num_generations=8,
                       rows=rows)
        assert report.ok, report.summary()
        assert report.trained == 80 * 8, report.summary()
    finally:
        for s in sides:
            for p in s.procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        redis.stop()
    evals = _evals(gen_side)
    assert evals[0]["version"] == 0 and evals[-1]["version"] >= 79, evals
    assert evals[-1]["reward"] > 2 * evals[0]["reward"], evals
    metrics = [json.loads(x) for x in (trainer_side.out / "metrics.jsonl").read_text()
               .splitlines()]
    assert len(metrics) == 80
    early = sum(m["reward"] for m in metrics[:10]) / 10
    late = sum(m["reward"] for m in metrics[-10:]) / 10
    assert late > early, (early, late)
    # nothing crossed but the bucket: the trainer side has no cache, the generator side
    # no store; the generator side rebuilt deltas from what it downloaded
    assert not (trainer_side.out / "weights").exists()
    assert not (trainer_side.out / "weights-cache").exists()
    assert not (gen_side.out / "weights").exists()
    cache = gen_side.out / "weights-cache"
    assert any(p.name.startswith("v") for p in cache.iterdir()), list(cache.iterdir())
    downloaded = [json.loads((p / "manifest.json").read_text())["format"]
                  for p in cache.glob("v*")]
    assert "delta" in downloaded and "safetensors" in downloaded, downloaded
    keys = [o["Key"] for o in seaweedfs.client().list_objects_v2(
        Bucket=bucket, Prefix="run/").get("Contents", [])]
    assert any(k.endswith("/delta.json") for k in keys), keys
