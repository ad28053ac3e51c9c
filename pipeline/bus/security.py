"""Who a process is to Redis, and how it reaches it: per-role credentials and TLS files.

Credentials never come from argv (a command line is visible to every local user in
``ps``); a process finds them, for its role, in this order:

1. ``SLUICE_REDIS_<ROLE>_USERNAME`` / ``SLUICE_REDIS_<ROLE>_PASSWORD`` in the environment
   (e.g. ``SLUICE_REDIS_SCORER_PASSWORD``);
2. its ``[<role>]`` table in the credentials file named by ``bus.credentials_file`` or,
   when that is empty, ``SLUICE_REDIS_CREDENTIALS_FILE`` (as `sluice acl` writes it); a
   file that is readable by group or others is refused;
3. ``SLUICE_REDIS_USERNAME`` / ``SLUICE_REDIS_PASSWORD`` (one identity for every role);
4. nothing: Redis's ``default`` user (an embedded, loopback-only or unix-socket Redis).

A credentials file that is configured must hold the asked role: falling through to a
broader identity would silently run a role with rights it should not have.

TLS (``rediss://``) verifies the server against ``bus.tls_ca_file`` (else the system's
CAs) and checks its hostname; ``bus.tls_cert_file`` / ``bus.tls_key_file`` are the
client certificate for servers that demand one (``tls-auth-clients yes``).
"""

from __future__ import annotations

import os
import secrets
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

ROLES = ("generator", "scorer", "trainer", "evaluator", "archiver", "monitor", "admin")
"""Every Redis identity of a deployment; `deploy/redis/users.acl` has one user per role."""

CREDENTIALS_FILE_ENV = "SLUICE_REDIS_CREDENTIALS_FILE"

COMMAND_ROLES = {"generate": "generator", "score": "scorer", "train": "trainer",
                 "eval": "evaluator", "archive": "archiver", "status": "monitor",
                 "tail": "monitor"}
"""The Redis identity each `sluice` command logs in as."""


class CredentialsError(ValueError):
    """Credentials or TLS files are missing, malformed or too widely readable."""


@dataclass(frozen=True)
class Credentials:
    """A Redis username and password; both None = the ``default`` user, no AUTH."""

    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never in a log or traceback


@dataclass(frozen=True)
class TLSFiles:
    """PEM files of a ``rediss://`` connection; empty strings = not set."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    def any(self) -> bool:
        return bool(self.ca_file or self.cert_file or self.key_file)


def _env_pair(env: Mapping[str, str], prefix: str) -> Credentials | None:
    user, password = env.get(f"{prefix}_USERNAME") or None, env.get(f"{prefix}_PASSWORD") or None
    return Credentials(user, password) if user or password else None


def check_private(path: Path) -> None:
    """Refuse a secret file that someone other than its owner can read or write."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise CredentialsError(f"credentials file {path} does not exist") from None
    if not stat.S_ISREG(mode):
        raise CredentialsError(f"credentials file {path} is not a regular file")
    if mode & 0o077:
        raise CredentialsError(
            f"credentials file {path} is readable or writable by group/others "
            f"(mode {stat.S_IMODE(mode):04o}); run `chmod 600 {path}`")


def env_for_role(env: Mapping[str, str], role: str) -> dict[str, str]:
    """``env`` without other roles' ``SLUICE_REDIS_<ROLE>_*`` credentials: what a
    supervisor hands a child, so that no process holds a password it has no use for."""
    others = tuple(f"SLUICE_REDIS_{r.upper()}_" for r in ROLES if r != role)
    return {k: v for k, v in env.items() if not k.startswith(others)}


def load_credentials_file(path: str | Path) -> dict[str, Credentials]:
    """Parse a credentials file (TOML: one ``[role]`` table with ``username`` and
    ``password`` per role) after checking that only its owner can read it."""
    p = Path(path)
    check_private(p)
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise CredentialsError(f"credentials file {p}: not valid TOML: {e}") from None
    out: dict[str, Credentials] = {}
    for role, table in data.items():
        if role not in ROLES:
            raise CredentialsError(f"credentials file {p}: unknown role [{role}]; "
                                   f"expected some of {', '.join(ROLES)}")
        if not isinstance(table, dict) or set(table) != {"username", "password"} or not all(
                isinstance(v, str) and v for v in table.values()):
            raise CredentialsError(f"credentials file {p}: [{role}] must have exactly a "
                                   "non-empty `username` and `password`")
        out[role] = Credentials(table["username"], table["password"])
    return out


def write_credentials_file(path: str | Path, creds: Mapping[str, Credentials],
                           header: str = "") -> Path:
    """Write ``creds`` as a credentials file, created mode 0600 (never briefly wider:
    the mode is set when the file is created, before a byte of secret is written)."""
    p = Path(path)
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    for role, c in creds.items():
        if not c.username or not c.password:
            raise CredentialsError(f"role {role}: username and password are required")
        lines += ["", f"[{role}]", f"username = {_toml_str(c.username)}",
                  f"password = {_toml_str(c.password)}"]
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines).lstrip("\n") + "\n")
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return p


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def new_password() -> str:
    """A random password: 256 bits, URL-safe (no quoting needed anywhere)."""
    return secrets.token_urlsafe(32)


def credentials_path(credentials_file: str | None, env: Mapping[str, str] | None = None
                     ) -> str:
    """The credentials file in effect: the configured one, else the environment's."""
    env = os.environ if env is None else env
    return credentials_file or env.get(CREDENTIALS_FILE_ENV, "")


def resolve_credentials(role: str | None, credentials_file: str | None = None,
                        env: Mapping[str, str] | None = None) -> Credentials:
    """The credentials of ``role`` (None: a process with no role), by the order in the
    module docstring."""
    env = os.environ if env is None else env
    if role is not None:
        if role not in ROLES:
            raise CredentialsError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
        own = _env_pair(env, f"SLUICE_REDIS_{role.upper()}")
        if own is not None:
            return own
        path = credentials_path(credentials_file, env)
        if path:
            creds = load_credentials_file(path)
            if role not in creds:
                raise CredentialsError(f"credentials file {path} has no [{role}] table")
            return creds[role]
    return _env_pair(env, "SLUICE_REDIS") or Credentials()


def check_bus_url(url: str, tls: TLSFiles) -> None:
    """Config-time checks (`BusConfig`): no password in the URL (it would reach argv and
    config files), TLS files only with ``rediss://``, a key only with its certificate."""
    parsed = urlparse(url)
    if parsed.password:
        raise ValueError("bus.redis_url: a password in the URL ends up in argv and config "
                         "files; use bus.credentials_file or SLUICE_REDIS_PASSWORD")
    if tls.any() and parsed.scheme != "rediss":
        raise ValueError("bus.tls_ca_file/tls_cert_file/tls_key_file need a rediss:// "
                         "bus.redis_url")
    if tls.key_file and not tls.cert_file:
        raise ValueError("bus.tls_key_file is set without bus.tls_cert_file")


def client_options(url: str, *, role: str | None = None, credentials_file: str | None = None,
                   tls: TLSFiles | None = None, username: str | None = None,
                   password: str | None = None) -> dict[str, Any]:
    """Keyword arguments for redis-py's ``from_url`` (sync or asyncio) of a role.

    Explicit ``username``/``password`` win over `resolve_credentials`. TLS files are
    checked to exist here, so a typo is a clear error at start instead of a connection
    that is retried forever. CLIENT SETINFO is not sent: Redis < 7.2 lacks it, and the
    ACL users need not be granted it.
    """
    creds = (Credentials(username, password) if username or password
             else resolve_credentials(role, credentials_file))
    opts: dict[str, Any] = {"username": creds.username, "password": creds.password,
                            **_no_setinfo()}
    tls = tls or TLSFiles()
    if urlparse(url).scheme == "rediss":
        for name, value in (("tls_ca_file", tls.ca_file), ("tls_cert_file", tls.cert_file),
                            ("tls_key_file", tls.key_file)):
            if value and not Path(value).is_file():
                raise CredentialsError(f"bus.{name}: no such file {value}")
        opts.update(ssl_ca_certs=tls.ca_file or None, ssl_certfile=tls.cert_file or None,
                    ssl_keyfile=tls.key_file or None, ssl_cert_reqs="required",
                    ssl_check_hostname=True)
    elif tls.any():
        raise CredentialsError("bus.tls_* files are set but bus.redis_url is not rediss://")
    return opts


def _no_setinfo() -> dict[str, Any]:
    """redis-py >= 7 takes ``driver_info=None``; older releases ``lib_name=None``."""
    import inspect

    from redis.connection import AbstractConnection

    params = inspect.signature(AbstractConnection.__init__).parameters
    if "driver_info" in params:
        return {"driver_info": None}
    return {"lib_name": None, "lib_version": None}
