"""Each child of `sluice up` gets its own role's Redis password and no other.

The operator's credentials file (`sluice acl`'s ``credentials.toml``) holds every role's
password, admin's included. `sluice up` reads it once, as the supervisor, and hands each
child a file of its own: ``<output_dir>/credentials/<role>.toml`` (directory 0700, file
0600, one ``[role]`` table), named by ``--set bus.credentials_file=…``, with
``SLUICE_REDIS_CREDENTIALS_FILE`` and every other role's ``SLUICE_REDIS_<ROLE>_*``
removed from its environment. So a compromised scorer finds no other role's password
in its environment, its command line or the config file it is pointed at. (Processes of
one Unix user can still read each other's files: run roles as separate users, or use
`sluice deploy render`, for isolation beyond this.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from pipeline.bus.security import (
    CREDENTIALS_FILE_ENV,
    CredentialsError,
    credentials_path,
    env_for_role,
    load_credentials_file,
    write_credentials_file,
)
from pipeline.config import Config


def role_env(env: Mapping[str, str], role: str) -> dict[str, str]:
    """``env`` as a child of role ``role`` may see it: no other role's credentials, and no
    path to the every-role credentials file."""
    return {k: v for k, v in env_for_role(env, role).items() if k != CREDENTIALS_FILE_ENV}


def role_credentials_override(cfg: Config, role: str,
                              env: Mapping[str, str] | None = None) -> list[str]:
    """The ``--set`` override that points a child of ``role`` at a file holding only its
    own credentials (written now, 0600), or nothing when no credentials file is in effect
    (credentials from the environment, or the embedded Redis's default user)."""
    path = credentials_path(cfg.bus.credentials_file, env)
    if not path:
        return []
    creds = load_credentials_file(path)
    if role not in creds:
        raise CredentialsError(f"credentials file {path} has no [{role}] table")
    folder = cfg.output_path / "credentials"
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    own = write_credentials_file(
        folder / f"{role}.toml", {role: creds[role]},
        header=f"The {role} role's Redis credentials only, written by `sluice up` from "
               f"{Path(path).name}.")
    return [f"bus.credentials_file={json.dumps(str(own.resolve()))}"]  # a TOML string
