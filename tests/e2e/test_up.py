"""`sluice up` end to end: every role a real process, an embedded Redis, a short run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import ROOT, run_up, up_args

pytestmark = pytest.mark.e2e


def test_sluice_up_short_run_learns_balances_and_exits_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = tmp_path / "e2e.toml"
    cfg.write_text((ROOT / "examples" / "copy.toml").read_text())
    args = up_args(cfg, out, tmp_path / "model", "e2e", "trainer.save_steps=25",
                   "run.max_time_s=300")
    proc, summary = run_up(args, out, tmp_path, 420)
    c = summary["conservation"]
    assert c["balanced"], c
    assert c["cursor"] == c["retired"] + c["in_flight"]
    assert summary["reason"] == "finished" and summary["steps"] == 80
    assert c["by_reason"]["trained"] == 80 * 8
    # learning: the held-out greedy reward of the final weights is at least double the
    # initial weights' (0.020 for this model; typically 0.06-0.15 after 80 steps)
    assert summary["eval_reward_after"] > 2 * summary["eval_reward_before"], summary
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(m["staleness_max"] for m in metrics) <= 1  # max_staleness of copy.toml
    early = sum(m["reward"] for m in metrics[:10]) / 10
    late = sum(m["reward"] for m in metrics[-10:]) / 10
    assert late > early, (early, late)
    assert (out / "reward_curve.png").stat().st_size > 1000
    assert sorted(p.name for p in (out / "checkpoints").iterdir())[-1] == "step-00000080"
    assert "conservation" in proc.stdout and "balanced" in proc.stdout

    # resume the same run directory with more steps: continues from the checkpoint
    args = [a.replace("trainer.max_steps=80", "trainer.max_steps=90") for a in args]
    proc, summary = run_up(args, out, tmp_path, 420)
    assert summary["steps"] == 90 and summary["conservation"]["balanced"], summary
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 91))  # resumed, not restarted
    versions = [m["version"] for m in metrics]
    assert versions == sorted(versions) and len(set(versions)) == 90  # never backwards


def test_sluice_up_learns_the_reverse_task_at_beta_zero(tmp_path: Path) -> None:
    """A second task, with TRL's settings (beta 0, AdamW beta2 0.99, flat groups trained
    at advantage 0): the run stops itself (`up.stop_at`) once the held-out reward is
    2.5x the initial weights' (0.024 -> 0.06; reached after ~100-200 steps when written).
    It waits for that condition, not for a step count that happens to suffice: CI failed
    once at 120 fixed steps (0.037). A regression in learning (loss, advantages, IS, the
    normaliser) never reaches it within 1,500 steps and fails here, in CI."""
    out = tmp_path / "run"
    args = up_args(ROOT / "examples" / "copy.toml", out, tmp_path / "model", "reverse",
                   "task.name=reverse", "trainer.beta=0", "trainer.adam_betas=[0.9,0.99]",
                   "scoring.zero_variance=train", "trainer.max_steps=1500",
                   "up.stop_at=reward>=0.06", "run.max_time_s=420", "up.plot=false")
    proc, summary = run_up(args, out, tmp_path, 540)
    assert summary["reason"] == "stop_at reward>=0.06 reached", summary
    assert summary["conservation"]["balanced"], summary
    assert summary["eval_reward_before"] < 0.03, summary  # so 0.06 is at least a doubling
    assert summary["time_to_target_s"] is not None and summary["step_at_target"] > 0, summary
    assert "time to target        reward>=0.06:" in proc.stdout, proc.stdout


def test_sluice_up_with_two_trainer_ranks_learns_and_passes_the_audit(tmp_path: Path) -> None:
    """The trainer as one torchrun job of 2 FSDP2 ranks (gloo): rank 0 reads and scatters,
    the run learns, and `sluice up`'s audit (run when it stops; a violation fails the
    run) finds every group retired once."""
    out = tmp_path / "run"
    cfg = tmp_path / "e2e.toml"
    cfg.write_text((ROOT / "examples" / "copy.toml").read_text())
    args = up_args(cfg, out, tmp_path / "model", "e2e2", "trainer.save_steps=25",
                   "run.max_time_s=400", "up.trainer_ranks=2", "up.scorers=1")
    proc, summary = run_up(args, out, tmp_path, 520)
    assert summary["reason"] == "finished" and summary["steps"] == 80, summary
    assert summary["conservation"]["balanced"], summary
    assert summary["conservation"]["by_reason"]["trained"] == 80 * 8
    assert summary["eval_reward_after"] > 2 * summary["eval_reward_before"], summary
    assert "ledger audit" in proc.stderr and "640 trained" in proc.stderr, proc.stderr[-2000:]
    log = (out / "logs" / "trainer-0.log").read_text()
    assert "trainer job of 2 ranks" in log, log[-3000:]


def test_sluice_up_reports_trainer_and_eval_metrics_to_trackio(tmp_path: Path) -> None:
    """`sluice up` with run.report_to = ["trackio"] (offline, local SQLite): every trainer
    step lands in the run's trackio store under TRL's names, on the trainer-step axis,
    and the evaluator's results in `<run.name>-eval`."""
    import sqlite3

    pytest.importorskip("trackio")
    out = tmp_path / "run"
    trackio_dir = tmp_path / "trackio"
    args = up_args(ROOT / "examples" / "copy.toml", out, tmp_path / "model", "tracked",
                   "trainer.max_steps=20", 'run.report_to=["trackio"]',
                   "run.tracking_project=e2e", "run.max_time_s=240", "up.plot=false")
    run_up(args, out, tmp_path, 360, {"TRACKIO_DIR": str(trackio_dir), "HF_HUB_OFFLINE": "1"})
    con = sqlite3.connect(trackio_dir / "e2e.db")
    rows = con.execute("SELECT run_name, step, metrics FROM metrics ORDER BY id").fetchall()
    con.close()
    train = [(s, json.loads(m)) for r, s, m in rows if r == "tracked"]
    evals = [(s, json.loads(m)) for r, s, m in rows if r == "tracked-eval"]
    assert [s for s, _ in train] == list(range(1, 21)), [s for s, _ in train]
    assert all({"reward", "rewards/copy_reward/mean", "learning_rate", "num_tokens",
                "sluice/staleness_max"} <= m.keys() for _, m in train)
    assert evals and evals[0][0] == 0 and "eval/pass@1" in evals[0][1], evals


def test_sluice_up_on_a_hub_id_pins_the_snapshot_every_role_loads(tmp_path: Path) -> None:
    """`model.path = org/name` through a real HF cache layout, offline: a BPE tokenizer with
    a chat template and tied embeddings; `sluice up` pins the commit in run.json and every
    role (trainer, generator, scorers, evaluator) runs on it to the end."""
    from tests.helpers import add_hub_snapshot, build_bpe_model

    sha = "c" * 40
    hf_home = tmp_path / "hf"
    add_hub_snapshot(hf_home, "tiny-org/tiny-bpe", build_bpe_model(tmp_path / "bpe"), sha)
    out = tmp_path / "run"
    args = up_args(ROOT / "examples" / "copy.toml", out, Path("tiny-org/tiny-bpe"), "hub",
                   "trainer.max_steps=3", "trainer.groups_per_step=2", "up.scorers=1",
                   "task.heldout=8", "up.plot=false", "run.max_time_s=240")
    _, summary = run_up(args, out, tmp_path, 300, {"HF_HOME": str(hf_home),
                                                  "HF_HUB_OFFLINE": "1"},
                        drop_env=("HF_HUB_CACHE",))
    assert summary["reason"] == "finished" and summary["steps"] == 3, summary
    pin = json.loads((out / "run.json").read_text())["model"]
    assert pin["source"] == "tiny-org/tiny-bpe" and pin["revision"] == sha
    assert pin["local_dir"].endswith(f"snapshots/{sha}")
