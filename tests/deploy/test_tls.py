"""TLS of a deployment's Redis (sluice.deploy.tls, `sluice deploy certs`): the files are
checked at render time naming their key, a bundled Redis's certificate must name the
address the roles use, and a real redis-server started with exactly the rendered flags
and `sluice deploy certs`' files serves TLS only: a role configured with the rendered
settings logs in, a plaintext client and a client that does not trust the CA are refused.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import redis

from pipeline.bus.security import TLSFiles, client_options
from pipeline.config import Config, ConfigError, load_config
from pipeline.ports import free_port
from sluice.cli import main
from sluice.deploy.certs import make_certs
from sluice.deploy.tls import certificate_names, check_names, deploy_tls
from tests.deploy.examples import EXAMPLES
from tests.helpers import RedisProcess

COPY = str(EXAMPLES["copy"])


def _cfg(*sets: str) -> Config:
    return load_config(COPY, ["deploy.acl=false", *sets])


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("certs") / "tls"
    assert main(["deploy", "certs", str(d), "--host", "127.0.0.1", "--host",
                 "sluice-copy-redis"]) == 0
    return d


def test_certs_are_written_with_private_keys_0600_and_never_over_a_ca(certs: Path) -> None:
    assert sorted(p.name for p in certs.iterdir()) == ["ca.crt", "ca.key", "redis.crt",
                                                       "redis.key"]
    for key in ("ca.key", "redis.key"):
        assert (certs / key).stat().st_mode & 0o777 == 0o600
    assert certificate_names((certs / "redis.crt").read_text()) == {"127.0.0.1",
                                                                     "sluice-copy-redis"}
    with pytest.raises(FileExistsError, match=r"ca\.crt"):
        make_certs(certs, ["x"])


def test_no_tls_unless_asked() -> None:
    assert deploy_tls(_cfg()) is None


def test_bundled_tls_reads_the_three_files_and_never_the_ca_key(certs: Path) -> None:
    tls = deploy_tls(_cfg(f"deploy.redis_tls_dir={certs}"))
    assert tls is not None and tls.serves
    assert sorted(tls.files) == ["ca.crt", "redis.crt", "redis.key"]
    assert all("ca.key" not in name for name in tls.files)
    args = tls.server_args("/m", 6379)
    assert args[:4] == ["--port", "0", "--tls-port", "6379"]  # no plaintext port
    assert tls.role_settings("/m") == {"bus.tls_ca_file": "/m/ca.crt"}
    assert tls.cli_args("/m") == ["--tls", "--cacert", "/m/ca.crt"]


def test_a_missing_or_non_pem_file_names_its_key(tmp_path: Path, certs: Path) -> None:
    with pytest.raises(ConfigError, match=r"deploy.redis_tls_dir: cannot read .*ca.crt"):
        deploy_tls(_cfg(f"deploy.redis_tls_dir={tmp_path}"))
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("ca.crt", "redis.crt"):
        (bad / name).write_text((certs / name).read_text())
    (bad / "redis.key").write_text("not a key\n")
    with pytest.raises(ConfigError, match=r"deploy\.redis_tls_dir: .*redis\.key holds no PEM"):
        deploy_tls(_cfg(f"deploy.redis_tls_dir={bad}"))


def test_external_rediss_ships_the_ca_and_client_certificate(tmp_path: Path,
                                                             certs: Path) -> None:
    cfg = _cfg('deploy.redis="external"', 'bus.redis_url="rediss://redis.example:6380/0"',
               f"bus.tls_ca_file={certs / 'ca.crt'}", f"bus.tls_cert_file={certs / 'redis.crt'}",
               f"bus.tls_key_file={certs / 'redis.key'}")
    tls = deploy_tls(cfg)
    assert tls is not None and not tls.serves and tls.server_args("/m", 1) == []
    assert sorted(tls.files) == ["ca.crt", "client.crt", "client.key"]
    assert tls.role_settings("/m") == {"bus.tls_ca_file": "/m/ca.crt",
                                       "bus.tls_cert_file": "/m/client.crt",
                                       "bus.tls_key_file": "/m/client.key"}
    with pytest.raises(ConfigError, match=r'deploy\.redis_tls_dir: .*"external"'):
        deploy_tls(_cfg('deploy.redis="external"', 'bus.redis_url="redis://r:6379/0"',
                        f"deploy.redis_tls_dir={certs}"))


def test_a_certificate_that_does_not_name_the_host_is_refused(certs: Path) -> None:
    tls = deploy_tls(_cfg(f"deploy.redis_tls_dir={certs}"))
    check_names(tls, ("sluice-copy-redis", "127.0.0.1"), "the Service's name")
    with pytest.raises(ConfigError, match=r"not 'redis'.*--host 127.0.0.1 --host redis`"):
        check_names(tls, ("127.0.0.1", "redis"), "compose's service name")


@pytest.mark.integration
def test_a_real_redis_serves_tls_only_with_the_rendered_flags(certs: Path,
                                                              tmp_path: Path) -> None:
    tls = deploy_tls(_cfg(f"deploy.redis_tls_dir={certs}"))
    assert tls is not None
    mount = tmp_path / "mount"  # the files as a target mounts them: from the render
    mount.mkdir()
    for name, text in tls.files.items():
        (mount / name).write_text(text)
    port = free_port()
    url = f"rediss://127.0.0.1:{port}/0"
    settings = tls.role_settings(str(mount))
    opts = client_options(url, username="default", password="",
                          tls=TLSFiles(settings["bus.tls_ca_file"]))
    with RedisProcess(tmp_path / "redis", tls.server_args(str(mount), port), url, **opts):
        assert redis.Redis.from_url(url, **opts).ping()
        with pytest.raises(redis.ConnectionError):  # no plaintext on the port
            redis.Redis.from_url(f"redis://127.0.0.1:{port}/0", socket_timeout=5).ping()
        with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
            redis.Redis.from_url(url, ssl_cert_reqs="required", ssl_ca_certs=None,
                                 socket_timeout=5).ping()
        cli = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(port),
                              *tls.cli_args(str(mount)), "ping"], capture_output=True,
                             text=True, timeout=30)
        assert cli.stdout.strip() == "PONG", cli.stderr  # the targets' probe command
