"""What the k8s render does with a run's life: the run's cleanup leaves its data and
namespace, every role is a Job that ends with the run (its vLLM sidecars and GPUs with
it), a preempted or evicted pod is replaced without counting as a failure (the rendered
command run around a stand-in role shows how), the trainer and Redis are protected from
drains, and autoscaling needs KEDA only when asked. Read off the rendered objects, built
by `kubectl kustomize` where kustomize decides: no cluster, seconds."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.deploy.rendered import (
    docs,
    fresh_credentials,
    jobs_by_name,
    pod_templates,
    render_into,
)
from tests.deploy.test_validate import kustomize


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return fresh_credentials(tmp_path_factory.mktemp("acl"))


def test_the_runs_cleanup_leaves_the_namespace_and_the_data(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """`kubectl delete -k DIR` deletes what DIR's kustomization builds: neither the
    Namespace (other runs live there) nor a PersistentVolumeClaim (checkpoints, weights,
    the model cache). The data volume is its own kustomization (DIR/data), which the
    pods name; the Redis volume outlives its StatefulSet."""
    out = render_into(tmp_path / "k", "k8s", creds, "copy")
    run = kustomize(out)
    kinds = {o["kind"] for o in run}
    assert "Namespace" not in kinds and "PersistentVolumeClaim" not in kinds, kinds
    data = kustomize(out / "data")
    assert [o["kind"] for o in data] == ["PersistentVolumeClaim"]
    claim = data[0]["metadata"]["name"]
    assert data[0]["metadata"]["namespace"] == "sluice"
    for _, pod in pod_templates(run):
        claims = [v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", [])
                  if "persistentVolumeClaim" in v]
        assert claims in ([], [claim])
    ns = yaml.safe_load((out / "namespace.yaml").read_text())
    assert ns["kind"] == "Namespace" and ns["metadata"]["name"] == "sluice"
    sts = next(o for o in run if o["kind"] == "StatefulSet")
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Retain", "whenScaled": "Retain"}


def test_roles_end_with_the_run_and_their_servers_with_them(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """Each role exits 0 once it has seen RunFinished: under a Deployment it would be
    restarted forever (and its vLLM sidecar keep its GPU). Every role is a Job whose pod
    completes on that exit, its vLLM servers native sidecars that end with it; only
    scorers scaled by KEDA stay a Deployment (KEDA scales no Job)."""
    out = render_into(tmp_path / "k", "k8s", creds, "gsm8k")
    objects = docs(out)
    assert not [o for o in objects if o["kind"] == "Deployment"]
    jobs = jobs_by_name(objects)
    assert set(jobs) == {f"sluice-gsm8k-{r}"
                         for r in ("trainer", "generator", "scorer", "evaluator")}
    scorer = jobs["sluice-gsm8k-scorer"]["spec"]
    assert scorer["completionMode"] == "Indexed"
    assert scorer["completions"] == scorer["parallelism"] == 4  # up.scorers
    gen = jobs["sluice-gsm8k-generator"]["spec"]["template"]["spec"]
    sidecars = [c for c in gen["initContainers"] if c.get("restartPolicy") == "Always"]
    assert sidecars and all(c["resources"]["limits"]["nvidia.com/gpu"] == 1 for c in sidecars)
    scaled = docs(render_into(tmp_path / "a", "k8s", creds, "gsm8k", "deploy.autoscale=true"))
    assert [o["metadata"]["name"] for o in scaled if o["kind"] == "Deployment"] == [
        "sluice-gsm8k-scorer"]


def test_preemption_is_not_failure_and_the_trainer_is_protected(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """Every Job ignores disruptions (preemption, eviction, drain: not counted against
    its backoff), fails at once on exit 78 (no restart can fix it), replaces a pod only
    once it is gone (never two trainers or archivers at once); the trainer and Redis
    have disruption budgets and ask autoscalers not to evict them; the trainer gets its
    own, longer grace for its final checkpoint; gang admission through Kueue and a
    scheduler of the cluster's choice when asked."""
    out = render_into(tmp_path / "k", "k8s", creds, "copy", "deploy.trainer_grace_s=900",
                  "deploy.queue_name=gpu-queue", "deploy.scheduler_name=volcano",
                  "up.trainer_ranks=2", "deploy.trainer_nodes=2", "archive.enabled=true",
                  "archive.path=archive")
    objects = docs(out)
    jobs = jobs_by_name(objects)
    assert {"sluice-copy-trainer", "sluice-copy-generator", "sluice-copy-evaluator",
            "sluice-copy-archiver"} <= set(jobs)
    for name, job in jobs.items():
        spec = job["spec"]
        rules = spec["podFailurePolicy"]["rules"]
        assert {"action": "Ignore", "onPodConditions": [
            {"type": "DisruptionTarget", "status": "True"}]} in rules
        main_name = spec["template"]["spec"]["containers"][0]["name"]
        assert {"action": "FailJob", "onExitCodes": {
            "containerName": main_name, "operator": "In", "values": [78]}} in rules, name
        assert spec["podReplacementPolicy"] == "Failed"
        assert spec["template"]["spec"]["restartPolicy"] == "Never"
        assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
        assert spec["template"]["spec"]["schedulerName"] == "volcano"
    trainer = jobs["sluice-copy-trainer"]["spec"]
    assert trainer["completionMode"] == "Indexed" and trainer["parallelism"] == 2
    assert trainer["template"]["spec"]["terminationGracePeriodSeconds"] == 900
    assert jobs["sluice-copy-generator"]["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"] == 60
    budgets = {o["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]:
               o["spec"] for o in objects if o["kind"] == "PodDisruptionBudget"}
    assert budgets["trainer"]["minAvailable"] == 2 and budgets["redis"]["minAvailable"] == 1
    for obj, _ in pod_templates(objects):
        if obj["metadata"]["name"] in ("sluice-copy-trainer", "sluice-copy-redis"):
            notes = obj["spec"]["template"]["metadata"]["annotations"]
            assert notes["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
            assert notes["karpenter.sh/do-not-disrupt"] == "true"


CHILD = """
import pathlib, signal, sys, time
d = pathlib.Path(sys.argv[1])
def on(name):
    def handler(*_):
        (d / name).write_text("1")
        sys.exit(0)  # as a sluice role ends on SIGTERM: in order, status 0
    return handler
signal.signal(signal.SIGTERM, on("term"))
signal.signal(signal.SIGUSR2, on("usr2"))
if sys.argv[2] != "wait":
    sys.exit(int(sys.argv[2]))
(d / "ready").write_text("1")
while True:
    time.sleep(0.05)
"""


def test_a_role_stopped_by_a_signal_fails_its_pod_so_the_job_replaces_it(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """A role ends in order on SIGTERM with status 0, which would make an evicted or
    preempted pod Succeeded and its Job done (a preempted trainer never resumed). The
    rendered command, run by sh with a stand-in for the role: its own exits pass through
    (0 at the end of the run, 78), SIGTERM reaches it and the pod's status is 143,
    SIGUSR2 (the orderly end) reaches it and its 0 stands."""
    out = render_into(tmp_path / "k", "k8s", creds, "copy")
    jobs = jobs_by_name(docs(out))
    wrappers = {j["spec"]["template"]["spec"]["containers"][0]["command"][2]
                for j in jobs.values()}
    assert len(jobs) == 4 and len(wrappers) == 1
    trainer = jobs["sluice-copy-trainer"]["spec"]["template"]["spec"]["containers"][0]
    assert trainer["command"][:2] == ["sh", "-c"]
    assert trainer["command"][4:] == ["sluice", "train", "/etc/sluice/run.toml", "--set",
                                      "metrics.host=$(POD_IP)"]
    script = trainer["command"][2]
    assert "$(" not in script  # the kubelet would expand it

    def start(mode: str, where: Path) -> subprocess.Popen[bytes]:
        """As a container's first process starts: every signal at its default (sluice.cli,
        imported here, ignores SIGUSR2, and a shell cannot trap what it inherits ignored)."""
        where.mkdir()
        return subprocess.Popen(["sh", "-c", script, "trainer", sys.executable, "-c", CHILD,
                                 str(where), mode],
                                preexec_fn=lambda: signal.signal(signal.SIGUSR2, signal.SIG_DFL))

    def ready(where: Path, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + 60
        while not (where / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)

    assert start("0", tmp_path / "ok").wait(60) == 0
    assert start("78", tmp_path / "fatal").wait(60) == 78
    for sig, mark, status in ((signal.SIGTERM, "term", 143), (signal.SIGUSR2, "usr2", 0)):
        where = tmp_path / mark
        proc = start("wait", where)
        try:
            ready(where, proc)
            proc.send_signal(sig)
            assert proc.wait(60) == status
            assert (where / mark).exists()  # the role got the signal and stopped
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_autoscaling_is_off_unless_asked_and_needs_no_keda_then(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """A cluster without KEDA's CRDs refuses a ScaledObject: by default none is
    rendered, nor a NetworkPolicy rule for KEDA's operator."""
    out = render_into(tmp_path / "k", "k8s", creds, "copy")
    objects = kustomize(out)
    assert not [o for o in objects if o["apiVersion"].startswith("keda.sh/")]
    policy = next(o for o in objects if o["kind"] == "NetworkPolicy")
    assert len(policy["spec"]["ingress"][0]["from"]) == 1
