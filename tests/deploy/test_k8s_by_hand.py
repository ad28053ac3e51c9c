"""The k8s render's pods "by hand": the copy example's Redis and roles, each started as
its rendered pod spec says, on hosts of their own, find Redis by the rendered Service's
name and log in with the rendered Secrets, and the run trains to its end and audits OK.

What it proves: the names the rendered objects give one another agree. The roles get
``bus.redis_url`` only from the rendered ConfigMap's run.toml and their Redis identity
only from the rendered Secrets (``envFrom``/``secretKeyRef``, resolved from the render's
``secrets/`` files as its kustomization.yaml's secretGenerator names them), and Redis
runs the rendered container command with the rendered ACL file: if the URL's host is not
the Service's name, or a Secret's user or password is not the ACL file's, a role cannot
reach Redis and the test fails. Each pod is a network namespace of its own (its own
address, as a pod's; every role serves /metrics on ``$(POD_IP)`` and the same port), on
one bridge: Redis is reached over a (virtual) network, never over a shared loopback.

What it does not prove: there is no kubelet, no kube-proxy and no kube-dns. A name
resolves through the host's /etc/hosts and nothing else (the Service's name is the Redis
host's address, as kube-dns would give the Service's ClusterIP); no ClusterIP,
NetworkPolicy, probe schedule, securityContext, resource limit, restart or backoff
policy is applied. The images are not built: the checkout's venv stands for the image's
/app/.venv and runs the commands, and the machine's redis-server stands for the redis
image. Only what a kubelet would do is done here, by the test: mounts become folders
(the ConfigMap's and Secrets' files written out, one shared folder for the data volume,
one per pod for emptyDirs), ``$(VAR)`` in args expanded from the container's env,
``status.podIP`` filled in, init containers run in order before the pod's container.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest
import yaml

from tests.deploy.netns import NetnsUnavailable, TestNetwork
from tests.deploy.rendered import docs, fresh_credentials, pod_templates, render_into

pytestmark = [pytest.mark.e2e]

SETS = ("trainer.max_steps=5", "up.scorers=1", "up.generators=1", "task.heldout=16",
        "eval.every_s=5")
ROLE_JOBS = ("trainer", "scorer", "generator", "evaluator")  # components, by label
RUN_TIMEOUT_S = 300.0  # the trainer's run to max_steps (about a minute here)
DRAIN_TIMEOUT_S = 120.0  # the other Jobs' pods, once the trainer is done
VENV_BIN = str(Path(sys.executable).parent)  # stands for the image's /app/.venv/bin
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Prefixed to every command in a namespace (whose own mount namespace `exec_argv` has
# made): /etc/resolv.conf naming only the namespace's loopback, where nothing answers,
# so a name resolves through the host's /etc/hosts or not at all (no query leaves for
# this machine's resolvers, and a wrong name fails at once instead of timing out).
HOSTS_ONLY = ["sh", "-c", 'mount --bind "$0" /etc/resolv.conf && exec "$@"']
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")  # the kubelet's $(VAR)


# -- what the render says, read as kustomize would ----------------------------------


def _env_file(path: Path) -> dict[str, str]:
    """A secretGenerator ``envs`` file: KEY=VALUE lines (kustomize's format)."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path}: not KEY=VALUE: {line!r}"
            out[key.strip()] = value
    return out


def _generated(out: Path, generator: str) -> dict[str, dict[str, str]]:
    """Name -> data of every object of the kustomization's ``generator``
    (secretGenerator / configMapGenerator): ``envs`` files' KEY=VALUE lines and
    ``files`` entries (``key=path`` or ``path``, keyed by its file name)."""
    kust = yaml.safe_load((out / "kustomization.yaml").read_text())
    made: dict[str, dict[str, str]] = {}
    for g in kust.get(generator, []):
        data: dict[str, str] = {}
        for env in g.get("envs", []):
            data.update(_env_file(out / env))
        for f in g.get("files", []):
            key, sep, rel = f.partition("=")
            if not sep:
                key, rel = Path(f).name, f
            data[key] = (out / rel).read_text()
        made[g["name"]] = data
    return made


@dataclass
class Pod:
    """One pod of a workload, as this test runs it: its host, its volumes as folders and
    its containers (init containers first), each started when the one before exits 0."""

    name: str  # the workload's name; also the host's
    spec: dict[str, Any]
    host_addr: str = ""
    mounts: dict[str, dict[str, Path]] = field(default_factory=dict)  # container -> mounts
    queue: list[dict[str, Any]] = field(default_factory=list)
    current: tuple[str, subprocess.Popen[bytes]] | None = None
    rcs: dict[str, int] = field(default_factory=dict)

    @property
    def main(self) -> str:
        return str(self.spec["containers"][0]["name"])


def _volumes(pod: dict[str, Any], root: Path, data: Path, configmaps: dict[str, dict[str, str]],
             secrets: dict[str, dict[str, str]]) -> dict[str, Path]:
    """Volume name -> the folder standing for it: a ConfigMap's or Secret's keys written
    out as files, every PersistentVolumeClaim (and claim template) the one shared data
    folder, an emptyDir a folder of this pod's own."""
    out: dict[str, Path] = {}
    for v in pod.get("volumes", []):
        d = root / "volumes" / v["name"]
        if "configMap" in v or "secret" in v:
            items = (configmaps[v["configMap"]["name"]] if "configMap" in v
                     else secrets[v["secret"]["secretName"]])
            d.mkdir(parents=True)
            for key, text in items.items():
                (d / key).write_text(text)
                (d / key).chmod(0o600)
            out[v["name"]] = d
        elif "persistentVolumeClaim" in v:
            out[v["name"]] = data
        elif "emptyDir" in v:
            d.mkdir(parents=True)
            out[v["name"]] = d
        else:
            raise AssertionError(f"a volume this test cannot stand in for: {v}")
    return out


def _rewrite(s: str, mounts: dict[str, Path]) -> str:
    """A container path under one of ``mounts`` (mountPath -> folder) as the folder's
    path; any other string unchanged."""
    for mount in sorted(mounts, key=len, reverse=True):
        if s == mount or s.startswith(mount.rstrip("/") + "/"):
            return str(mounts[mount]) + s[len(mount.rstrip("/")):]
    return s


def _expand(s: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion of command, args and env values."""
    return VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), s)


def _container_env(c: dict[str, Any], mounts: dict[str, Path], secrets: dict[str, dict[str, str]],
                   pod_ip: str) -> dict[str, str]:
    """The container's environment as the pod spec gives it (``envFrom`` first, then
    ``env``), with PATH as the image sets it (its venv first) and nothing else: no
    variable of this test process leaks in."""
    env = {"PATH": f"{VENV_BIN}:{SYSTEM_PATH}"}
    for src in c.get("envFrom", []):
        assert set(src) == {"secretRef"}, src
        env.update(secrets[src["secretRef"]["name"]])
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = _rewrite(_expand(e["value"], env), mounts)
            continue
        ref = e["valueFrom"]
        if "secretKeyRef" in ref:
            env[e["name"]] = secrets[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
        elif ref.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[e["name"]] = pod_ip
        else:
            raise AssertionError(f"an env source this test cannot stand in for: {e}")
    return env


def _container_argv(c: dict[str, Any], mounts: dict[str, Path], env: dict[str, str]
                    ) -> list[str]:
    return [_rewrite(_expand(a, env), mounts) for a in [*c.get("command", []),
                                                        *c.get("args", [])]]


def _container_mounts(c: dict[str, Any], volumes: dict[str, Path]) -> dict[str, Path]:
    out = {}
    for m in c.get("volumeMounts", []):
        assert "subPath" not in m, m
        out[m["mountPath"]] = volumes[m["name"]]
    return out


# -- the test -------------------------------------------------------------------------


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else "(no log)"


def test_roles_by_hand_find_redis_by_the_service_name_and_log_in_with_the_secrets(
        tmp_path: Path) -> None:
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed")
    creds = fresh_credentials(tmp_path / "acl")
    out = render_into(tmp_path / "render", "k8s", creds, "copy", *SETS)
    objects = docs(out)
    secrets = _generated(out, "secretGenerator")
    configmaps = _generated(out, "configMapGenerator")
    workloads = {o["metadata"]["labels"]["app.kubernetes.io/component"]: (o, pod)
                 for o, pod in pod_templates(objects)}
    assert set(workloads) == {"redis", *ROLE_JOBS}, set(workloads)
    redis_obj = workloads["redis"][0]
    # The Service the roles reach Redis by: the one (not headless) that selects its pods.
    labels = redis_obj["spec"]["template"]["metadata"]["labels"]
    services = [o for o in objects if o["kind"] == "Service"
                and o["spec"].get("clusterIP") != "None"
                and o["spec"]["selector"].items() <= labels.items()]
    assert len(services) == 1, services
    service = services[0]["metadata"]["name"]
    assert len(configmaps) == 1, configmaps
    run_toml = next(iter(configmaps.values()))["run.toml"]

    data = tmp_path / "data"  # the shared data volume (/data of every role)
    redis_data = tmp_path / "redis-data"  # the StatefulSet's volume claim
    data.mkdir()
    redis_data.mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    names = [service, *(workloads[r][0]["metadata"]["name"] for r in ROLE_JOBS)]
    net = TestNetwork(names, controller="sluice-test-controller")
    pods: list[Pod] = []
    log_files: list[IO[bytes]] = []
    started: list[subprocess.Popen[bytes]] = []

    resolv = tmp_path / "resolv.conf"
    resolv.write_text("nameserver 127.0.0.1\n")

    def as_host(host: str, argv: list[str]) -> list[str]:
        return net.exec_argv(host, [*HOSTS_ONLY, str(resolv), *argv])

    def start(pod: Pod, c: dict[str, Any], host: str) -> subprocess.Popen[bytes]:
        mounts = pod.mounts[c["name"]]
        env = _container_env(c, mounts, secrets, pod.host_addr)
        argv = _container_argv(c, mounts, env)
        if c["name"] == "redis":  # bind this host's own addresses, never every interface
            assert "--bind" not in argv, argv
            argv += ["--bind", pod.host_addr, "127.0.0.1"]
        cwd = _rewrite(c.get("workingDir", "/data"), mounts)  # both images: WORKDIR /data
        log = open(logs / f"{pod.name}-{c['name']}.log", "wb")
        log_files.append(log)
        p = subprocess.Popen(as_host(host, argv), cwd=cwd, env=env, stdout=log,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        started.append(p)
        return p

    try:
        try:
            net.create()
        except NetnsUnavailable as e:
            pytest.skip(str(e))
        for host, (obj, spec) in zip(names, [workloads["redis"],
                                             *(workloads[r] for r in ROLE_JOBS)], strict=True):
            pod = Pod(host, spec, net.addrs[host])
            root = tmp_path / "pods" / obj["metadata"]["name"]
            vols = _volumes(spec, root, data, configmaps, secrets)
            for claim in obj["spec"].get("volumeClaimTemplates", []):  # the StatefulSet's
                vols[claim["metadata"]["name"]] = redis_data
            for c in [*spec.get("initContainers", []), *spec["containers"]]:
                pod.mounts[c["name"]] = _container_mounts(c, vols)
            pod.queue = [*spec.get("initContainers", []), *spec["containers"]]
            pods.append(pod)
        redis, roles = pods[0], pods[1:]

        # Redis first, ready by its own rendered readiness probe (as the monitor user).
        assert len(redis.queue) == 1, redis.queue
        rcon = redis.queue.pop()
        server = start(redis, rcon, redis.name)
        probe_env = _container_env(rcon, redis.mounts[rcon["name"]], secrets, redis.host_addr)
        probe = rcon["readinessProbe"]["exec"]["command"]  # redis-cli to 127.0.0.1
        deadline = time.monotonic() + 30
        while subprocess.run(as_host(redis.name, probe), env=probe_env,
                             capture_output=True, timeout=30).returncode:
            assert server.poll() is None, _tail(logs / f"{redis.name}-{rcon['name']}.log")
            assert time.monotonic() < deadline, "Redis never became ready by its probe"
            time.sleep(0.2)

        # Every role's pod: its init containers in order, then its container.
        trainer = roles[0]
        deadline = time.monotonic() + RUN_TIMEOUT_S
        drain_deadline: float | None = None
        while True:
            for pod in roles:
                if pod.current is not None:
                    name, p = pod.current
                    rc = p.poll()
                    if rc is None:
                        continue
                    pod.rcs[name] = rc
                    pod.current = None
                    if rc != 0:
                        pod.queue.clear()  # restartPolicy Never: the pod has failed
                if pod.current is None and pod.queue:  # the one before exited 0
                    c = pod.queue.pop(0)
                    pod.current = (c["name"], start(pod, c, pod.name))
            failed = {f"{p.name}/{n}": rc for p in roles for n, rc in p.rcs.items() if rc}
            assert not failed, (failed, {k: _tail(logs / f"{k.replace('/', '-')}.log")
                                         for k in failed})
            if trainer.main in trainer.rcs and drain_deadline is None:
                drain_deadline = time.monotonic() + DRAIN_TIMEOUT_S
            if all(p.main in p.rcs for p in roles):
                break
            now = time.monotonic()
            assert now < deadline, ("the trainer did not finish",
                                    _tail(logs / f"{trainer.name}-trainer.log"))
            assert drain_deadline is None or now < drain_deadline, (
                "roles did not exit after the trainer",
                {p.name: _tail(logs / f"{p.name}-{p.main}.log") for p in roles
                 if p.main not in p.rcs})
            time.sleep(0.5)

        # The run's delivery history, audited against its Redis as the monitor role (its
        # rendered Secret), from the trainer's host, with the rendered run.toml.
        tc = trainer.spec["containers"][0]
        mounts = trainer.mounts[tc["name"]]
        monitor = next(s for s in secrets.values() if "SLUICE_REDIS_MONITOR_USERNAME" in s)
        env = {"PATH": f"{VENV_BIN}:{SYSTEM_PATH}", "HOME": str(mounts["/tmp"]), **monitor}
        config = tomllib.loads(run_toml)
        audit = subprocess.run(
            as_host(trainer.name, ["sluice", "audit", config["run"]["output_dir"],
                                         "--config", _rewrite("/etc/sluice/run.toml", mounts)]),
            cwd=_rewrite(tc["workingDir"], mounts), env=env, capture_output=True, text=True,
            timeout=120)
        assert audit.returncode == 0 and "OK:" in audit.stdout, (audit.stdout, audit.stderr)
    finally:
        for p in reversed(started):
            if p.poll() is None:
                p.terminate()
        for p in started:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=15)
        net.kill_all()
        net.cleanup()
        for f in log_files:
            f.close()
