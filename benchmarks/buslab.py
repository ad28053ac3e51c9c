"""What the bus benchmarks (`benchmarks.bus`, `benchmarks.scorer_scaleout`) share: a
redis-server of their own, real scorer processes, rollout groups of a target size, CPU
accounting per process, and the tiny model's trainer step that bus CPU is weighed against.

- The server is `sluice.embedded.EmbeddedRedis`, the one `sluice up` runs: on a
  unix socket (as `sluice up`) or on a free loopback TCP port, without persistence unless
  asked (``appendonly``; `sluice up` runs with AOF, ``appendfsync everysec``). One server
  per measured arm, stopped by PID at its end, so no arm inherits another's memory.
- Scorers are the real role, ``python -m sluice.cli score CONFIG --name NAME``,
  started as OS processes from the repository root (so reward functions under
  `benchmarks.rewards` import) with one torch/BLAS thread, and stopped by PID (SIGTERM:
  the role finishes its batch and leaves; SIGKILL after a grace period).
- CPU seconds are user + system time of each process (psutil, a dependency of peft),
  read before and after the timed window; threads count, child processes do not.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import psutil

from pipeline.bus.client import Bus
from pipeline.bus.codec import encode
from pipeline.bus.schema import Rollout, RolloutGroup
from pipeline.ports import free_port
from sluice.embedded import EmbeddedRedis

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 76  # the tiny char model's vocabulary (`pipeline.model.VOCAB_SIZE`): ids 4..75
UNITS = {"B": 1, "KB": 1024, "MB": 1024**2}
PROGRESS_TIMEOUT_S = 120.0


def parse_size(text: str) -> int:
    """``2KB`` / ``48KB`` / ``1MB`` / ``512B`` / ``4096`` -> bytes (binary units)."""
    t = text.strip().upper()
    for unit in ("MB", "KB", "B"):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * UNITS[unit])
    return int(t)


def size_label(nbytes: int) -> str:
    for unit in ("MB", "KB"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]} {unit}"
    return f"{nbytes} B"


def build_group(completion_tokens: int, *, generations: int, prompt_tokens: int,
                chars_per_token: int, seed: int = 0, gid: int = 0) -> RolloutGroup:
    """A group as a generator appends it: ``generations`` completions of
    ``completion_tokens`` random token ids with logprobs, versions, mask and a text of
    ``chars_per_token`` characters per token (what a BPE tokenizer decodes to)."""
    rng = np.random.default_rng(seed)
    rollouts = []
    for _ in range(generations):
        t = completion_tokens
        rollouts.append(Rollout(
            completion_ids=rng.integers(4, VOCAB, t).astype(np.int32),
            logprobs=(-rng.random(t) * 3 - 0.05).astype(np.float32),
            versions=np.zeros(t, dtype=np.int32), mask=np.ones(t, dtype=np.uint8),
            finish_reason="length",
            text="".join(rng.choice(list("abcdefghij0123456789 "), t * chars_per_token))))
    now = time.time()
    return RolloutGroup(group_id=f"0:{gid}", prompt_index=gid, epoch=0,
                        prompt={"text": "copy 123=", "answer": "123"},
                        prompt_ids=rng.integers(4, VOCAB, prompt_tokens).astype(np.int32),
                        generator="bench", t_admit=now, t_done=now, rollouts=rollouts)


def sized_group(target_bytes: int, *, generations: int, prompt_tokens: int,
                chars_per_token: int) -> RolloutGroup:
    """The group whose encoded size is closest to ``target_bytes``, sized by completion
    length (at least one token): the size is affine in the length, so two encodings
    give the slope."""
    def size(t: int) -> int:
        return len(encode(build_group(t, generations=generations, prompt_tokens=prompt_tokens,
                                      chars_per_token=chars_per_token)))

    s1, s2 = size(1), size(2)
    t = max(1, round(1 + (target_bytes - s1) / max(1, s2 - s1)))
    return build_group(t, generations=generations, prompt_tokens=prompt_tokens,
                       chars_per_token=chars_per_token)


@contextlib.contextmanager
def redis_server(data_dir: Path, *, tcp: bool, appendonly: bool) -> Iterator[EmbeddedRedis]:
    """A fresh redis-server for one arm, stopped (by PID) on exit."""
    srv = EmbeddedRedis(data_dir, port=free_port() if tcp else None, appendonly=appendonly)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def scorer_config(path: Path, *, url: str, run: str, output_dir: Path, reward: str,
                  read_count: int, ledger: bool, bus: dict[str, int] | None = None) -> Path:
    """A run config for the scorers: the bus URL, one reward function by import path,
    ``zero_variance = "train"`` (every group is handed on), heartbeats every 0.2 s (so
    `wait_workers` sees a started scorer soon), blocking reads of 0.1 s (so a stopped
    scorer exits soon), and further ``bus`` settings. Everything else is sluice's
    default."""
    bus = {"block_ms": 100, **(bus or {})}
    path.write_text(
        f'[run]\nname = "{run}"\noutput_dir = "{output_dir}"\nledger = {str(ledger).lower()}\n'
        f'[bus]\nredis_url = "{url}"\nheartbeat_s = 0.2\n'
        + "".join(f"{k} = {v}\n" for k, v in bus.items())
        + f'[scoring]\nrewards = [{{ fn = "{reward}" }}]\nzero_variance = "train"\n'
        f"read_count = {read_count}\n")
    return path


def start_scorers(config: Path, n: int, log_dir: Path,
                  env: dict[str, str] | None = None) -> list[subprocess.Popen[bytes]]:
    """``n`` real scorer processes named ``bench-s0``…; output to ``log_dir/NAME.log``."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
            "HF_HUB_OFFLINE": "1", **(env or {})}
    procs = []
    for i in range(n):
        with open(log_dir / f"bench-s{i}.log", "ab") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "sluice.cli", "score", str(config),
                 "--name", f"bench-s{i}"],
                cwd=ROOT, env=full, stdout=out, stderr=subprocess.STDOUT))
    return procs


def stop_processes(procs: list[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """SIGTERM each (by PID), wait up to ``grace_s`` in all, then SIGKILL what is left."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def wait_workers(url: str, run: str, wids: list[str], procs: list[subprocess.Popen[bytes]],
                 log_dir: Path, timeout_s: float = 60.0, cluster: bool = False) -> None:
    """Until every worker id in ``wids`` has a heartbeat (a scorer's first beat comes
    after it joined its consumer groups); RuntimeError with the logs if a process
    exits or the time runs out."""
    async def seen() -> set[str]:
        bus = Bus.connect(url, run, cluster=cluster)
        try:
            return set(await bus.workers())
        finally:
            await bus.close()

    deadline = time.monotonic() + timeout_s
    while not set(wids) <= asyncio.run(seen()):
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = f"exited ({dead[0].returncode})" if dead else f"not up in {timeout_s} s"
            raise RuntimeError(f"a scorer {why}:\n{log_tails(log_dir)}")
        time.sleep(0.05)


def wait_progress(moved: Callable[[], bool], log_dir: Path | None,
                  timeout_s: float = PROGRESS_TIMEOUT_S) -> None:
    """Until ``moved()`` (a timed window ends only once a group went through it, so a
    rate is never 0/0); RuntimeError with the scorers' logs after ``timeout_s``: a
    pipeline that moves nothing is broken, not slow."""
    deadline = time.monotonic() + timeout_s
    while not moved():
        if time.monotonic() > deadline:
            logs = log_tails(log_dir) if log_dir else ""
            raise RuntimeError(f"no group went through in {timeout_s} s more:\n{logs}")
        time.sleep(0.05)


def log_tails(log_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}"
                     for p in sorted(log_dir.glob("*.log")))


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU seconds of each live process (threads included)."""
    out = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            out[pid] = t.user + t.system
    return out


def cpu_used(before: dict[int, float], after: dict[int, float], pids: list[int]) -> float:
    """CPU seconds ``pids`` spent between two `cpu_seconds` readings."""
    return sum(after.get(p, before.get(p, 0.0)) - before.get(p, 0.0) for p in pids)


def trainer_step_s_per_group(group: RolloutGroup, *, groups: int, repeats: int,
                             threads: int, max_tokens: int) -> float | None:
    """Median wall seconds of one tiny-model optimizer step (after a warm-up step) on
    ``groups`` synthetic groups of ``group``'s shape, divided by ``groups``; None when a
    sample is over ``max_tokens``. Model: `pipeline.model.init_tiny_model`; step:
    `trainer.step.optimize`, padded layout, loss dapo, ``threads`` torch threads."""
    prompt, completion = len(group.prompt_ids), len(group.rollouts[0].completion_ids)
    if prompt + completion > max_tokens:
        return None
    import torch  # here: the benchmarks' role processes never load torch
    from transformers.utils import logging as hf_logging

    from benchmarks.synthetic import scored_groups
    from pipeline.model import VOCAB_SIZE, init_tiny_model, load_model
    from pipeline.rl.losses import LossConfig
    from pipeline.runtime import set_threads
    from trainer.batch import build_batch
    from trainer.step import StepSettings, optimize

    hf_logging.disable_progress_bar()
    set_threads(threads)
    with tempfile.TemporaryDirectory(prefix="sluice-bench-bus-") as d:
        model_dir = init_tiny_model(Path(d) / "tiny", seed=0,
                                    max_position_embeddings=max(512, prompt + completion + 1))
        model, _ = load_model(model_dir)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    settings = StepSettings(loss=LossConfig(loss_type="dapo"), temperature=1.0)
    batches = [build_batch(scored_groups(groups, len(group.rollouts),
                                        vocab_size=VOCAB_SIZE, prompt_tokens=(prompt, prompt),
                                        completion_tokens=(completion, completion), seed=i),
                           pad_id=0) for i in range(repeats + 1)]
    optimize(model, opt, batches[0], settings)  # warm-up
    times = []
    for b in batches[1:]:
        t0 = time.perf_counter()
        optimize(model, opt, b, settings)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / groups
