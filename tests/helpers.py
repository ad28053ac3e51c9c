"""Builders and reward functions shared by tests (importable by spawned processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.schema import Rollout, RolloutGroup

ROOT = Path(__file__).resolve().parents[1]


def make_group(gid: str = "0:1", texts: tuple[str, ...] = ("123", "12", "1", "9"),
               answer: str = "123", version: int = 0) -> RolloutGroup:
    """A rollout group for the copy task whose completions are ``texts`` (all stopped)."""
    rollouts = []
    for t in texts:
        ids = np.array([4 + int(c) for c in t] + [1], dtype=np.int32)
        rollouts.append(Rollout(completion_ids=ids,
                                logprobs=np.full(len(ids), -0.5, dtype=np.float32),
                                versions=np.full(len(ids), version, dtype=np.int32),
                                mask=np.ones(len(ids), dtype=np.uint8),
                                finish_reason="stop", text=t))
    epoch, idx = (int(x) for x in gid.split(":"))
    return RolloutGroup(group_id=gid, prompt_index=idx, epoch=epoch,
                        prompt={"text": answer + "=", "answer": answer},
                        prompt_ids=np.array([4 + int(c) for c in answer] + [66], dtype=np.int32),
                        generator="test", t_admit=time.time(), t_done=time.time(),
                        rollouts=rollouts)


def hang_reward(prompts: list[Any], completions: list[str], completion_ids: list[Any],
                **fields: Any) -> list[float | None]:
    """Never returns in time: the scorer holding it can be killed between read and ack."""
    time.sleep(3600)
    return [0.0] * len(completions)


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def spawn_role(role: str, config: Path, *overrides: str, name: str | None = None,
               log: Path | None = None) -> subprocess.Popen[bytes]:
    """Start ``sluice ROLE`` as a real OS process (cwd = repo root, so tests import)."""
    args = [sys.executable, "-m", "pipeline.cli", role, str(config)]
    for o in overrides:
        args += ["--set", o]
    if name:
        args += ["--name", name]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    if log is None:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT)
    with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_for(pred: Any, timeout_s: float, what: str, interval_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
