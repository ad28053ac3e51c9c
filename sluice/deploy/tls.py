"""TLS between a deployment's roles and its Redis: the files every target mounts, the
bundled Redis's TLS flags, and the roles' ``bus.tls_*`` settings.

Two cases, decided from the config alone (`deploy_tls`):

- **bundled** Redis with ``deploy.redis_tls_dir``: a folder holding ``ca.crt``,
  ``redis.crt`` and ``redis.key`` (`sluice deploy certs` writes one). The Redis serves
  TLS only (``--port 0 --tls-port deploy.redis_port``: no plaintext port at all, so ACL
  passwords never cross the network in the clear), roles connect with ``rediss://`` and
  verify the server against ``ca.crt``, hostname included. ``tls-auth-clients no``: the
  roles log in with their ACL users; a client certificate would add nothing they lack.
- **external** ``rediss://`` URL: ``bus.tls_ca_file`` / ``tls_cert_file`` /
  ``tls_key_file`` (the paths on the machine that renders) are read and shipped as
  ``ca.crt`` / ``client.crt`` / ``client.key``, and every role's settings point at the
  mounted copies, so a role on another machine finds them.

Invariants: the files are read once, here, at render time (a missing or non-PEM file is a
`ConfigError` naming its key, before anything is written); they travel only as secrets
(``secrets/tls/`` at mode 0600, a k8s Secret, a compose bind mount of that folder); the
CA's private key is never read or shipped. A target knows where it mounts the folder and
passes that path in; nothing here knows a target's layout.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import Config, ConfigError
from sluice.deploy.files import Rendered

ROLE_SECRET_DIR = "tls"
"""The render's ``secrets/<this>/``: what every role mounts (``ca.crt``, ``client.*``)."""
SERVER_SECRET_DIR = "redis-tls"
"""The render's ``secrets/<this>/``: what only the bundled Redis mounts (``ca.crt``,
``redis.crt``, ``redis.key``): no role ever holds the server's key."""
ROLE_FILES = ("ca.crt", "client.crt", "client.key")
BUNDLED_FILES = {"ca.crt": "CERTIFICATE", "redis.crt": "CERTIFICATE",
                 "redis.key": "PRIVATE KEY"}
"""What ``deploy.redis_tls_dir`` must hold, and the PEM block each one starts with: the
bundled Redis's files."""
SERVER_FILES = tuple(BUNDLED_FILES)



@dataclass(frozen=True)
class DeployTLS:
    """The TLS of one deployment (module docstring). ``files``: name -> PEM text, the
    secret every target mounts; ``serves``: the bundled Redis serves TLS."""

    files: dict[str, str]
    serves: bool

    @property
    def role_files(self) -> dict[str, str]:
        return {n: t for n, t in self.files.items() if n in ROLE_FILES}

    @property
    def server_files(self) -> dict[str, str]:
        return {n: t for n, t in self.files.items() if n in SERVER_FILES} \
            if self.serves else {}

    def add_secrets(self, rendered: Rendered, mode: int = 0o600) -> dict[str, list[str]]:
        """Write ``secrets/tls/`` and (a bundled Redis) ``secrets/redis-tls/`` into
        ``rendered``; returns each folder's rendered paths (``mode`` 0644 where a
        container's non-root user must read a bind mount: the 0700 ``secrets/`` folder
        still keeps the host's other users out)."""
        out: dict[str, list[str]] = {}
        for folder, files in ((ROLE_SECRET_DIR, self.role_files),
                              (SERVER_SECRET_DIR, self.server_files)):
            if files:
                out[folder] = [rendered.secret(f"{folder}/{n}", t, mode)
                               for n, t in sorted(files.items())]
        return out

    def role_settings(self, mount_dir: str) -> dict[str, str]:
        """The roles' ``bus.tls_*`` keys, at the folder's mount point ``mount_dir``."""
        out = {"bus.tls_ca_file": f"{mount_dir}/ca.crt"} if "ca.crt" in self.files else {}
        if "client.crt" in self.files:
            out["bus.tls_cert_file"] = f"{mount_dir}/client.crt"
            if "client.key" in self.files:
                out["bus.tls_key_file"] = f"{mount_dir}/client.key"
        return out

    def server_args(self, mount_dir: str, port: int | str) -> list[str]:
        """redis-server's flags: TLS on ``port``, the plaintext port closed."""
        if not self.serves:
            return []
        return ["--port", "0", "--tls-port", str(port),
                "--tls-cert-file", f"{mount_dir}/redis.crt",
                "--tls-key-file", f"{mount_dir}/redis.key",
                "--tls-ca-cert-file", f"{mount_dir}/ca.crt", "--tls-auth-clients", "no"]

    def cli_args(self, mount_dir: str) -> list[str]:
        """redis-cli's flags to reach the bundled Redis (the targets' probes)."""
        return ["--tls", "--cacert", f"{mount_dir}/ca.crt"] if self.serves else []


def deploy_tls(cfg: Config) -> DeployTLS | None:
    """The deployment's TLS, or None when it has none (module docstring)."""
    d, bus = cfg.deploy, cfg.bus
    if d.redis == "bundled":
        if not d.redis_tls_dir:
            return None
        folder = Path(d.redis_tls_dir)
        files = {name: _pem(folder / name, "deploy.redis_tls_dir", kind)
                 for name, kind in BUNDLED_FILES.items()}
        return DeployTLS(files, serves=True)
    if d.redis_tls_dir:
        raise ConfigError('deploy.redis_tls_dir: TLS of the bundled Redis, but deploy.redis '
                          '= "external"; give your Redis a rediss:// bus.redis_url and '
                          "bus.tls_ca_file instead")
    if not bus.redis_url.startswith("rediss://"):
        return None
    files = {}
    for key, value, name, kind in (("bus.tls_ca_file", bus.tls_ca_file, "ca.crt", "CERTIFICATE"),
                                   ("bus.tls_cert_file", bus.tls_cert_file, "client.crt",
                                    "CERTIFICATE"),
                                   ("bus.tls_key_file", bus.tls_key_file, "client.key",
                                    "PRIVATE KEY")):
        if value:
            files[name] = _pem(Path(value), key, kind)
    return DeployTLS(files, serves=False)


def _pem(path: Path, key: str, kind: str) -> str:
    """``path``'s text, checked to hold a PEM block of ``kind`` (``PRIVATE KEY`` matches
    every key flavour: ``EC PRIVATE KEY``, ``RSA PRIVATE KEY``)."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path}: {e.strerror or e}") from None
    if f"{kind}-----" not in text or "-----BEGIN " not in text:
        raise ConfigError(f"{key}: {path} holds no PEM {kind.lower()} block")
    return text


def check_names(tls: DeployTLS | None, hosts: tuple[str, ...], key: str) -> None:
    """Refuse a bundled Redis's certificate that does not name every one of ``hosts``,
    the addresses the roles (and KEDA) connect to and check: at render time, not as every
    role's failed handshake. ``key`` says what decides ``hosts``, for the message."""
    if tls is None or not tls.serves:
        return
    names = certificate_names(tls.files["redis.crt"])
    missing = [h for h in hosts if h not in names]
    if missing:
        flags = " ".join(f"--host {h}" for h in hosts)
        raise ConfigError(f"deploy.redis_tls_dir: redis.crt names {sorted(names)}, not "
                          f"{missing[0]!r} ({key}), an address Redis is reached at; make it "
                          f"with `sluice deploy certs DIR {flags}`")


def certificate_names(pem: str) -> set[str]:
    """The DNS names and IP addresses of a certificate's subjectAltName."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pem.encode())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {*san.get_values_for_type(x509.DNSName),
            *(str(ip) for ip in san.get_values_for_type(x509.IPAddress))}


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
