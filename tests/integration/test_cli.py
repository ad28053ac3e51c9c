"""The monitor commands against a real Redis: `sluice status`, `sluice tail`, bad input."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from pipeline.bus.codec import encode
from pipeline.bus.keys import SCORERS_GROUP, Keys
from sluice.embedded import EmbeddedRedis
from tests.helpers import ROOT, make_group

pytestmark = pytest.mark.integration


def sluice(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sluice.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


_FORKS = multiprocessing.get_context("forkserver")
_FORKS.set_forkserver_preload(["sluice.cli", "trainer.trainer", "workers.generator",
                               "workers.scorer", "workers.evaluator"])


def _cli_child(argv: list[str], out: str, err: str) -> None:
    os.chdir(ROOT)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    from sluice.cli import main

    sys.exit(main(argv))


def sluice_forked(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``sluice ARGS`` as a process of its own, forked from multiprocessing's forkserver,
    which imported the roles' modules once for the session: the same ``main``, exit code
    and stdout/stderr as ``python -m sluice.cli ARGS``, without the seconds each
    fresh interpreter spends importing torch and transformers (these cases are many). A
    traceback that escaped ``main`` would be printed to that stderr, as in a real start.
    `sluice` (a fresh interpreter) covers the entry point itself."""
    out, err = tmp_path / "cli.stdout", tmp_path / "cli.stderr"
    proc = _FORKS.Process(target=_cli_child, args=(list(args), str(out), str(err)))
    proc.start()
    proc.join(60)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise AssertionError(f"sluice {' '.join(args)} still running after 60 s:\n"
                             f"{err.read_text()[-2000:]}")
    return subprocess.CompletedProcess(list(args), proc.exitcode, out.read_text(),
                                       err.read_text())


def test_status_json_reports_streams_groups_and_conservation(
        redis_server: EmbeddedRedis, run_name: str) -> None:
    r = redis.Redis.from_url(redis_server.url)
    k = Keys(run_name)
    r.xgroup_create(k.rollouts, SCORERS_GROUP, id="0", mkstream=True)
    r.hset(k.state, mapping={"cursor": 3, "retired": 1, "retired:filtered": 1,
                             "generating": 0, "version": 7})
    r.xadd(k.rollouts, {b"m": encode(make_group("0:1"))})
    r.xreadgroup(SCORERS_GROUP, "s0", {k.rollouts: ">"})  # one pending on s0
    r.xadd(k.rollouts, {b"m": encode(make_group("0:2"))})  # one not yet delivered
    r.close()
    p = sluice("status", "--json", "--set", f"bus.redis_url={redis_server.url}",
               "--set", f"run.name={run_name}")
    assert p.returncode == 0, p.stderr
    snap = json.loads(p.stdout)
    g = snap["groups"]["rollouts/scorers"]
    assert g["lag"] == 1 and g["pending"] == 1
    assert [c["name"] for c in g["consumers"]] == ["s0"]
    c = snap["conservation"]
    assert c["cursor"] == 3 and c["retired"] == 1 and c["in_flight"] == 2 and c["balanced"]
    text = sluice("status", "--set", f"bus.redis_url={redis_server.url}",
                  "--set", f"run.name={run_name}")
    assert text.returncode == 0 and "balanced" in text.stdout and "version 7" in text.stdout


def test_tail_prints_one_decoded_line_per_group(redis_server: EmbeddedRedis,
                                                run_name: str) -> None:
    r = redis.Redis.from_url(redis_server.url)
    k = Keys(run_name)
    r.xadd(k.rollouts, {b"m": encode(make_group("0:5", version=3))})
    r.xadd(k.rollouts, {b"m": b"\xc1 garbage"})
    r.close()
    p = sluice("tail", "rollouts", "--from-start", "--count", "2",
               "--set", f"bus.redis_url={redis_server.url}", "--set", f"run.name={run_name}")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 2
    assert "0:5" in lines[0] and "v3-3" in lines[0] and "'123='" in lines[0]
    assert "undecodable" in lines[1]


def test_bad_config_and_bad_arguments_fail_at_start_naming_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer]\nlrr = 1e-4\n")
    p = sluice("status", str(bad))
    assert p.returncode == 2 and "trainer.lrr" in p.stderr and "unknown key" in p.stderr
    p = sluice("train", str(tmp_path / "missing.toml"))
    assert p.returncode == 2 and "not found" in p.stderr
    p = sluice("status", "--set", "generation.top_p=7")
    assert p.returncode == 2 and "generation.top_p" in p.stderr
    p = sluice("tail", "nosuchstream")
    assert p.returncode == 2 and "invalid choice" in p.stderr


BAD_START_FILES: dict[str, str | bytes] = {
    "ok.toml": '[run]\nname = "x"\n',
    "bad.toml": "[trainer\nlr = \n",
    "wrongtype.toml": '[trainer]\nlr = "fast"\n',
    "range.toml": "[trainer]\nmax_staleness = -1\n",
    "section.toml": "[trainerr]\nlr = 1e-4\n",
    "notutf8.toml": b"\xff\xfe[run]\n",
    "data.jsonl": '{"question": "1+1", "answer": "2"}\n',
}


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["status", "{tmp}/bad.toml"], ["bad.toml: not valid TOML", "line 1"]),
        (["status", "{tmp}/notutf8.toml"], ["notutf8.toml: not UTF-8"]),
        (["status", "{tmp}"], ["{tmp}: cannot read the config file", "Is a directory"]),
        (["status", "{tmp}/wrongtype.toml"],
         ["wrongtype.toml", "trainer.lr: Input should be a valid number", "'fast'"]),
        (["status", "--set", "trainer.max_steps=ten"],
         ["trainer.max_steps: Input should be a valid integer", "'ten'"]),
        (["status", "{tmp}/range.toml"],
         ["trainer.max_staleness: Input should be greater than or equal to 0"]),
        (["status", "{tmp}/section.toml"], ["trainerr: unknown key"]),
        (["status", "--set", "bus.blockms=5"], ["bus.blockms: unknown key"]),
        (["status", "--set", "trainer.lr"], ["--set 'trainer.lr': expected section.key=value"]),
        (["status", "{tmp}/ok.toml", "--set", "run.name.x=1"],
         ["--set run.name.x: 'name' is not a section"]),
        (["frobnicate"], ["invalid choice: 'frobnicate'"]),
        (["status", "--frob"], ["unrecognized arguments: --frob"]),
        (["train"], ["the following arguments are required: config"]),
        (["up", "{tmp}/ok.toml", "--eval-every", "soon"], ["invalid float value: 'soon'"]),
        (["train", "{tmp}/ok.toml", "--set", "model.path={tmp}/nomodel"],
         ["model.path: no model at {tmp}/nomodel"]),
        (["generate", "{tmp}/ok.toml", "--set", "model.path={tmp}/nomodel"],
         ["model.path: no model at {tmp}/nomodel"]),
        (["eval", "{tmp}/ok.toml", "--set", "model.path={tmp}/nomodel"],
         ["model.path: no model at {tmp}/nomodel"]),
        (["score", "{tmp}/ok.toml", "--set", "scoring.rewards=[{{fn='nosuch_pkg.m:f'}}]"],
         ["scoring.rewards.0.fn:", "cannot import module 'nosuch_pkg.m'"]),
        (["score", "{tmp}/ok.toml", "--set",
          "scoring.rewards=[{{fn='workers.tasks.rewards:nope'}}]"],
         ["scoring.rewards.0.fn:", "has no attribute 'nope'"]),
        (["score", "{tmp}/ok.toml", "--set", "scoring.rewards=[{{fn='not a path'}}]"],
         ["scoring.rewards.0.fn: String should match pattern"]),
        (["score", "{tmp}/ok.toml", "--set",
          "scoring.rewards=[{{fn='tests.integration.test_scorer:target_reward'}}]"],
         ["scoring.rewards.0.fn 'tests.integration.test_scorer:target_reward': TypeError: "
          "target_reward() missing 1 required keyword-only argument: 'target'"]),
        (["up", "{tmp}/ok.toml", "--set", "run.output_dir={tmp}/run", "--set",
          "scoring.rewards=[{{fn='workers.tasks.rewards:copy_reward'}}, "
          "{{fn='tests.integration.test_scorer:target_reward'}}]"],
         ["scoring.rewards.1.fn 'tests.integration.test_scorer:target_reward': TypeError: "]),
        (["up", "{tmp}/ok.toml", "--set", "run.output_dir={tmp}/run", "--set", "task.name=hf",
          "--set", "task.dataset={tmp}/data.jsonl"],
         ["task.prompt_column: no column 'prompt'", "columns: ['question', 'answer']"]),
        (["score", "{tmp}/ok.toml", "--set", "task.name=hf", "--set",
          "task.dataset={tmp}/none.jsonl"], ["task.dataset: {tmp}/none.jsonl: no such file"]),
        (["score", "{tmp}/ok.toml", "--set", "task.name=hf"],
         ["task.dataset: the hf task needs a dataset"]),
        (["eval", "{tmp}/ok.toml", "--set",
          "eval.rewards=[{{fn='tests.integration.test_scorer:target_reward'}}]"],
         ["eval.rewards.0.fn 'tests.integration.test_scorer:target_reward': TypeError: "]),
        (["up", "{tmp}/ok.toml", "--set", "run.output_dir={tmp}/run", "--set",
          "eval.rewards=[{{fn='workers.tasks.rewards:nope'}}]"],
         ["eval.rewards.0.fn:", "has no attribute 'nope'"]),
        (["up", "{tmp}/ok.toml", "--set", "run.output_dir={tmp}/run", "--set",
          "environment.name=nosuch_pkg.envs:Game"],
         ["environment.name:", "cannot import module 'nosuch_pkg.envs'"]),
        (["generate", "{tmp}/ok.toml", "--set", "run.output_dir={tmp}/run", "--set",
          "environment.name=workers.environments.builtin:GuessNumber", "--set",
          "environment.kwargs={{bogus=1}}", "--set", "task.name=guess"],
         ["environment.kwargs:", "unexpected keyword argument 'bogus'"]),
        (["up", "{tmp}/ok.toml", "--set", "run.output_dir={tmp}/run", "--set",
          "generation.rollout=workers.episodes:nope"],
         ["generation.rollout:", "has no attribute 'nope'"]),
        (["score", "{tmp}/ok.toml", "--set", "scoring.advantages=pipeline.rl.advantages:nope"],
         ["scoring.advantages:", "has no attribute 'nope'"]),
    ],
    ids=["bad-toml", "not-utf8", "config-is-a-directory", "wrong-type-in-file",
         "wrong-type-in-set", "out-of-range-in-file", "unknown-section", "unknown-key-in-set",
         "set-without-equals", "set-through-a-scalar", "unknown-subcommand",
         "unknown-argument", "missing-config-argument", "bad-option-value",
         "train-without-model", "generate-without-model", "eval-without-model",
         "reward-module-missing", "reward-function-missing",
         "reward-path-malformed",
         "reward-cannot-be-called", "up-probes-rewards-first", "up-unknown-column",
         "dataset-missing", "hf-without-dataset", "eval-reward-cannot-be-called",
         "up-checks-eval-rewards", "environment-missing", "environment-kwargs-refused",
         "rollout-hook-missing", "advantages-hook-missing"],
)
def test_bad_start_exits_2_naming_the_problem_without_a_traceback(
        tmp_path: Path, args: list[str], needles: list[str]) -> None:
    """Every way to start wrongly ends at once with exit 2 and one message naming the key,
    file or argument: never a traceback, and never a role that starts and dies later."""
    for name, text in BAD_START_FILES.items():
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    p = sluice_forked(tmp_path, *[a.format(tmp=tmp_path) for a in args])
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    for needle in needles:
        assert needle.format(tmp=tmp_path) in p.stderr, p.stderr


@pytest.mark.parametrize(("sets", "key"), [
    (["trainer.device=cuda"], "trainer.device"),
    (["trainer.device=cuda:3"], "trainer.device"),
    (["trainer.micro_batch_tokens=8", "generation.max_new_tokens=8"],
     "trainer.micro_batch_tokens"),
    (["model.dtype=float16", "trainer.fp32_master=false"], "trainer.fp32_master"),
    (["trainer.device=gpu"], "trainer.device"),
])
def test_trainer_settings_this_machine_cannot_run_fail_at_start(
        tmp_path: Path, tiny_model_dir: Path, sets: list[str], key: str) -> None:
    """No CUDA here (CI is CPU-only): asking for it fails before any model is loaded."""
    args = ["train", str(ROOT / "examples" / "copy.toml"), "--set", f"model.path={tiny_model_dir}",
            "--set", f"run.output_dir={tmp_path}"]
    for s in sets:
        args += ["--set", s]
    p = sluice_forked(tmp_path, *args)
    assert p.returncode == 2, p.stderr
    assert f" {key}: " in p.stderr.replace("\n", " "), p.stderr  # the key, named
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("cmd", ["up", "score"])
def test_a_teacher_with_another_vocabulary_stops_up_and_score_before_any_role(
        tmp_path: Path, tiny_model_dir: Path, cmd: str) -> None:
    """`sluice up` / `sluice score` with an on-policy distillation teacher whose tokenizer
    is not the policy's: exit 2 naming scoring.teacher, before the run directory exists;
    an in-process teacher on a device this machine lacks names scoring.teacher_device."""
    from tests.helpers import build_bpe_model

    other = build_bpe_model(tmp_path / "bpe")
    base = [cmd, str(ROOT / "examples" / "copy.toml"), "--set", f"model.path={tiny_model_dir}",
            "--set", f"run.output_dir={tmp_path / 'run'}"]
    p = sluice_forked(tmp_path, *base, "--set", f"scoring.teacher={other}")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "scoring.teacher: " in p.stderr and "another vocabulary" in p.stderr, p.stderr
    p = sluice_forked(tmp_path, *base, "--set", f"scoring.teacher={tiny_model_dir}",
               "--set", "scoring.teacher_device=cuda")
    assert p.returncode == 2 and "scoring.teacher_device: " in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "run").exists()
