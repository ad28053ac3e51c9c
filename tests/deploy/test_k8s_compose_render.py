"""What the k8s and compose renders promise a real cluster or host, read off the rendered
objects (built by `kubectl kustomize` where kustomize decides a name): the run's cleanup
leaves its data, pods get a real /dev/shm, memory, a read-only root with writable
scratch, probes that test the servers themselves, Jobs that end with the run and free
their GPUs, preemption that does not count as failure, and the GPU image carries the
attention kernel where the trainer's offline check looks. No cluster, no engine: seconds
(one test runs the Redis probe against a real redis-server)."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.ports import free_port
from sluice.cli import main
from sluice.deploy import render
from sluice.deploy.containers import DATA_DIR
from tests.deploy.examples import EXAMPLES, ROOT, RUNS, credentials
from tests.deploy.test_validate import kustomize

GIB_MI = 1024


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("acl")
    return {ex: credentials(run, root / ex) for ex, run in RUNS.items()}


def _render(out: Path, target: str, creds: dict[str, Path], example: str = "gsm8k",
            *sets: str) -> Path:
    render(EXAMPLES[example], [f"bus.credentials_file={creds[example]}", *sets], target, out)
    return out


def _docs(out: Path) -> list[dict[str, Any]]:
    """Every object of every YAML file of a render (no kustomize)."""
    return [d for p in sorted(out.rglob("*.yaml")) if p.name != "kustomization.yaml"
            for d in yaml.safe_load_all(p.read_text()) if d]


def _pods(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, its pod template spec) for every object that makes pods."""
    for o in objects:
        tpl = o.get("spec", {}).get("template")
        if isinstance(tpl, dict) and "spec" in tpl:
            yield o, tpl["spec"]


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _mem_mi(q: str) -> int:
    assert q.endswith("Mi"), q
    return int(q[:-2])


def test_the_runs_cleanup_leaves_the_namespace_and_the_data(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """`kubectl delete -k DIR` deletes what DIR's kustomization builds: neither the
    Namespace (other runs live there) nor a PersistentVolumeClaim (checkpoints, weights,
    the model cache). The data volume is its own kustomization (DIR/data), which the
    pods name; the Redis volume outlives its StatefulSet."""
    out = _render(tmp_path / "k", "k8s", creds, "copy")
    run = kustomize(out)
    kinds = {o["kind"] for o in run}
    assert "Namespace" not in kinds and "PersistentVolumeClaim" not in kinds, kinds
    data = kustomize(out / "data")
    assert [o["kind"] for o in data] == ["PersistentVolumeClaim"]
    claim = data[0]["metadata"]["name"]
    assert data[0]["metadata"]["namespace"] == "sluice"
    for _, pod in _pods(run):
        claims = [v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", [])
                  if "persistentVolumeClaim" in v]
        assert claims in ([], [claim])
    ns = yaml.safe_load((out / "namespace.yaml").read_text())
    assert ns["kind"] == "Namespace" and ns["metadata"]["name"] == "sluice"
    sts = next(o for o in run if o["kind"] == "StatefulSet")
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Retain", "whenScaled": "Retain"}


def test_every_pod_gets_a_memory_backed_dev_shm_and_compose_a_shm_size(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    out = _render(tmp_path / "k", "k8s", creds, "gsm8k", "deploy.shm_gib=6")
    pods = list(_pods(_docs(out)))
    assert pods
    for obj, pod in pods:
        if obj["metadata"]["name"].endswith("-redis"):
            continue
        shm = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        assert len(shm) == 1, obj["metadata"]["name"]
        assert _mem_mi(shm[0]["emptyDir"]["sizeLimit"]) == 6 * GIB_MI
        for c in _containers(pod):
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert mounts.get("/dev/shm") == shm[0]["name"], c["name"]
    services = yaml.safe_load((_render(tmp_path / "c", "compose", creds, "gsm8k",
                                       "deploy.shm_gib=6") / "compose.yaml").read_text())
    for name, svc in services["services"].items():
        if name != "redis":
            assert svc["shm_size"] == f"{6 * GIB_MI}m", name


def test_image_pull_secrets_and_policy_reach_every_pod(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    out = _render(tmp_path / "k", "k8s", creds, "gsm8k",
                  'deploy.image_pull_secrets=["regcred","mirror"]',
                  "deploy.image_pull_policy=Always",
                  "deploy.image=registry.example.com/ml/sluice:0.1.0")
    pods = list(_pods(_docs(out)))
    assert len(pods) >= 5
    for _, pod in pods:
        assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
        assert {c["imagePullPolicy"] for c in _containers(pod)} == {"Always"}


def test_an_image_without_a_registry_is_named_at_render(
        tmp_path: Path, creds: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """`sluice:0.1.0` is pulled from Docker Hub, where it does not exist: the k8s render
    says so (naming the key) and still writes the files, for a cluster the image was
    loaded onto; a qualified image is not named; compose builds on its host."""
    args = ["deploy", "render", str(EXAMPLES["copy"]), "--set",
            f"bus.credentials_file={creds['copy']}"]
    assert main([*args, "--target", "k8s", "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "deploy.image" in err and "sluice:0.1.0" in err
    assert main([*args, "--target", "k8s", "--out", str(tmp_path / "b"), "--set",
                 "deploy.image=registry.example.com:5000/sluice:0.1.0"]) == 0
    assert "deploy.image" not in capsys.readouterr().err
    assert main([*args, "--target", "compose", "--out", str(tmp_path / "c")]) == 0
    assert "deploy.image" not in capsys.readouterr().err


def _stages(dockerfile: Path) -> list[list[str]]:
    """The instructions of each stage (continuation lines joined, comments dropped)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    stages: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        stages[-1].append(line)
    return stages


def _env(stage: list[str], key: str, kind: str = "ENV") -> str | None:
    """The value ``stage`` gives ``key`` in its last ``kind`` (ENV or ARG) instruction."""
    value = None
    for ins in stage:
        if ins.upper().startswith(f"{kind} "):
            for part in shlex.split(ins[4:]):
                k, _, v = part.partition("=")
                if k == key:
                    value = v
    return value


def test_the_gpu_image_keeps_the_kernels_setup_fetched_where_the_roles_look(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """setup.sh --gpu fetches the attention kernels with the `kernels` library, into its
    cache (KERNELS_CACHE, else the HF hub cache). A build has no GPU to ask, so the image
    names every NVIDIA kernel ``auto`` can pick, and setup.sh downloads without loading
    (no GPU needed). The build stage must fetch them into a folder the final stage
    copies, the final stage must point the library at the same folder, and that folder
    must not be under the volume mounted over /data (HF_HOME)."""
    from pipeline.attention import DeviceProps, kernels_to_cache

    build, final = _stages(ROOT / "deploy" / "docker" / "Dockerfile.gpu")
    fetch = next(i for i, ins in enumerate(build) if "deploy/setup.sh --gpu" in ins)
    named = set((_env(build[:fetch], "SLUICE_KERNELS", "ARG") or "").split())
    for capability in ((8, 0), (8, 9), (9, 0), (10, 0), (12, 0)):
        assert set(kernels_to_cache(DeviceProps("cuda", capability))) <= named, capability
    setup = (ROOT / "deploy" / "setup.sh").read_text()
    assert "install_kernel(" in setup and "get_kernel(" not in setup
    cache = _env(build[:fetch], "KERNELS_CACHE")
    assert cache, "the build stage fetches the kernels into the HF cache of root"
    assert _env(final, "KERNELS_CACHE") == cache
    copied = [shlex.split(ins)[-2:] for ins in final
              if ins.upper().startswith("COPY ") and "--from=build" in ins]
    assert any(src == dst and (cache + "/").startswith(src.rstrip("/") + "/")
               for src, dst in copied), copied
    assert not (cache + "/").startswith(DATA_DIR + "/")
    from kernels._internals.hf_hub import _get_cache_dir  # the library reads that variable

    monkeypatch.setenv("KERNELS_CACHE", cache)
    assert _get_cache_dir() == cache


def test_memory_is_requested_and_limited_everywhere(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """Every container of every pod has a memory request equal to its limit (the default
    when the key is 0 is not 0); the keys set it; compose sets mem_limit and cpus."""
    out = _render(tmp_path / "k", "k8s", creds, "gsm8k", "deploy.trainer_memory_gib=24",
                  "deploy.vllm_memory_gib=20")
    for obj, pod in _pods(_docs(out)):
        for c in _containers(pod):
            r = c["resources"]
            assert _mem_mi(r["requests"]["memory"]) > 0, (obj["metadata"]["name"], c["name"])
            assert r["limits"]["memory"] == r["requests"]["memory"]
            if c["name"] == "trainer":
                assert _mem_mi(r["limits"]["memory"]) == 24 * GIB_MI
            if c["name"].startswith("vllm-"):
                assert _mem_mi(r["limits"]["memory"]) == 20 * GIB_MI
                assert float(r["requests"]["cpu"]) >= 2  # a front end and the engine
    compose = yaml.safe_load((_render(tmp_path / "c", "compose", creds, "gsm8k")
                              / "compose.yaml").read_text())
    for name, svc in compose["services"].items():
        assert re.fullmatch(r"\d+m", svc["mem_limit"]) and int(svc["mem_limit"][:-1]) > 0, name
        assert float(svc["cpus"]) > 0, name


def _jobs(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "Job"}


def test_preemption_is_not_failure_and_the_trainer_is_protected(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """Every Job ignores disruptions (preemption, eviction, drain: not counted against
    its backoff), fails at once on exit 78 (no restart can fix it), replaces a pod only
    once it is gone (never two trainers or archivers at once); the trainer and Redis
    have disruption budgets and ask autoscalers not to evict them; the trainer gets its
    own, longer grace for its final checkpoint; gang admission through Kueue and a
    scheduler of the cluster's choice when asked."""
    out = _render(tmp_path / "k", "k8s", creds, "copy", "deploy.trainer_grace_s=900",
                  "deploy.queue_name=gpu-queue", "deploy.scheduler_name=volcano",
                  "up.trainer_ranks=2", "deploy.trainer_nodes=2", "archive.enabled=true",
                  "archive.path=archive")
    objects = _docs(out)
    jobs = _jobs(objects)
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
    for obj, _ in _pods(objects):
        if obj["metadata"]["name"] in ("sluice-copy-trainer", "sluice-copy-redis"):
            notes = obj["spec"]["template"]["metadata"]["annotations"]
            assert notes["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
            assert notes["karpenter.sh/do-not-disrupt"] == "true"


def test_roles_end_with_the_run_and_their_servers_with_them(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """Each role exits 0 once it has seen RunFinished: under a Deployment it would be
    restarted forever (and its vLLM sidecar keep its GPU). Every role is a Job whose pod
    completes on that exit, its vLLM servers native sidecars that end with it; only
    scorers scaled by KEDA stay a Deployment (KEDA scales no Job)."""
    out = _render(tmp_path / "k", "k8s", creds, "gsm8k")
    objects = _docs(out)
    assert not [o for o in objects if o["kind"] == "Deployment"]
    jobs = _jobs(objects)
    assert set(jobs) == {f"sluice-gsm8k-{r}"
                         for r in ("trainer", "generator", "scorer", "evaluator")}
    scorer = jobs["sluice-gsm8k-scorer"]["spec"]
    assert scorer["completionMode"] == "Indexed"
    assert scorer["completions"] == scorer["parallelism"] == 4  # up.scorers
    gen = jobs["sluice-gsm8k-generator"]["spec"]["template"]["spec"]
    sidecars = [c for c in gen["initContainers"] if c.get("restartPolicy") == "Always"]
    assert sidecars and all(c["resources"]["limits"]["nvidia.com/gpu"] == 1 for c in sidecars)
    scaled = _docs(_render(tmp_path / "a", "k8s", creds, "gsm8k", "deploy.autoscale=true"))
    assert [o["metadata"]["name"] for o in scaled if o["kind"] == "Deployment"] == [
        "sluice-gsm8k-scorer"]


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
    out = _render(tmp_path / "k", "k8s", creds, "copy")
    jobs = _jobs(_docs(out))
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


SECCOMP = {"type": "RuntimeDefault"}


def test_every_container_is_restricted_with_a_read_only_root(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """The Restricted Pod Security Standard's fields on every container, the root
    filesystem read-only, and scratch space where the roles write outside /data."""
    out = _render(tmp_path / "k", "k8s", creds, "gsm8k", "archive.enabled=true",
                  "archive.path=archive")
    for _, pod in _pods(_docs(out)):
        assert pod["securityContext"]["seccompProfile"] == SECCOMP
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in _containers(pod):
            sc = c["securityContext"]
            assert sc["seccompProfile"] == SECCOMP, c["name"]
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]}
            if c["name"] != "redis":
                mounts = {m["mountPath"] for m in c["volumeMounts"]}
                assert {"/tmp", DATA_DIR} <= mounts, (c["name"], mounts)
                env = {e["name"]: e.get("value") for e in c["env"]}
                assert env["HOME"] == "/tmp", c["name"]


def test_vllm_servers_are_probed_for_liveness_and_readiness(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    out = _render(tmp_path / "k", "k8s", creds, "gsm8k")
    sidecars = [c for _, pod in _pods(_docs(out)) for c in pod.get("initContainers", [])
                if c["name"].startswith("vllm-")]
    assert len(sidecars) == 2  # the generator's and the evaluator's
    for c in sidecars:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            p = c[probe]
            assert "/health" in " ".join(p["exec"]["command"]), probe
            assert p["timeoutSeconds"] >= 3  # the probe itself waits up to 2 s


def test_redis_is_governed_by_a_headless_service_and_the_config_is_hashed(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """The StatefulSet's serviceName names a headless Service; the ConfigMap's name
    carries kustomize's content hash (a new config, new pods), the pods name it; the
    Secrets keep plain names (KEDA's TriggerAuthentication names one)."""
    out = _render(tmp_path / "k", "k8s", creds, "copy")
    objects = kustomize(out)
    sts = next(o for o in objects if o["kind"] == "StatefulSet")
    governing = next(o for o in objects if o["kind"] == "Service"
                     and o["metadata"]["name"] == sts["spec"]["serviceName"])
    assert governing["spec"]["clusterIP"] == "None"
    config = [o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"]
    assert len(config) == 1 and re.fullmatch(r"sluice-copy-config-[a-z0-9]{10}", config[0])
    for obj, pod in _pods(objects):
        names = [v["configMap"]["name"] for v in pod.get("volumes", []) if "configMap" in v]
        if obj["kind"] != "StatefulSet":
            assert names == config, obj["metadata"]["name"]
    secrets = {o["metadata"]["name"] for o in objects if o["kind"] == "Secret"}
    assert "sluice-copy-monitor" in secrets


def test_autoscaling_is_off_unless_asked_and_needs_no_keda_then(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """A cluster without KEDA's CRDs refuses a ScaledObject: by default none is
    rendered, nor a NetworkPolicy rule for KEDA's operator."""
    out = _render(tmp_path / "k", "k8s", creds, "copy")
    objects = kustomize(out)
    assert not [o for o in objects if o["apiVersion"].startswith("keda.sh/")]
    policy = next(o for o in objects if o["kind"] == "NetworkPolicy")
    assert len(policy["spec"]["ingress"][0]["from"]) == 1


def _probe(container: dict[str, Any], kind: str) -> list[str]:
    return container[kind]["exec"]["command"]


def test_the_redis_probes_ping_the_server_as_the_monitor(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """The rendered readiness and liveness commands, run against a real redis-server
    loaded with the rendered users.acl and the monitor's rendered Secret as environment:
    both pass once it answers PONG; with a wrong password readiness fails (redis-cli
    itself exits 0 on NOAUTH, so the command must read the reply)."""
    port = free_port()
    out = _render(tmp_path / "k", "k8s", creds, "copy", f"deploy.redis_port={port}")
    sts = next(o for o in _docs(out) if o["kind"] == "StatefulSet")
    redis = sts["spec"]["template"]["spec"]["containers"][0]
    assert [e["secretRef"]["name"] for e in redis["envFrom"]] == ["sluice-copy-monitor"]
    for kind in ("readinessProbe", "livenessProbe"):  # the kubelet expands $(NAME) here
        assert "$(" not in " ".join(_probe(redis, kind))
    env = dict(os.environ)
    for line in (out / "secrets" / "monitor.env").read_text().splitlines():
        k, _, v = line.partition("=")
        env[k] = v
    data = tmp_path / "redis"
    data.mkdir()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--dir", str(data),
                             "--aclfile", str(out / "secrets" / "users.acl")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def run(kind: str, environ: dict[str, str]) -> int:
            return subprocess.run(_probe(redis, kind), env=environ, capture_output=True,
                                  timeout=30).returncode

        deadline = time.monotonic() + 60
        while run("readinessProbe", env) != 0:
            assert proc.poll() is None, "redis-server exited"
            assert time.monotonic() < deadline, "the readiness probe never passed"
            time.sleep(0.1)
        assert run("livenessProbe", env) == 0
        wrong = {**env, "SLUICE_REDIS_MONITOR_PASSWORD": "not-the-password"}
        assert run("readinessProbe", wrong) != 0
    finally:
        proc.terminate()
        proc.wait(30)
