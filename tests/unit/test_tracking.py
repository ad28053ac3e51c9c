"""Experiment tracking: TRL's metric names, the start-time library check, and a backend
that raises being dropped without stopping the role (`pipeline.tracking`)."""

from __future__ import annotations

import importlib.util
import logging
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.bus.schema import ScoredGroup
from pipeline.config import ConfigError, load_config
from pipeline.tracking import (
    TRL_NAMES,
    Tracker,
    Trackers,
    check_report_to,
    eval_metrics,
    run_name,
    trainer_metrics,
)
from sluice import cli
from tests.helpers import make_group
from trainer.stats import rollout_stats, step_tokens

ROW: dict[str, Any] = {
    "step": 7, "version": 8, "t": 12.5, "reward": 0.5, "reward_std": 0.25, "samples": 16,
    "groups": 2, "rollout_wait_s": 0.1, "step_time_s": 0.2, "samples_per_s": 50.0,
    "tokens_per_s": 400.0, "dropped_stale": 1, "duplicates": 0, "num_tokens": 1234,
    "completions/mean_length": 4.5, "frac_reward_zero_std": 0.5,
    "reward/copy_reward": 0.75, "reward/format": math.nan, "tokens": 60, "lr": 1e-4,
    "staleness_mean": 0.5, "staleness_max": 1.0, "candidates/missing_frac": 0.0,
    "clip_ratio/low_mean": 0.01, "clip_ratio/high_mean": 0.02,
    "clip_ratio/region_mean": 0.03, "is_ratio/min": 0.9, "is_ratio/mean": 1.0,
    "is_ratio/max": 1.1, "logprob_diff/mean_abs": 0.05, "kl": 0.0, "entropy": 2.0,
    "loss": -0.1, "grad_norm": 0.7, "skipped": 0.0, "micro_batches": 1.0, "filtered": 3,
    "reward/copy_reward/std": 0.25, "perf/mfu_fwd_bwd": 0.4, "perf/fwd_bwd_s": 1.5,
    "batch/row_fill_frac": 0.9, "sample/forwarded_tokens_mean": 30.0,
    "sampling/sampler_mass": 0.95, "note": "not a number"}


def test_trainer_metrics_use_trl_names_and_put_the_rest_under_sluice() -> None:
    m = trainer_metrics(ROW)
    assert m["learning_rate"] == 1e-4 and m["grad_norm"] == 0.7 and m["loss"] == -0.1
    assert m["rewards/copy_reward/mean"] == 0.75 and m["rewards/copy_reward/std"] == 0.25
    assert m["perf/mfu_fwd_bwd"] == 0.4 and m["perf/fwd_bwd_s"] == 1.5  # TRL's own names
    assert m["batch/row_fill_frac"] == 0.9 and m["sample/forwarded_tokens_mean"] == 30.0
    assert m["sampling/sampler_mass"] == 0.95
    assert m["sampling/importance_sampling_ratio/mean"] == 1.0
    assert m["sampling/sampling_logp_difference/mean"] == 0.05
    assert m["clip_ratio/region_mean"] == 0.03 and m["num_tokens"] == 1234
    assert m["sluice/version"] == 8 and m["sluice/staleness_max"] == 1.0
    assert m["sluice/filtered"] == 3 and m["sluice/tokens"] == 60
    # the axis is not a metric; NaN and strings are left out; sluice's raw names are gone
    assert "step" not in m and "sluice/step" not in m
    assert "rewards/format/mean" not in m and "sluice/note" not in m
    assert not {"lr", "is_ratio/mean", "reward/copy_reward", "version"} & m.keys()
    # every numeric key of the row went somewhere, and no two keys to one name
    assert len(m) == sum(isinstance(v, int | float) and math.isfinite(v)
                         for k, v in ROW.items() if k != "step")
    assert len(set(TRL_NAMES.values())) == len(TRL_NAMES)


def test_trl_names_are_names_trl_logs() -> None:
    """Each target of the table appears as a metric key in TRL's own GRPOTrainer (or
    transformers' Trainer: loss, grad_norm, learning_rate), so dashboards line up."""
    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("trl not installed")
    src = (Path(spec.submodule_search_locations[0]) / "trainer" / "grpo_trainer.py").read_text()
    from_hf_trainer = {"loss", "grad_norm", "learning_rate"}
    missing = [n for n in TRL_NAMES.values()
               if n not in from_hf_trainer and f'_metrics[mode]["{n}"]' not in src]
    assert not missing, missing
    assert '_metrics[mode][f"rewards/{reward_func_name}/mean"]' in src


def test_eval_metrics_go_under_eval() -> None:
    row = {"version": 3, "step": 40, "t": 1.0, "ts": 2.0, "n": 256, "pass@1": 0.25,
           "reward": 0.5}
    assert eval_metrics(row) == {"eval/pass@1": 0.25, "eval/reward": 0.5,
                                 "sluice/version": 3}


def test_rollout_stats_follow_trl_definitions() -> None:
    short = make_group("0:1", texts=("1", "12", "123", "9"))  # lengths with EOS: 2 3 4 2
    short.rollouts[2].finish_reason = "length"
    flat = make_group("0:2", texts=("12", "12", "12", "12"))
    groups = [ScoredGroup(group=short.for_training(), rewards=np.array([1, 0, 0, 0], np.float32),
                          reward_parts={}, advantages=np.zeros(4, np.float32), scorer="t",
                          t_scored=0.0),
              ScoredGroup(group=flat.for_training(),
                          rewards=np.full(4, 0.5, np.float32), reward_parts={},
                          advantages=np.zeros(4, np.float32), scorer="t", t_scored=0.0)]
    s = rollout_stats(groups)
    assert s["completions/mean_length"] == (2 + 3 + 4 + 2 + 3 * 4) / 8
    assert s["completions/min_length"] == 2 and s["completions/max_length"] == 4
    assert s["completions/clipped_ratio"] == 1 / 8
    assert s["frac_reward_zero_std"] == 0.5
    # the flat group is at 0.5 < the pass threshold: stuck, not solved; at threshold
    # 0.5 every completion passes, so the same group counts as solved
    assert (s["frac_reward_zero_std/solved"], s["frac_reward_zero_std/stuck"]) == (0.0, 0.5)
    s_low = rollout_stats(groups, pass_threshold=0.5)
    assert (s_low["frac_reward_zero_std/solved"], s_low["frac_reward_zero_std/stuck"]) == (
        0.5, 0.0)
    # both prompts are "123=" (4 tokens), counted once per completion
    assert step_tokens(groups) == 4 * 4 + (2 + 3 + 4 + 2) + 4 * 4 + 12


class _Recorder(Tracker):
    name = "recorder"

    def __init__(self) -> None:
        self.logged: list[tuple[dict[str, float], int]] = []

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((metrics, step))


class _Broken(Tracker):
    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.calls += 1
        raise ConnectionError("tracker server went away")


def test_a_backend_that_raises_is_warned_about_once_and_dropped(
        caplog: pytest.LogCaptureFixture) -> None:
    broken, ok = _Broken(), _Recorder()
    t = Trackers([broken, ok])
    with caplog.at_level(logging.WARNING, logger="sluice.tracking"):
        for step in (1, 2, 3):
            t.log({"reward": float(step)}, step)  # never raises
        t.finish()
    assert broken.calls == 1  # disabled after its first failure
    assert [s for _, s in ok.logged] == [1, 2, 3]  # the other backend kept logging
    warnings = [r for r in caplog.records if "broken" in r.getMessage()]
    assert len(warnings) == 1 and "disabled" in warnings[0].getMessage()


def test_run_names_one_writer_each() -> None:
    cfg = load_config(None, ["run.name=exp1"])
    assert run_name(cfg, "trainer") == "exp1" and run_name(cfg, "evaluator") == "exp1-eval"


def test_report_to_an_unknown_tracker_fails_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"run\.report_to\.0"):
        load_config(None, ['run.report_to=["neptune"]'])


def test_report_to_without_the_library_fails_at_start_naming_key_and_extra(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path, tiny_model_dir: Path) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # not importable, installed or not
    cfg = load_config(None, ['run.report_to=["wandb"]'])
    with pytest.raises(ConfigError, match=r"run\.report_to.*sluice\[wandb\]"):
        check_report_to(cfg)
    cfg_file = tmp_path / "run.toml"
    cfg_file.write_text(f'[run]\noutput_dir = "{tmp_path / "out"}"\nreport_to = ["wandb"]\n'
                        f'[model]\npath = "{tiny_model_dir}"\n')
    for cmd in ("up", "train", "eval"):
        assert cli.main([cmd, str(cfg_file)]) == 2
        err = capsys.readouterr().err
        assert "run.report_to" in err and "pip install 'sluice[wandb]'" in err, (cmd, err)
    assert not (tmp_path / "out").exists()  # refused before anything started
    # trackio is installed here: the same config with it passes the check
    check_report_to(load_config(None, ['run.report_to=["trackio"]']))
