"""A real trainer and evaluator (`sluice train`, `sluice eval` processes) logging to trackio
offline: what lands in trackio's local SQLite store has TRL's names, the trainer steps,
the same values as metrics.jsonl, the eval results, and the config."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from pipeline.bus.client import Bus
from pipeline.bus.codec import encode
from pipeline.bus.keys import TRAINERS_GROUP
from pipeline.bus.schema import ScoredGroup
from pipeline.tracking import trainer_metrics
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun
from tests.helpers import make_group, run_header, spawn_role, write_config

pytest.importorskip("trackio")
pytestmark = pytest.mark.integration


def _trackio_rows(trackio_dir: Path, project: str) -> tuple[dict[str, list], dict[str, dict]]:
    """{run name: [(step, metrics)]} and {run name: config} from trackio's SQLite file
    (read directly: trackio fixes its directory when first imported, so this process
    never imports it)."""
    con = sqlite3.connect(trackio_dir / f"{project}.db")
    try:
        logs: dict[str, list] = {}
        for run, step, metrics in con.execute(
                "SELECT run_name, step, metrics FROM metrics ORDER BY id"):
            logs.setdefault(run, []).append((step, json.loads(metrics)))
        configs = {run: json.loads(c) for run, c in
                   con.execute("SELECT run_name, config FROM configs")}
    finally:
        con.close()
    return logs, configs


def test_trainer_and_evaluator_log_trl_names_on_the_trainer_step_to_trackio(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path, tiny_model_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    trackio_dir = tmp_path / "trackio"
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_dir))  # inherited by the roles
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "run.toml", run_header(run_name, out, redis_server.url)
                       + f'[model]\npath = "{tiny_model_dir}"\n'
                       '[task]\nheldout = 4\n'
                       '[trainer]\ngroups_per_step = 2\nmax_steps = 2\nsave_steps = 1\n')
    sets = ['run.report_to=["trackio"]', "run.tracking_project=sluice-test", "bus.block_ms=50"]

    async def feed() -> None:
        bus = Bus.connect(redis_server.url, run_name)
        await bus.ensure_group(bus.keys.scored, TRAINERS_GROUP)
        for i in range(4):
            c = await bus.admit(100, "g")
            await bus.emit(b"placeholder", cursor=c, owner="g")
            rewards = np.array([1.0, 0.5, 0.25, 0.0], dtype=np.float32)
            adv = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-4)
            await bus.xadd(bus.keys.scored, encode(ScoredGroup(
                group=make_group(f"0:{i}").for_training(),
                rewards=rewards, reward_parts={"copy": rewards},
                advantages=adv.astype(np.float32), scorer="t", t_scored=0.0)))
        await bus.close()

    arun(feed())
    logs = tmp_path / "logs"
    logs.mkdir()
    out.mkdir()  # as `sluice up` does: a lone evaluator cannot write eval.jsonl without it
    trainer = spawn_role("train", cfg, *sets, log=logs / "trainer.log")
    evaluator = spawn_role("eval", cfg, *sets, log=logs / "eval.log")
    try:
        rc = (trainer.wait(timeout=240), evaluator.wait(timeout=240))
    finally:
        for p in (trainer, evaluator):
            if p.poll() is None:
                p.kill()
                p.wait()
    text = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in logs.iterdir())
    assert rc == (0, 0), text

    tracked, configs = _trackio_rows(trackio_dir, "sluice-test")
    assert set(tracked) == {run_name, f"{run_name}-eval"}, (tracked.keys(), text)
    train = tracked[run_name]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s for s, _ in train] == [r["step"] for r in rows] == [1, 2]  # trainer steps
    for (_, got), row in zip(train, rows, strict=True):
        want = trainer_metrics(row)
        assert got.keys() == want.keys()
        assert all(got[k] == pytest.approx(want[k]) for k in want)  # finite, so equal
    first = train[0][1]
    for name in ("reward", "reward_std", "rewards/copy/mean", "learning_rate", "grad_norm",
                 "loss", "entropy", "clip_ratio/region_mean", "num_tokens",
                 "completions/mean_length", "sluice/version", "sluice/staleness_max"):
        assert name in first, name
    assert first["reward"] == pytest.approx(0.4375)  # mean of 1, .5, .25, 0
    assert 0 < first["num_tokens"] < train[1][1]["num_tokens"]  # cumulative
    assert "lr" not in first and "reward/copy" not in first and "step" not in first

    evals = tracked[f"{run_name}-eval"]
    assert evals[0][0] == 0 and evals[-1][0] == 2, evals  # initial weights, final step
    assert all(set(m) >= {"eval/pass@1", "eval/reward", "sluice/version"}
               for _, m in evals)
    eval_rows = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [m["eval/pass@1"] for _, m in evals] == [r["pass@1"] for r in eval_rows]

    # the resolved config, once per tracker run
    assert configs[run_name]["trainer"]["max_steps"] == 2
    assert configs[run_name]["run"]["report_to"] == ["trackio"]
    assert configs[f"{run_name}-eval"]["task"]["heldout"] == 4
