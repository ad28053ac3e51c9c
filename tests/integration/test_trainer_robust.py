"""The trainer against bad steps, with a real Redis: a group whose forward raises goes to
dlq (the others are trained), a batch that keeps failing reaches dlq after
``max_deliveries`` instead of crash-looping, a non-finite step is skipped and never
published, the second staleness check reads the per-token versions, the LR schedule runs.

Faults are injected at the model (a forward hook on the input embeddings that fires on
a poisoned token id); the stream, the delivery counts, the dead-letter script and the
trainer's loop are the real ones.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.bus import control
from pipeline.bus.client import Bus
from pipeline.bus.codec import decode, encode
from pipeline.bus.keys import TRAINERS_GROUP
from pipeline.bus.schema import ScoredGroup
from pipeline.config import Config, load_config
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun
from tests.helpers import make_group
from trainer.trainer import StaleSampleError, Trainer

pytestmark = pytest.mark.integration

POISON = 75  # a token id no healthy test group contains


def _cfg(redis_server: EmbeddedRedis, run_name: str, tmp_path: Path, model: Path,
         *extra: str) -> Config:
    return load_config(None, [
        f"run.name={run_name}", f"run.output_dir={tmp_path / 'out'}",
        f"bus.redis_url={redis_server.url}", "bus.block_ms=50", f"model.path={model}",
        "trainer.groups_per_step=2", "trainer.max_staleness=1", "trainer.max_steps=2",
        "trainer.save_steps=100", "bus.max_deliveries=2", *extra])


def _scored(gid: str, poisoned: bool = False, version: int = 0) -> ScoredGroup:
    g = make_group(gid, version=version)
    if poisoned:
        g.prompt_ids = np.append(g.prompt_ids, np.int32(POISON))
    rewards = np.array([1.0, 0.5, 0.25, 0.0], dtype=np.float32)
    adv = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-4)
    return ScoredGroup(group=g.for_training(), rewards=rewards, reward_parts={"copy": rewards},
                       advantages=adv.astype(np.float32), scorer="t", t_scored=0.0)


def _hook(tr: Trainer, fault: Callable[[torch.Tensor, torch.Tensor], Any]) -> None:
    """Call ``fault(input_ids, embeddings)`` inside every forward of the policy."""
    emb = tr.model.get_input_embeddings()
    emb.register_forward_hook(lambda _m, args, out: fault(args[0], out))


async def _run(cfg: Config, groups: list[ScoredGroup], fault: Callable[..., Any],
               until: Callable[[Trainer, Bus], Any]) -> dict[str, Any]:
    """Put ``groups`` on ``scored`` (each admitted), run the trainer until ``until``."""
    bus = Bus.connect(cfg.redis_url, cfg.run.name)
    k = bus.keys
    await bus.ensure_group(k.scored, TRAINERS_GROUP)
    for _ in groups:  # admitted groups, as the gate counts them
        await bus.admit(100, "g")
    ids = [await bus.xadd(k.scored, encode(g)) for g in groups]
    tr = Trainer(cfg)
    _hook(tr, fault)
    stop = asyncio.Event()
    task = asyncio.create_task(tr.run(stop))

    async def watch() -> None:
        while not await until(tr, bus):
            assert not task.done(), task.exception()
            await asyncio.sleep(0.05)

    try:
        await asyncio.wait_for(watch(), 120)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    dlq = await bus.r.xrange(k.dlq)
    out = {"tr": tr, "ids": ids, "state": await bus.state(),
           "dlq": {f[b"src_id"].decode(): f[b"reason"].decode() for _, f in dlq},
           "latest": await control.latest(bus)}
    await bus.close()
    return out


def _poisoned(ids: torch.Tensor) -> bool:
    return bool((ids == POISON).any())


def test_a_group_whose_forward_raises_is_dead_lettered_and_the_rest_trained(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path,
        tiny_model_dir: Path) -> None:
    def fault(ids: torch.Tensor, out: torch.Tensor) -> None:
        if _poisoned(ids):
            raise RuntimeError("poisoned token in the forward")

    cfg = _cfg(redis_server, run_name, tmp_path, tiny_model_dir, "trainer.max_steps=2")
    groups = [_scored("0:1"), _scored("0:2", poisoned=True), _scored("0:3"), _scored("0:4"),
              _scored("0:5")]

    async def done(tr: Trainer, bus: Bus) -> bool:
        return tr.state.step >= 2

    out = arun(_run(cfg, groups, fault, done))
    tr = out["tr"]
    assert tr.counts["failed_steps"] >= 1 and tr.counts["dead"] == 1
    assert list(out["dlq"]) == [out["ids"][1]]
    assert "poisoned token" in out["dlq"][out["ids"][1]]
    assert out["state"]["retired:dead"] == 1 and out["state"]["retired:trained"] == 4


def test_a_batch_that_keeps_failing_reaches_dlq_after_max_deliveries(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path,
        tiny_model_dir: Path) -> None:
    def fault(ids: torch.Tensor, out: torch.Tensor) -> None:
        if ids.shape[0] * ids.shape[1] > 60:  # the whole step fails, no group alone does
            raise RuntimeError("the whole batch fails (simulated)")

    cfg = _cfg(redis_server, run_name, tmp_path, tiny_model_dir)

    async def settled(tr: Trainer, bus: Bus) -> bool:
        return tr.counts["dead"] >= 2

    out = arun(_run(cfg, [_scored("0:1"), _scored("0:2")], fault, settled))
    tr = out["tr"]
    assert tr.counts["failed_steps"] >= 2 and tr.state.step == 0
    assert set(out["dlq"]) == set(out["ids"])
    assert all("delivered 3 times" in r for r in out["dlq"].values()), out["dlq"]
    assert out["state"]["retired:dead"] == 2


def test_a_non_finite_step_is_skipped_never_published_and_dead_lettered(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path,
        tiny_model_dir: Path) -> None:
    def fault(ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
        return out * float("nan") if _poisoned(ids) else None

    cfg = _cfg(redis_server, run_name, tmp_path, tiny_model_dir, "trainer.max_steps=1")
    groups = [_scored("0:1", poisoned=True), _scored("0:2"), _scored("0:3"), _scored("0:4")]

    async def done(tr: Trainer, bus: Bus) -> bool:
        return tr.state.step >= 1

    out = arun(_run(cfg, groups, fault, done))
    tr = out["tr"]
    assert tr.counts["skipped_steps"] == 1 and tr.state.step == 1
    assert set(out["dlq"]) == set(out["ids"][:2])
    assert all("non-finite" in r for r in out["dlq"].values())
    # v0 at start, v1 after the one real step: the skipped step published nothing
    assert out["latest"].version == tr.state.version == 1
    assert out["state"]["retired:trained"] == 2
    for p in tr.model.parameters():
        assert torch.isfinite(p).all()


def test_second_staleness_check_reads_the_per_token_versions(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path,
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tr = Trainer(_cfg(redis_server, run_name, tmp_path, tiny_model_dir))
    tr.state.version = 5
    sg = decode(encode(_scored("0:9", version=4)))
    old = copy.deepcopy(sg)
    old.group.rollouts[0].versions[:] = 1  # one rollout sampled 4 versions ago
    monkeypatch.setattr(Trainer, "is_stale", lambda self, g: False)  # the first check broken
    tr.train_step([sg])  # fresh tokens: trained
    with pytest.raises(StaleSampleError, match="4 versions old"):
        tr.train_step([old])


def test_learning_rate_follows_the_schedule(redis_server: EmbeddedRedis, run_name: str,
                                            tmp_path: Path, tiny_model_dir: Path) -> None:
    tr = Trainer(_cfg(redis_server, run_name, tmp_path, tiny_model_dir,
                      "trainer.lr_scheduler=linear", "trainer.warmup_steps=2",
                      "trainer.max_steps=4", "trainer.lr=1e-3"))
    lrs = [tr.train_step([_scored(f"0:{i}")])["lr"] for i in range(4)]
    assert lrs == pytest.approx([5e-4, 1e-3, 5e-4, 0.0])
