"""benchmarks/vs_trl_real.py and trl_real.py without running either side: the evaluation
marks, weight snapshots that outlive the store's pruning, the sluice clock's start read
from a generator log, and the example config mapped onto TRL's own GRPOConfig."""

from __future__ import annotations

import os
import shutil
from datetime import datetime
from pathlib import Path

import pytest

from benchmarks.vs_trl_real import CONFIG, generator_start, marks, snapshot
from pipeline.config import load_config


def test_marks_are_fixed_instants_ending_at_the_budget() -> None:
    assert marks(1200, 200) == [0, 200, 400, 600, 800, 1000, 1200]
    assert marks(180, 200) == [0, 180]  # the budget itself is always a mark
    assert marks(450, 200) == [0, 200, 400, 450]


def _version(store: Path, v: int, payload: bytes) -> None:
    d = store / f"v{v:08d}"
    d.mkdir(parents=True)
    (d / "model-00001-of-00001.safetensors").write_bytes(payload)
    (d / "manifest.json").write_text("{}")


def test_snapshot_links_the_newest_version_and_outlives_pruning(tmp_path: Path) -> None:
    store, into = tmp_path / "weights", tmp_path / "snaps"
    into.mkdir()
    assert snapshot(store, into) is None  # no store yet
    _version(store, 1, b"one")
    _version(store, 2, b"two")
    (store / ".tmp-v00000003-99").mkdir()  # being written: not a version yet
    version, folder = snapshot(store, into)
    assert version == 2 and folder == into / "v00000002"
    shard = folder / "model-00001-of-00001.safetensors"
    assert os.stat(shard).st_ino == os.stat(store / "v00000002" / shard.name).st_ino
    assert snapshot(store, into) == (2, folder)  # the same version is linked once
    shutil.rmtree(store / "v00000002")  # the store prunes it
    assert shard.read_bytes() == b"two"


def test_the_sluice_clock_starts_at_the_generators_log_line(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    assert generator_start(tmp_path) is None
    (logs / "generator-0.log").write_text(
        "sluice: resuming with changed config: generation.vllm.urls\n"
        "2026-12-04 16:45:10,377 generator[8352] INFO sluice.metrics: generator metrics on x\n"
        "2026-12-04 16:45:28,592 generator[8352] INFO sluice.generator: generator "
        "generator/generator-0 started (engine vllm)\n")
    want = datetime(2026, 12, 4, 16, 45, 28, 592000).timestamp()
    assert generator_start(tmp_path) == pytest.approx(want)


def test_trl_gets_the_example_settings_under_its_own_names(tmp_path: Path) -> None:
    trl = pytest.importorskip("trl")
    from benchmarks.trl_real import grpo_args

    cfg = load_config(CONFIG, ["trainer.epsilon_high=0.28"])
    args = trl.GRPOConfig(**grpo_args(cfg, tmp_path, seed=3, generation="generate",
                                      log_every=1))
    g, t = cfg.generation, cfg.trainer
    assert args.per_device_train_batch_size == t.groups_per_step * g.num_generations
    assert args.num_generations == g.num_generations
    assert args.max_completion_length == g.max_new_tokens
    assert args.learning_rate == t.lr and args.lr_scheduler_type == t.lr_scheduler
    assert (args.adam_beta1, args.adam_beta2) == tuple(t.adam_betas)
    assert args.max_grad_norm == t.max_grad_norm and args.beta == t.beta
    assert args.loss_type == t.loss_type and args.epsilon_high == 0.28
    assert args.temperature == g.temperature and args.seed == 3
    assert args.reward_weights == [r.weight for r in cfg.scoring.rewards]
    assert args.scale_rewards == cfg.scoring.scale_rewards
    assert not args.use_vllm and not args.use_transformers_continuous_batching
