"""TLS in the k8s and compose renders (``deploy.redis_tls_dir``, an external rediss://):
the bundled Redis serves TLS only with its key mounted in its own pod alone, every role
gets ``rediss://`` and the CA at one mount point, KEDA gets TLS from its
TriggerAuthentication (never also ``enableTLS``, which KEDA refuses), and a certificate
that does not name an address the render uses is refused at render time. The last test
runs the rendered Redis command, its rendered probe and a role's rendered settings
against a real redis-server with certificates `sluice deploy certs` made.

The Slurm target's TLS runs for real in tests/deploy/test_slurm.py.
"""

from __future__ import annotations

import os
import subprocess
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from pipeline.bus.security import TLSFiles, client_options
from pipeline.config import ConfigError
from pipeline.ports import free_port
from sluice.deploy.certs import make_certs
from sluice.deploy.containers import REDIS_TLS_DIR, ROLE_TLS_DIR
from tests.deploy.rendered import containers, docs, fresh_credentials, pod_templates, render_into

NAMES = ["sluice-copy-redis", "sluice-copy-redis.sluice.svc", "redis", "127.0.0.1"]


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return fresh_credentials(tmp_path_factory.mktemp("acl"))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("certs") / "tls"
    make_certs(d, NAMES)
    return d


@pytest.fixture(autouse=True)
def _no_env_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLUICE_REDIS_CREDENTIALS_FILE", raising=False)


def _run_toml(out: Path) -> dict[str, Any]:
    return tomllib.loads((out / "run.toml").read_text())


def _mounts(c: dict[str, Any]) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}


def test_k8s_bundled_tls(tmp_path: Path, creds: dict[str, Path], certs: Path) -> None:
    out = render_into(tmp_path / "k", "k8s", creds, "copy", f"deploy.redis_tls_dir={certs}",
                      "deploy.autoscale=true")
    bus = _run_toml(out)["bus"]
    assert bus["redis_url"] == "rediss://sluice-copy-redis:6379/0"
    assert bus["tls_ca_file"] == f"{ROLE_TLS_DIR}/ca.crt"
    objects = docs(out)
    checked = []
    for o, pod in pod_templates(objects):
        secrets = {v["name"]: v.get("secret", {}).get("secretName") for v in
                   pod.get("volumes", [])}
        for c in containers(pod):
            if o["kind"] == "StatefulSet":  # Redis: TLS only, its key from its own Secret
                argv = c["command"]
                assert argv[argv.index("--port") + 1] == "0"
                assert argv[argv.index("--tls-port") + 1] == "6379"
                assert _mounts(c)[REDIS_TLS_DIR] == "tls"
                assert secrets["tls"] == "sluice-copy-redis-tls"
                for probe in ("readinessProbe", "livenessProbe"):
                    assert f"--tls --cacert {REDIS_TLS_DIR}/ca.crt" in \
                        c[probe]["exec"]["command"][-1]
            elif c["image"].startswith(("sluice", "localhost")) and "vllm" not in c["name"]:
                assert _mounts(c).get(ROLE_TLS_DIR) == "tls", (o["metadata"]["name"], c["name"])
                assert secrets["tls"] == "sluice-copy-tls"  # CA only: never the server key
                checked.append(o["metadata"]["name"])
    assert {"sluice-copy-trainer", "sluice-copy-scorer", "sluice-copy-evaluator"} <= set(
        checked), checked
    kust = yaml.safe_load((out / "kustomization.yaml").read_text())
    gen = {s["name"]: s for s in kust["secretGenerator"]}
    assert gen["sluice-copy-tls"]["files"] == ["secrets/tls/ca.crt"]
    assert gen["sluice-copy-tls"]["literals"] == ["tls=enable"]
    assert sorted(gen["sluice-copy-redis-tls"]["files"]) == [
        "secrets/redis-tls/ca.crt", "secrets/redis-tls/redis.crt", "secrets/redis-tls/redis.key"]
    assert not (out / "secrets" / "tls" / "redis.key").exists()
    auth = next(o for o in objects if o["kind"] == "TriggerAuthentication")
    refs = {r["parameter"]: (r["name"], r["key"]) for r in auth["spec"]["secretTargetRef"]}
    assert refs["tls"] == ("sluice-copy-tls", "tls") and refs["ca"] == ("sluice-copy-tls",
                                                                        "ca.crt")
    so = next(o for o in objects if o["kind"] == "ScaledObject")
    for t in so["spec"]["triggers"]:
        assert "enableTLS" not in t["metadata"]  # KEDA: not in both places
        assert t["authenticationRef"]["name"] == "sluice-copy-keda"


def test_external_rediss_ships_the_client_files_and_keda_gets_them(
        tmp_path: Path, creds: dict[str, Path], certs: Path) -> None:
    out = render_into(tmp_path / "k", "k8s", creds, "copy", 'deploy.redis="external"',
                      'bus.redis_url="rediss://redis.example:6380/0"', "deploy.autoscale=true",
                      f"bus.tls_ca_file={certs / 'ca.crt'}",
                      f"bus.tls_cert_file={certs / 'redis.crt'}",
                      f"bus.tls_key_file={certs / 'redis.key'}")
    bus = _run_toml(out)["bus"]
    assert (bus["tls_ca_file"], bus["tls_cert_file"], bus["tls_key_file"]) == tuple(
        f"{ROLE_TLS_DIR}/{n}" for n in ("ca.crt", "client.crt", "client.key"))
    assert sorted(p.name for p in (out / "secrets" / "tls").iterdir()) == [
        "ca.crt", "client.crt", "client.key"]
    assert not (out / "secrets" / "redis-tls").exists()
    auth = next(o for o in docs(out) if o["kind"] == "TriggerAuthentication")
    assert {r["parameter"] for r in auth["spec"]["secretTargetRef"]} >= {"tls", "ca", "cert",
                                                                         "key"}


def test_compose_bundled_tls(tmp_path: Path, creds: dict[str, Path], certs: Path) -> None:
    out = render_into(tmp_path / "c", "compose", creds, "copy", f"deploy.redis_tls_dir={certs}")
    assert _run_toml(out)["bus"]["redis_url"] == "rediss://redis:6379/0"
    services = yaml.safe_load((out / "compose.yaml").read_text())["services"]
    assert f"./secrets/redis-tls:{REDIS_TLS_DIR}:ro" in services["redis"]["volumes"]
    assert services["redis"]["command"][1:5] == ["--port", "0", "--tls-port", "6379"]
    for name in ("trainer", "scorer", "generator-0", "evaluator"):
        vols = services[name]["volumes"]
        assert f"./secrets/tls:{ROLE_TLS_DIR}:ro" in vols and not any(
            "redis-tls" in v for v in vols), name
    # the containers run as their images' users: readable files in the 0700 folder
    assert (out / "secrets" / "redis-tls" / "redis.key").stat().st_mode & 0o777 == 0o644
    assert (out / "secrets").stat().st_mode & 0o777 == 0o700


def test_a_certificate_without_the_renders_names_is_refused(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    narrow = tmp_path / "narrow"
    make_certs(narrow, ["sluice-copy-redis"])
    with pytest.raises(ConfigError, match=r"not 'redis' .*--host redis"):
        render_into(tmp_path / "c", "compose", creds, "copy", f"deploy.redis_tls_dir={narrow}")
    with pytest.raises(ConfigError, match=r"not 'sluice-copy-redis.sluice.svc' \(KEDA"):
        render_into(tmp_path / "k", "k8s", creds, "copy", f"deploy.redis_tls_dir={narrow}",
                    "deploy.autoscale=true")
    assert not (tmp_path / "c").exists() and not (tmp_path / "k").exists()


@pytest.mark.integration
def test_the_rendered_redis_serves_tls_to_the_rendered_role_settings(
        tmp_path: Path, creds: dict[str, Path], certs: Path) -> None:
    """The k8s render's Redis command and readiness probe, and a role's run.toml
    settings, with the mount points replaced by the render's secrets folders: a real
    redis-server serves them over TLS only."""
    port = free_port()
    out = render_into(tmp_path / "k", "k8s", creds, "copy", f"deploy.redis_tls_dir={certs}",
                      f"deploy.redis_port={port}")
    secrets = out / "secrets"
    sts = next(o for o in docs(out) if o["kind"] == "StatefulSet")
    c = sts["spec"]["template"]["spec"]["containers"][0]

    def local(words: list[str]) -> list[str]:
        return [w.replace(REDIS_TLS_DIR, str(secrets / "redis-tls"))
                .replace("/etc/redis/users.acl", str(secrets / "users.acl"))
                .replace("--dir /data", "") for w in words]

    data = tmp_path / "redis"
    data.mkdir()
    argv = local(c["command"])
    argv[argv.index("--dir") + 1] = str(data)
    env = dict(os.environ)
    for line in (secrets / "monitor.env").read_text().splitlines():
        k, _, v = line.partition("=")
        env[k] = v
    proc = subprocess.Popen([*argv, "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        probe = local(c["readinessProbe"]["exec"]["command"])
        deadline = time.monotonic() + 60
        while subprocess.run(probe, env=env, capture_output=True, timeout=30).returncode:
            assert proc.poll() is None, "redis-server exited"
            assert time.monotonic() < deadline, "the rendered readiness probe never passed"
            time.sleep(0.1)
        bus = _run_toml(out)["bus"]
        ca = bus["tls_ca_file"].replace(ROLE_TLS_DIR, str(secrets / "tls"))
        url = bus["redis_url"].replace("sluice-copy-redis", "127.0.0.1")
        user = dict(line.split("=", 1) for line in
                    (secrets / "scorer.env").read_text().splitlines())
        opts = client_options(url, username=user["SLUICE_REDIS_SCORER_USERNAME"],
                              password=user["SLUICE_REDIS_SCORER_PASSWORD"],
                              tls=TLSFiles(ca))
        assert redis.Redis.from_url(url, **opts).ping()
        with pytest.raises(redis.ConnectionError):  # nothing in the clear
            redis.Redis.from_url(f"redis://127.0.0.1:{port}/0", socket_timeout=5).ping()
    finally:
        proc.terminate()
        proc.wait(30)
