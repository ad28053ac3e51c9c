"""A LoRA trainer against a real Redis: adapter announcements, generator-side load, resume."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from pipeline.bus import control
from pipeline.bus.client import Bus
from pipeline.bus.keys import TRAINERS_GROUP
from pipeline.config import Config, load_config
from pipeline.model import adapter_state, load_policy
from pipeline.weights import ADAPTER_FILE, LoraTransport
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun
from tests.integration.test_trainer import _scored
from trainer.trainer import Trainer
from workers.engines.transformers import TransformersEngine

pytestmark = pytest.mark.integration


def _cfg(redis_server: EmbeddedRedis, run_name: str, tmp_path: Path, model: Path,
         max_steps: int) -> Config:
    return load_config(None, [
        f"run.name={run_name}", f"run.output_dir={tmp_path / 'out'}",
        f"bus.redis_url={redis_server.url}", "bus.block_ms=50", f"model.path={model}",
        "model.lora.rank=4", "trainer.lr=0.01", "trainer.beta=0.05",
        "trainer.groups_per_step=2", "trainer.max_staleness=1",
        f"trainer.max_steps={max_steps}", "trainer.save_steps=1"])


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lora_trainer_announces_adapters_that_engines_load_and_resumes(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path,
        tiny_model_dir: Path) -> None:
    cfg = _cfg(redis_server, run_name, tmp_path, tiny_model_dir, max_steps=1)

    async def go() -> tuple[Trainer, object]:
        bus = Bus.connect(cfg.redis_url, run_name)
        await bus.ensure_group(bus.keys.scored, TRAINERS_GROUP)
        for gid in ("0:1", "0:2"):
            await bus.xadd(bus.keys.scored, _scored(gid, 0))
        tr = Trainer(cfg)
        await tr.run(asyncio.Event())
        latest = await control.latest(bus)
        await bus.close()
        return tr, latest

    tr, msg = arun(go())
    assert tr.state.step == 1 and tr.state.version == 1
    assert msg is not None and (msg.version, msg.format) == (1, "lora")
    store = LoraTransport(cfg.output_path / "weights")
    assert (store.store.dir_for(0) / ADAPTER_FILE).is_file()  # the initial version too
    assert not list(store.store.dir_for(1).glob("model*.safetensors"))

    # a generator's engine (same config) follows the announcement to the trainer's adapter
    model, tok = load_policy(cfg)
    eng = TransformersEngine(model, tok)
    assert arun(eng.load_weights(arun(store.receive(msg)), msg.version, msg.format))
    trained = adapter_state(tr.model)
    assert _same(adapter_state(eng.model), trained)
    assert not _same(adapter_state(load_policy(cfg)[0]), trained)

    # resume: the adapter comes back from the checkpoint, the next version is announced
    cfg2 = _cfg(redis_server, run_name, tmp_path, tiny_model_dir, max_steps=2)

    async def again() -> tuple[Trainer, object]:
        tr2 = Trainer(cfg2)
        bus = Bus.connect(cfg2.redis_url, run_name)
        await tr2.resume(bus)
        latest = await control.latest(bus)
        await bus.close()
        return tr2, latest

    tr2, msg2 = arun(again())
    assert tr2.state.step == 1 and tr2.state.version == 2
    assert msg2 is not None and (msg2.version, msg2.format) == (2, "lora")
    assert _same(adapter_state(tr2.model), trained)
    assert _same(store.load(msg2), trained)
