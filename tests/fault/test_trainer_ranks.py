"""kill -9 of one trainer rank mid-step: torchrun takes the job down and restarts it, the
restarted job resumes from its checkpoint and drains rank 0's pending entries, and the
whole history is clean. A second trainer started outside the job is refused.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from pipeline.bus.keys import TRAINERS_GROUP
from pipeline.ports import free_port
from sluice.supervisor import child_pids, stop_gracefully
from tests.fault.harness import GROUPS_PER_STEP, Pipeline
from tests.helpers import ROOT, wait_for

pytestmark = pytest.mark.fault


def start_job(p: Pipeline, name: str, ranks: int, restarts: int) -> subprocess.Popen[bytes]:
    """The trainer as a torchrun job of ``ranks`` processes, registered with the pipeline
    (stopped by `Pipeline.stop_all`, killed on exit)."""
    (p.tmp / "logs").mkdir(exist_ok=True)
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
            "--max-restarts", str(restarts), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "sluice.cli", "train",
            str(p.config),
            "--name", "trainer-0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    with open(p.tmp / "logs" / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    p.procs[name], p.roles[name] = proc, "train"
    return proc


def stop_job(p: Pipeline, job: subprocess.Popen[bytes]) -> None:
    """Generators, scorers, then the job as `sluice up` stops it (SIGTERM to its ranks):
    every process must exit 0."""
    for name, role in list(p.roles.items()):
        if role != "train" and p.procs[name].poll() is None:
            assert p.stop(name) == 0, p.log(name)
    stop_gracefully(job)
    assert job.wait(120) == 0, p.log("job")
    p.stop_all()


def pending_on_trainer(p: Pipeline) -> int:
    return len(p.pending_ids("scored", TRAINERS_GROUP, "trainer-0"))


def test_rank_killed_mid_step_restarts_the_job_which_drains_and_stays_clean(
        tmp_path, tiny_model_dir) -> None:
    with Pipeline(tmp_path, tiny_model_dir) as p:
        job = start_job(p, "job", ranks=2, restarts=1)
        p.start("generate", "g0")
        p.start("score", "s0")
        p.wait_trained(24)  # past a checkpoint (save_steps = 5)
        wait_for(lambda: len(child_pids(job.pid)) == 2, 60, "two ranks under torchrun")
        wait_for(lambda: pending_on_trainer(p) >= GROUPS_PER_STEP, 60,
                 lambda: f"the job to hold a step\n{p.logs()}", 0.005)
        ranks = child_pids(job.pid)
        os.kill(max(ranks), signal.SIGKILL)  # the later-started rank: rank 1
        p.faults += 1
        wait_for(lambda: len(child_pids(job.pid)) == 2
                 and not set(child_pids(job.pid)) & set(ranks), 120,
                 lambda: f"torchrun to restart both ranks\n{p.logs()}")
        before = p.trained()
        p.wait_trained(before + 16, timeout_s=180)
        log = (p.tmp / "logs" / "job.log").read_text()
        assert "resumed from step" in log
        assert job.poll() is None  # the restart happened inside the job
        stop_job(p, job)
        report = p.assert_clean(min_trained=before + 16)
        assert report.retired["dead"] == 0


def test_a_second_trainer_outside_the_job_is_refused(tmp_path, tiny_model_dir) -> None:
    with Pipeline(tmp_path, tiny_model_dir) as p:
        p.start("train", "trainer-0")
        wait_for(lambda: p.worker("trainer/trainer-0").get("step") is not None, 120,
                 lambda: f"the first trainer to heartbeat\n{p.logs()}")
        second = p.start("train", "trainer-1")
        p.expect_exit("trainer-1")
        rc = second.wait(120)
        assert rc != 0
        assert "another trainer job" in p.log("trainer-1"), p.log("trainer-1")
        assert p.procs["trainer-0"].poll() is None  # the first one is untouched
        p.stop_all()
