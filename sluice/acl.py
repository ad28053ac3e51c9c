"""`sluice acl`: render `deploy/redis/users.acl` into a loadable ACL file plus credentials.

The committed template holds no secret. Rendering gives every role a fresh random
password; the ACL file gets only its SHA-256 (``#<hex>``, which Redis compares against
``sha256(password)``), and the passwords go to a credentials file created mode 0600 that
`pipeline.bus.security` reads back. Re-rendering rotates every password.

Template syntax (Redis ACL files have neither comments nor continuation lines, so the
renderer removes both): ``#`` starts a comment line, a line starting with whitespace
continues the previous ``user`` line, ``${prefix}`` is the key prefix of the run
(``sluice:{RUN}``, or ``sluice:{*}`` for every run) and ``${<role>_password}`` the
hashed password of that role. A placeholder left unrendered is an error, so a
half-rendered file never reaches Redis; so is a grant of every role's op keys
(``~…:op:*``): each role gets only ``op:<role>:*`` (`pipeline.bus.keys.Keys.op`), since a
stored op result is returned instead of acting and must not be forgeable by another role.
"""

from __future__ import annotations

import hashlib
import re
import string
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.bus.keys import LANE_SEP, Keys
from pipeline.bus.security import ROLES, Credentials, new_password, write_credentials_file

TEMPLATE = Path(__file__).resolve().parents[1] / "deploy" / "redis" / "users.acl"
USERNAME_PREFIX = "sluice-"


def username(role: str) -> str:
    return f"{USERNAME_PREFIX}{role}"


def password_hash(password: str) -> str:
    """The ACL rule that sets ``password`` without storing it (``#`` + sha256 hex)."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def logical_lines(template: str) -> list[str]:
    """Comment lines dropped, continuation lines joined onto their ``user`` line."""
    out: list[str] = []
    for raw in template.splitlines():
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        if raw[0].isspace():
            if not out:
                raise ValueError(f"continuation line before any user line: {raw.strip()!r}")
            out[-1] += " " + " ".join(raw.split())
        else:
            out.append(" ".join(raw.split()))
    return out


def render(template: str, prefix: str, passwords: dict[str, str]) -> str:
    """The ACL file text: one line per user, placeholders substituted."""
    mapping = {"prefix": prefix, **{f"{r}_password": password_hash(p)
                                    for r, p in passwords.items()}}
    lines = []
    for line in logical_lines(template):
        try:
            lines.append(with_lanes(string.Template(line).substitute(mapping), prefix))
        except KeyError as e:
            raise ValueError(f"ACL template: no value for placeholder {e}") from None
        except ValueError as e:
            raise ValueError(f"ACL template: {e} in {line[:60]!r}") from None
        if not re.match(r"^user \S+ ", lines[-1]):
            raise ValueError(f"ACL template: every line must define a user: {line[:60]!r}")
        if re.search(r"~\S*:op:\*", lines[-1]):
            raise ValueError("ACL template: op keys are granted per role (op:<role>:*), "
                             f"not all at once: {line[:60]!r}")
    return "\n".join(lines) + "\n"


def with_lanes(line: str, prefix: str) -> str:
    """Each key pattern of one run's prefix (``~sluice:{RUN}:…``, with its ``%R``/``%W``)
    followed by the same pattern for the run's lanes (``~sluice:{RUN~*}:…``: run names
    cannot hold ``~``, so this names exactly RUN's partitions, `pipeline.bus.keys`). The
    every-run prefix ``sluice:{*}`` already covers lanes."""
    if not prefix.endswith("}") or prefix.endswith("{*}"):
        return line
    lanes = prefix[:-1] + LANE_SEP + "*}"
    return re.sub(r"((?:%[RW]+)?~)" + re.escape(prefix) + r"(:[^\s)]*)",
                  lambda m: f"{m[1]}{prefix}{m[2]} {m[1]}{lanes}{m[2]}", line)


@dataclass(frozen=True)
class Rendered:
    acl_file: Path
    credentials_file: Path


def make_acl(out_dir: str | Path, run: str | None, *, template: str | Path = TEMPLATE,
             force: bool = False) -> Rendered:
    """Write ``out_dir/users.acl`` (hashes only, mode 0644) and ``out_dir/credentials.toml``
    (the passwords, mode 0600) for run ``run`` (None = every run on the server).

    Refuses to overwrite existing credentials unless ``force`` (that rotates every
    password, and each role must then be restarted with the new file)."""
    out = Path(out_dir)
    acl_path, cred_path = out / "users.acl", out / "credentials.toml"
    if cred_path.exists() and not force:
        raise FileExistsError(f"{cred_path} exists; pass --force to rotate every password")
    prefix = Keys(run).prefix if run is not None else "sluice:{*}"
    passwords = {r: new_password() for r in ROLES}
    text = render(Path(template).read_text(), prefix, passwords)
    out.mkdir(parents=True, exist_ok=True)
    scope = f"run {run!r}" if run is not None else "every run"
    write_credentials_file(
        cred_path, {r: Credentials(username(r), p) for r, p in passwords.items()},
        header=f"Redis credentials for {scope}, written by `sluice acl` at "
               f"{time.strftime('%Y-%m-%d %H:%M:%S %z')}.\nSecret: keep it mode 0600; "
               f"the matching ACL file is {acl_path.name}.")
    tmp = acl_path.with_name(f".{acl_path.name}.tmp")
    tmp.write_text(text)
    tmp.chmod(0o644)  # hashes of 256-bit random passwords: safe for the Redis user to read
    tmp.replace(acl_path)
    return Rendered(acl_path, cred_path)
