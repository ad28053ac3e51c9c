"""Trainer against a real Redis: staleness, dedup, ack-after-step, publish, resume."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import numpy as np
import pytest

from pipeline.bus import control
from pipeline.bus.client import Bus
from pipeline.bus.codec import encode
from pipeline.bus.keys import TRAINERS_GROUP
from pipeline.bus.schema import ScoredGroup, WeightsPublished
from pipeline.config import Config, load_config
from sluice.embedded import EmbeddedRedis
from sluice.monitor import snapshot
from tests.conftest import arun
from tests.helpers import make_group
from trainer.trainer import StaleSampleError, Trainer

pytestmark = pytest.mark.integration


def _cfg(redis_server: EmbeddedRedis, run_name: str, tmp_path: Path, model: Path) -> Config:
    return load_config(None, [
        f"run.name={run_name}", f"run.output_dir={tmp_path / 'out'}",
        f"bus.redis_url={redis_server.url}", "bus.block_ms=50", f"model.path={model}",
        "trainer.groups_per_step=2", "trainer.max_staleness=1", "trainer.max_steps=1",
        "trainer.save_steps=1"])


def _scored(gid: str, version: int) -> bytes:
    g = make_group(gid, version=version)
    rewards = np.array([1.0, 0.5, 0.25, 0.0], dtype=np.float32)
    adv = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-4)
    return encode(ScoredGroup(group=g.for_training(),
                              rewards=rewards, reward_parts={"copy": rewards},
                              advantages=adv.astype(np.float32), scorer="t", t_scored=0.0))


def test_trainer_drops_stale_dedups_trains_acks_publishes_and_resumes(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path,
        tiny_model_dir: Path) -> None:
    cfg = _cfg(redis_server, run_name, tmp_path, tiny_model_dir)

    async def go() -> dict:
        bus = Bus.connect(cfg.redis_url, run_name)
        k = bus.keys
        await bus.ensure_group(k.scored, TRAINERS_GROUP)
        # the bus has seen version 3, announced by an earlier trainer (a version on `state`
        # that no announcement backs is not trusted: pipeline.bus.version_check)
        await control.announce(bus, WeightsPublished(version=3, step=0, uri="file:///x",
                                                     format="safetensors", sha256="0" * 64,
                                                     nbytes=0,
                                                     t=0.0))
        for c in [await bus.admit(100, "g") for _ in range(4)]:
            # admitted groups now live in rollouts...
            await bus.emit(b"placeholder", cursor=c, owner="g")
        # ...and were handed on to `scored`: v2 stale at version 4, then a duplicate
        await bus.r.xgroup_create(k.rollouts, "scorers", id="0")
        await bus.r.xreadgroup("scorers", "s", {k.rollouts: ">"})
        ids = [e[0] for e in (await bus.r.xrange(k.rollouts))]
        await bus.r.xack(k.rollouts, "scorers", *ids)
        for gid, v in (("0:1", 2), ("0:2", 4), ("0:2", 4), ("0:3", 3)):
            await bus.xadd(k.scored, _scored(gid, v))
        tr = Trainer(cfg)
        await tr.run(asyncio.Event())
        out = {"snap": await snapshot(bus), "latest": await control.latest(bus),
               "finished": await control.finished(bus), "trainer": tr.info()}
        await bus.close()
        return out

    out = arun(go())
    c = out["snap"]["conservation"]
    assert out["trainer"]["step"] == 1 and out["trainer"]["version"] == 5
    assert c["by_reason"] == {"trained": 2, "filtered": 0, "stale": 1, "dead": 0}
    assert out["trainer"]["duplicates"] == 1
    # the duplicate entry was acked without retiring; the 4th admitted group never came
    assert c["cursor"] == 4 and c["retired"] == 3 and c["in_flight"] == 0
    assert not c["balanced"]  # one admitted group was duplicated instead of delivered
    # version never moves backwards: bus had 3, trainer announced 4 at start, 5 after step
    assert out["latest"].version == 5 and out["snap"]["state"]["version"] == 5
    assert out["finished"] is not None and out["finished"].reason == "max_steps"
    metrics = [json.loads(x) for x in (cfg.output_path / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and metrics[0]["groups"] == 2 and metrics[0]["dropped_stale"] == 1
    assert metrics[0]["staleness_max"] <= 1
    m = metrics[0]  # TRL's step figures (docs/metrics.md); no MFU: a CPU has no known peak
    assert m["perf/fwd_bwd_s"] > 0 and m["perf/step_flops"] > 0
    assert m["batch/rows"] >= 1 and 0 < m["batch/row_fill_frac"] <= 1
    assert "perf/mfu_fwd_bwd" not in m
    assert (cfg.output_path / "checkpoints" / "step-00000001" / "meta.json").exists()

    # resume: a second trainer continues from the checkpoint at a newer version
    cfg2 = load_config(None, [*_overrides(cfg), "trainer.max_steps=1"])

    async def again() -> dict:
        tr = Trainer(cfg2)
        bus = Bus.connect(cfg2.redis_url, run_name)
        await tr.resume(bus)
        st = await bus.state()
        await bus.close()
        return {"step": tr.state.step, "version": tr.state.version, "bus": st["version"],
                "trained": list(tr.reader.trained)}

    res = arun(again())
    assert res["step"] == 1 and res["version"] == 6 and res["bus"] == 6
    assert sorted(res["trained"]) == ["0:2", "0:3"]


def _overrides(cfg: Config) -> list[str]:
    return [f"run.name={cfg.run.name}", f"run.output_dir={cfg.run.output_dir}",
            f"bus.redis_url={cfg.bus.redis_url}", "bus.block_ms=50",
            f"model.path={cfg.model.path}", "trainer.groups_per_step=2",
            "trainer.max_staleness=1"]


def test_train_step_refuses_a_stale_sample_that_slipped_through(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path,
        tiny_model_dir: Path) -> None:
    from pipeline.bus.codec import decode

    tr = Trainer(_cfg(redis_server, run_name, tmp_path, tiny_model_dir))
    tr.state.version = 5
    sg = decode(_scored("0:9", 1))
    assert isinstance(sg, ScoredGroup)
    with pytest.raises(StaleSampleError, match="stale"):
        tr.train_step([sg])


def test_adaptive_entropy_control_steps_logs_and_survives_a_resume(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path,
        tiny_model_dir: Path) -> None:
    """The trainer applies no bonus before it has measured an entropy, then raises the
    coefficient by delta each step its entropy is under the (here unreachable) target,
    and a trainer resumed from the checkpoint continues from that coefficient."""
    from pipeline.bus.codec import decode

    sets = ["trainer.adaptive_entropy=true", "trainer.entropy_coef=0.01",
            "trainer.entropy_target=100", "trainer.entropy_coef_delta=0.002"]
    cfg = load_config(None, [*_overrides(_cfg(redis_server, run_name, tmp_path,
                                                tiny_model_dir)), *sets])
    tr = Trainer(cfg)
    groups = [decode(_scored(f"0:{i}", 0)) for i in range(2)]
    first = tr.train_step(groups)  # type: ignore[arg-type]
    second = tr.train_step(groups)  # type: ignore[arg-type]
    assert first["entropy_coef_applied"] == 0.0 and first["entropy_coef"] == pytest.approx(0.012)
    assert second["entropy_coef_applied"] == pytest.approx(0.012)
    assert second["entropy_coef"] == pytest.approx(0.014)
    assert math.isfinite(second["entropy"]) and second["entropy"] > 0
    tr.state.step = 2
    tr.checkpoint()
    again = Trainer(cfg)
    assert again.load_checkpoint() is not None
    assert again.entropy.coef == pytest.approx(0.014)
    assert again.entropy.applied() == pytest.approx(0.014)  # its last entropy came too
