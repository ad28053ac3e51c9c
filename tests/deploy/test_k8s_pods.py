"""The k8s render's pods and Redis: every container restricted (seccomp, a read-only root
with writable scratch), vLLM servers probed for liveness and readiness, Redis governed
by a headless Service and probed by PING as the monitor user (run against a real
redis-server with the rendered ACL), the config's ConfigMap hashed. Seconds."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.ports import free_port
from sluice.deploy.containers import DATA_DIR
from tests.deploy.rendered import containers, docs, fresh_credentials, pod_templates, render_into
from tests.deploy.test_validate import kustomize


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return fresh_credentials(tmp_path_factory.mktemp("acl"))


SECCOMP = {"type": "RuntimeDefault"}


def test_every_container_is_restricted_with_a_read_only_root(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """The Restricted Pod Security Standard's fields on every container, the root
    filesystem read-only, and scratch space where the roles write outside /data."""
    out = render_into(tmp_path / "k", "k8s", creds, "gsm8k", "archive.enabled=true",
                  "archive.path=archive")
    for _, pod in pod_templates(docs(out)):
        assert pod["securityContext"]["seccompProfile"] == SECCOMP
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in containers(pod):
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
    out = render_into(tmp_path / "k", "k8s", creds, "gsm8k")
    sidecars = [c for _, pod in pod_templates(docs(out)) for c in pod.get("initContainers", [])
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
    out = render_into(tmp_path / "k", "k8s", creds, "copy")
    objects = kustomize(out)
    sts = next(o for o in objects if o["kind"] == "StatefulSet")
    governing = next(o for o in objects if o["kind"] == "Service"
                     and o["metadata"]["name"] == sts["spec"]["serviceName"])
    assert governing["spec"]["clusterIP"] == "None"
    config = [o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"]
    assert len(config) == 1 and re.fullmatch(r"sluice-copy-config-[a-z0-9]{10}", config[0])
    for obj, pod in pod_templates(objects):
        names = [v["configMap"]["name"] for v in pod.get("volumes", []) if "configMap" in v]
        if obj["kind"] != "StatefulSet":
            assert names == config, obj["metadata"]["name"]
    secrets = {o["metadata"]["name"] for o in objects if o["kind"] == "Secret"}
    assert "sluice-copy-monitor" in secrets


def _probe(container: dict[str, Any], kind: str) -> list[str]:
    return container[kind]["exec"]["command"]


def test_the_redis_probes_ping_the_server_as_the_monitor(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """The rendered readiness and liveness commands, run against a real redis-server
    loaded with the rendered users.acl and the monitor's rendered Secret as environment:
    both pass once it answers PONG; with a wrong password readiness fails (redis-cli
    itself exits 0 on NOAUTH, so the command must read the reply)."""
    port = free_port()
    out = render_into(tmp_path / "k", "k8s", creds, "copy", f"deploy.redis_port={port}")
    sts = next(o for o in docs(out) if o["kind"] == "StatefulSet")
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
