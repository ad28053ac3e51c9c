"""The rendered sbatch script on a real Slurm: a heterogeneous job over two nodes runs a
short examples/copy.toml (Redis with AOF and the ACL users, the trainer, a scorer on the
trainer's node; a generator and the evaluator on the other node), ends when the trainer
ends the run, and its last step, `sluice audit` against the live Redis, finds the
history clean.

The cluster (`tests.deploy.slurm_cluster`) is started once per session: Debian's
packages are installed first if missing (as root), the daemons are stopped by their pid
files at the end. Under a minute on a 2-core machine once the packages are there.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.ports import free_port
from sluice.acl import make_acl
from sluice.deploy import render
from tests.deploy.examples import EXAMPLES
from tests.deploy.slurm_cluster import SlurmCluster, SlurmUnavailable, _alive, ensure_installed

pytestmark = [pytest.mark.slurm, pytest.mark.e2e]


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    try:
        ensure_installed()
    except SlurmUnavailable as e:
        pytest.skip(str(e))
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=2)
    try:
        cluster.start()
        yield cluster
    finally:
        pidfiles = list(cluster.started)
        cluster.stop()
        pids = [int(p.read_text().split()[0]) for p in pidfiles if p.exists()]
        assert not [p for p in pids if _alive(p)], "a Slurm daemon outlived the session"


def test_rendered_job_runs_the_copy_example_and_its_audit_is_ok(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    work, deploy = tmp_path / "work", tmp_path / "deploy"
    work.mkdir()
    creds = make_acl(tmp_path / "acl", "copy").credentials_file
    render(EXAMPLES["copy"], [
        f"bus.credentials_file={creds}", f"deploy.redis_port={free_port()}",
        "trainer.max_steps=5", "up.scorers=1", "up.generators=1",
        "deploy.evaluator_with=generators", "task.heldout=16", "eval.every_s=5",
    ], "slurm", deploy)
    job = slurm.submit(deploy / "sluice.sbatch", work,
                       {"SLUICE_VENV": str(Path(sys.executable).parent.parent),
                        "HF_HUB_OFFLINE": "1", "SLUICE_REDIS_CREDENTIALS_FILE": ""})
    comps = slurm.wait_job(job, timeout_s=600)
    output = (work / f"sluice-copy-{job}.out").read_text()
    logs = "\n".join(f"== {p.name}\n{p.read_text()[-1500:]}"
                     for p in sorted((work / "runs" / "copy" / "logs").glob("*.log")))
    assert [(c["JobState"], c["ExitCode"]) for c in comps] == [("COMPLETED", "0:0")] * 2, \
        f"{comps}\n{output}\n{logs}\n{slurm.logs()}"
    assert sorted(c["NodeList"] for c in comps) == ["n1", "n2"]  # two nodes, one each
    audit = [ln for ln in output.splitlines() if ln.startswith(("OK:", "FAILED"))]
    assert len(audit) == 1 and audit[0].startswith("OK:"), output
    assert "'trained': " in audit[0]
    assert "the trainer exited with 0" in output
    for role in ("trainer-0", "scorer-0", "generator-0", "evaluator", "redis"):
        assert (work / "runs" / "copy" / "logs" / f"{role}.log").exists(), role
    redis_pid = int((work / "runs" / "copy" / "redis" / "redis.pid").read_text()) \
        if (work / "runs" / "copy" / "redis" / "redis.pid").exists() else None
    assert redis_pid is None or not _alive(redis_pid), "the job's Redis outlived the job"
