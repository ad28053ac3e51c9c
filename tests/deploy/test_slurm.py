"""The rendered sbatch script on a real Slurm whose two nodes are two hosts
(`tests.deploy.slurm_cluster`: each node a network namespace with its own hostname,
slurmd and a Debian-like /etc/hosts mapping its own name to 127.0.1.1):

- a heterogeneous job runs a short examples/copy.toml over TLS (Redis with AOF, the ACL
  users and a certificate naming the head node, the trainer and a scorer on n1; a
  generator and the evaluator on n2, reaching Redis across the bridge), ends when the
  trainer ends the run, and its last step, `sluice audit` against the live Redis, finds
  the history clean;
- a job told to stop mid-run (SIGTERM to its script, as ``--signal`` sends before the
  time limit) stops its roles and trainer in order, requeues itself, and its second
  attempt resumes from the trainer's checkpoint and Redis's AOF to a clean audit over
  both attempts, with both attempts' logs kept.

The cluster is started once per session: Debian's packages are installed first if
missing (as root), the daemons are stopped by their pid files and the hosts removed at
the end.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from pipeline.ports import free_port
from sluice.acl import make_acl
from sluice.deploy import render
from sluice.deploy.certs import make_certs
from tests.deploy.examples import EXAMPLES
from tests.deploy.slurm_cluster import SlurmCluster, _alive
from tests.helpers import wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]

SMALL = ["up.scorers=1", "up.generators=1", "deploy.evaluator_with=generators",
         "task.heldout=16", "eval.every_s=5", "deploy.trainer_memory_gib=0.5",
         "deploy.role_memory_gib=0.25", "deploy.redis_memory_gib=0.25"]
"""The copy example made small enough for two test nodes (their RealMemory is a share of
this machine's free memory, and Slurm refuses a job asking for more)."""



def _submit(slurm: SlurmCluster, tmp_path: Path, *sets: str) -> tuple[str, Path]:
    """Render the copy example with ``sets`` and submit it from ``tmp_path/work``."""
    work, deploy = tmp_path / "work", tmp_path / "deploy"
    work.mkdir()
    creds = make_acl(tmp_path / "acl", "copy").credentials_file
    render(EXAMPLES["copy"], [f"bus.credentials_file={creds}",
                              f"deploy.redis_port={free_port()}", *SMALL, *sets],
           "slurm", deploy)
    job = slurm.submit(deploy / "sluice.sbatch", work,
                       {"SLUICE_VENV": str(Path(sys.executable).parent.parent),
                        "HF_HUB_OFFLINE": "1", "SLUICE_REDIS_CREDENTIALS_FILE": ""})
    return job, work


def _report(slurm: SlurmCluster, job: str, work: Path) -> str:
    """The job's output and its roles' log tails, for a failed assertion."""
    out = work / f"sluice-copy-{job}.out"
    logs = "\n".join(f"== {p.name}\n{p.read_text()[-1500:]}"
                     for p in sorted((work / "runs" / "copy" / "logs").glob("*.log")))
    return f"{out.read_text() if out.exists() else '(no output)'}\n{logs}\n{slurm.logs()}"


def _audits(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ln.startswith(("OK:", "FAILED"))]


def _redis_gone(work: Path) -> bool:
    pidfile = work / "runs" / "copy" / "redis" / "redis.pid"
    return not pidfile.exists() or not _alive(int(pidfile.read_text()))


def test_rendered_job_runs_the_copy_example_across_two_hosts_over_tls(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    head = slurm.nodes[0]
    certs = tmp_path / "certs"
    make_certs(certs, [head])  # the name every role dials: the head node's NodeAddr
    job, work = _submit(slurm, tmp_path, "trainer.max_steps=5",
                        f"deploy.redis_tls_dir={certs}")
    comps = slurm.wait_job(job, timeout_s=600)
    output = (work / f"sluice-copy-{job}.out").read_text()
    assert [(c["JobState"], c["ExitCode"]) for c in comps] == [("COMPLETED", "0:0")] * 2, \
        _report(slurm, job, work)
    assert [c["NodeList"] for c in comps] == ["n1", "n2"]  # trainer's, generators'
    # n2 resolves n1 to n1's own address; n1 itself to 127.0.1.1: Redis binds both
    assert f"the head node {head} is {slurm.hosts[head]} 127.0.1.1" in output, output
    audit = _audits(output)
    assert len(audit) == 1 and audit[0].startswith("OK:"), output
    assert "'trained': " in audit[0]
    assert "the trainer exited with 0" in output
    logs = work / "runs" / "copy" / "logs"
    for role in ("trainer-0", "scorer-0", "generator-0", "evaluator", "redis"):
        assert (logs / f"{role}.log").read_text().startswith(
            f"== sluice: attempt 0 of job {job}, "), role
    assert _redis_gone(work), "the job's Redis outlived the job"


def test_a_job_told_to_stop_requeues_itself_and_resumes_from_its_checkpoint(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    job, work = _submit(slurm, tmp_path, "trainer.max_steps=40", "trainer.save_steps=4")
    run = work / "runs" / "copy"

    def checkpointed() -> bool:
        states = [c.get("JobState") for c in slurm.job(job)]
        assert states and not set(states) - {"PENDING", "CONFIGURING", "RUNNING"}, \
            _report(slurm, job, work)
        return any((run / "checkpoints").glob("step-*")) if (run / "checkpoints").exists() \
            else False

    wait_for(checkpointed, 600, "the first attempt's first checkpoint", interval_s=1.0)
    rows_before = _rows(run)
    # SIGTERM to the batch shell alone, as --signal=B:TERM@S does before the time limit
    # (scancel --batch would signal its children too: every srun, and Redis)
    pid = slurm.batch_pid(job)
    assert pid is not None, _report(slurm, job, work)
    os.kill(pid, signal.SIGTERM)

    def finished() -> list[dict[str, str]] | None:
        comps = slurm.job(job)
        done = comps and all(c.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED",
                                                    "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
                             for c in comps)
        return comps if done and all(int(c.get("Restarts", "0")) >= 1 for c in comps) \
            else None

    comps = wait_for(finished, 900, "the requeued job's second attempt to end",
                     interval_s=1.0)
    output = (work / f"sluice-copy-{job}.out").read_text()
    report = _report(slurm, job, work)
    assert [(c["JobState"], c["ExitCode"]) for c in comps] == [("COMPLETED", "0:0")] * 2, \
        report
    # the first attempt stopped in order and requeued itself; the second ran to the end
    assert "SIGTERM: stopping the roles and the trainer" in output, report
    assert "requeueing the job" in output, report
    assert f"attempt 0 of job {job}" in output and f"attempt 1 of job {job}" in output
    audit = _audits(output)
    assert len(audit) == 1 and audit[0].startswith("OK:"), report  # both attempts' history
    trainer_log = (run / "logs" / "trainer-0.log").read_text()
    first, _, second = trainer_log.partition(f"== sluice: attempt 1 of job {job}")
    assert first.startswith(f"== sluice: attempt 0 of job {job}") and second, trainer_log
    assert "resumed from step" in second and "resumed from step" not in first, trainer_log
    for role in ("generator-0", "scorer-0", "evaluator", "redis"):
        text = (run / "logs" / f"{role}.log").read_text()
        assert f"attempt 0 of job {job}" in text and f"attempt 1 of job {job}" in text, role
    rows = _rows(run)
    assert rows and rows[-1]["step"] == 40 and len(rows) > len(rows_before) > 0, rows[-3:]
    assert _redis_gone(work), "the job's Redis outlived the job"


def _rows(run: Path) -> list[dict[str, object]]:
    path = run / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
