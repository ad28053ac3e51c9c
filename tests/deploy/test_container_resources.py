"""What k8s pods and compose services get to run on a real host: a memory-backed /dev/shm,
memory requested and limited (never 0), images pulled with the policy and secrets asked
for (and a note when an image names no registry), and a GPU image that carries the
attention kernels where the trainer's offline start check finds them (read from the
Dockerfile: no container engine here). Seconds."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from sluice.cli import main
from sluice.deploy.containers import DATA_DIR
from tests.deploy.examples import EXAMPLES, ROOT
from tests.deploy.rendered import (
    GIB_MI,
    containers,
    docs,
    fresh_credentials,
    mem_mi,
    pod_templates,
    render_into,
)


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return fresh_credentials(tmp_path_factory.mktemp("acl"))


def test_every_pod_gets_a_memory_backed_dev_shm_and_compose_a_shm_size(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    out = render_into(tmp_path / "k", "k8s", creds, "gsm8k", "deploy.shm_gib=6")
    pods = list(pod_templates(docs(out)))
    assert pods
    for obj, pod in pods:
        if obj["metadata"]["name"].endswith("-redis"):
            continue
        shm = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        assert len(shm) == 1, obj["metadata"]["name"]
        assert mem_mi(shm[0]["emptyDir"]["sizeLimit"]) == 6 * GIB_MI
        for c in containers(pod):
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert mounts.get("/dev/shm") == shm[0]["name"], c["name"]
    services = yaml.safe_load((render_into(tmp_path / "c", "compose", creds, "gsm8k",
                                       "deploy.shm_gib=6") / "compose.yaml").read_text())
    for name, svc in services["services"].items():
        if name != "redis":
            assert svc["shm_size"] == f"{6 * GIB_MI}m", name


def test_memory_is_requested_and_limited_everywhere(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """Every container of every pod has a memory request equal to its limit (the default
    when the key is 0 is not 0); the keys set it; compose sets mem_limit and cpus."""
    out = render_into(tmp_path / "k", "k8s", creds, "gsm8k", "deploy.trainer_memory_gib=24",
                  "deploy.vllm_memory_gib=20")
    for obj, pod in pod_templates(docs(out)):
        for c in containers(pod):
            r = c["resources"]
            assert mem_mi(r["requests"]["memory"]) > 0, (obj["metadata"]["name"], c["name"])
            assert r["limits"]["memory"] == r["requests"]["memory"]
            if c["name"] == "trainer":
                assert mem_mi(r["limits"]["memory"]) == 24 * GIB_MI
            if c["name"].startswith("vllm-"):
                assert mem_mi(r["limits"]["memory"]) == 20 * GIB_MI
                assert float(r["requests"]["cpu"]) >= 2  # a front end and the engine
    compose = yaml.safe_load((render_into(tmp_path / "c", "compose", creds, "gsm8k")
                              / "compose.yaml").read_text())
    for name, svc in compose["services"].items():
        assert re.fullmatch(r"\d+m", svc["mem_limit"]) and int(svc["mem_limit"][:-1]) > 0, name
        assert float(svc["cpus"]) > 0, name


def test_image_pull_secrets_and_policy_reach_every_pod(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    out = render_into(tmp_path / "k", "k8s", creds, "gsm8k",
                  'deploy.image_pull_secrets=["regcred","mirror"]',
                  "deploy.image_pull_policy=Always",
                  "deploy.image=registry.example.com/ml/sluice:0.1.0")
    pods = list(pod_templates(docs(out)))
    assert len(pods) >= 5
    for _, pod in pods:
        assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]
        assert {c["imagePullPolicy"] for c in containers(pod)} == {"Always"}


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
