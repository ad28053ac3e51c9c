"""pipeline.bus.security and sluice.acl without Redis: credential lookup order, the
credentials file's permissions, ACL rendering, TLS options, the config checks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.bus.keys import HEARTBEAT_ROLES, OP_ROLES, Keys
from pipeline.bus.security import (
    ROLES,
    Credentials,
    CredentialsError,
    TLSFiles,
    client_options,
    env_for_role,
    load_credentials_file,
    resolve_credentials,
    write_credentials_file,
)
from pipeline.config import ConfigError, load_config
from sluice.acl import TEMPLATE, logical_lines, make_acl, password_hash, render, username
from sluice.cli import main as cli


def _creds_file(tmp_path: Path, mode: int = 0o600) -> Path:
    p = write_credentials_file(tmp_path / "creds.toml", {
        "generator": Credentials("sluice-generator", "gen-pw"),
        "scorer": Credentials("sluice-scorer", 'sc"pw\\'),
    }, header="test")
    p.chmod(mode)
    return p


def test_credentials_file_is_created_private_and_round_trips(tmp_path: Path) -> None:
    p = _creds_file(tmp_path)
    assert p.stat().st_mode & 0o777 == 0o600
    creds = load_credentials_file(p)
    assert creds["scorer"] == Credentials("sluice-scorer", 'sc"pw\\')
    assert "gen-pw" not in repr(creds)  # passwords never reach a log line


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_group_or_world_readable_credentials_file_is_refused(tmp_path: Path, mode: int) -> None:
    p = _creds_file(tmp_path, mode)
    with pytest.raises(CredentialsError, match=rf"group/others \(mode 0{mode:o}\).*chmod 600"):
        load_credentials_file(p)


@pytest.mark.parametrize(("text", "msg"), [
    ("[gen]\nusername = 'a'\npassword = 'b'\n", "unknown role"),
    ("[scorer]\nusername = 'a'\n", "exactly a non-empty"),
    ("[scorer]\nusername = 'a'\npassword = ''\n", "exactly a non-empty"),
    ("[scorer\n", "not valid TOML"),
])
def test_malformed_credentials_file_is_refused(tmp_path: Path, text: str, msg: str) -> None:
    p = tmp_path / "c.toml"
    p.write_text(text)
    p.chmod(0o600)
    with pytest.raises(CredentialsError, match=msg):
        load_credentials_file(p)


def test_lookup_order_role_env_then_file_then_shared_env(tmp_path: Path) -> None:
    f = str(_creds_file(tmp_path))
    shared = {"SLUICE_REDIS_USERNAME": "u", "SLUICE_REDIS_PASSWORD": "p"}
    own = {"SLUICE_REDIS_GENERATOR_USERNAME": "g", "SLUICE_REDIS_GENERATOR_PASSWORD": "gp"}
    assert resolve_credentials("generator", f, {**shared, **own}) == Credentials("g", "gp")
    assert resolve_credentials("generator", f, shared) == Credentials("sluice-generator",
                                                                      "gen-pw")
    env_file = {"SLUICE_REDIS_CREDENTIALS_FILE": f, **shared}
    assert resolve_credentials("scorer", "", env_file).username == "sluice-scorer"
    assert resolve_credentials("generator", "", shared) == Credentials("u", "p")
    assert resolve_credentials(None, f, shared) == Credentials("u", "p")
    assert resolve_credentials("trainer", "", {}) == Credentials()
    # a configured file must hold the role: never fall back to a broader identity
    with pytest.raises(CredentialsError, match=r"has no \[trainer\] table"):
        resolve_credentials("trainer", f, shared)
    with pytest.raises(CredentialsError, match="unknown role"):
        resolve_credentials("janitor", f, {})


def test_children_get_only_their_own_role_credentials() -> None:
    env = {"SLUICE_REDIS_ADMIN_PASSWORD": "a", "SLUICE_REDIS_SCORER_PASSWORD": "s",
           "SLUICE_REDIS_SCORER_USERNAME": "su", "SLUICE_REDIS_PASSWORD": "shared", "X": "1"}
    assert env_for_role(env, "scorer") == {"SLUICE_REDIS_SCORER_PASSWORD": "s",
                                           "SLUICE_REDIS_SCORER_USERNAME": "su",
                                           "SLUICE_REDIS_PASSWORD": "shared", "X": "1"}


def test_tls_options_only_for_rediss_and_only_existing_files(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    opts = client_options("rediss://h:1/0", tls=TLSFiles(ca_file=str(ca)))
    assert opts["ssl_ca_certs"] == str(ca) and opts["ssl_check_hostname"] is True
    assert opts["ssl_cert_reqs"] == "required" and opts["ssl_certfile"] is None
    assert "ssl_ca_certs" not in client_options("redis://h:1/0")
    with pytest.raises(CredentialsError, match="not rediss"):
        client_options("redis://h:1/0", tls=TLSFiles(ca_file=str(ca)))
    with pytest.raises(CredentialsError, match="tls_cert_file: no such file"):
        client_options("rediss://h:1/0", tls=TLSFiles(cert_file=str(tmp_path / "nope")))


@pytest.mark.parametrize(("override", "msg"), [
    ("bus.redis_url='redis://u:secret@h:6379/0'", "password in the URL"),
    ("bus.tls_ca_file='/x/ca.pem'", "need a rediss://"),
])
def test_config_refuses_passwords_in_urls_and_tls_without_rediss(override: str, msg: str
                                                                 ) -> None:
    with pytest.raises(ConfigError, match=msg):
        load_config(None, [override])
    cfg = load_config(None, ["bus.redis_url='rediss://u@h:6379/0'",
                             "bus.tls_ca_file='/x/ca.pem'"])
    assert cfg.bus.tls_ca_file == "/x/ca.pem"


# ---------------------------------------------------------------- ACL rendering


def test_template_renders_one_user_per_role_with_hashed_passwords() -> None:
    passwords = {r: f"pw-{r}" for r in ROLES}
    text = render(TEMPLATE.read_text(), Keys("demo").prefix, passwords)
    lines = text.splitlines()
    assert lines[0] == "user default reset off ~* &* +@all"  # off; the AOF's replay user
    users = [line.split()[1] for line in lines[1:]]
    assert users == [username(r) for r in ROLES]
    for role, line in zip(ROLES, lines[1:], strict=True):
        assert f" on {password_hash(passwords[role])} " in line
        assert passwords[role] not in line
    assert "$" not in text and "#" not in text.replace(" #", " ")  # nothing left unrendered
    keys = set(re.findall(r"~(sluice:\{[^}]*\}:[\w:*]+)", text))
    names = ("rollouts", "scored", "control", "dlq", "state", "leases", "trainer",
             "skipped", "loop", *(f"workers:{r}" for r in HEARTBEAT_ROLES),
             "op:generator:*", "op:scorer:*", "op:trainer:*", "*")
    # the run's keys, and each pattern again for the run's lanes (docs/scaling.md)
    assert keys == {f"sluice:{{{tag}}}:{k}" for k in names for tag in ("demo", "demo~*")}


def test_each_writing_role_is_granted_only_its_own_op_namespace() -> None:
    """Op keys hold stored script results that a retried call returns instead of acting:
    a role that could write another role's could make that role's calls look done."""
    k = Keys("demo")
    text = render(TEMPLATE.read_text(), k.prefix, {r: "pw" for r in ROLES})
    users = {line.split()[1]: line for line in text.splitlines()}
    for role in ROLES:
        granted = set(re.findall(r"~(sluice:\{demo\}:op:[\w:*]*)", users[username(role)]))
        assert granted == ({k.op(role, "*")} if role in OP_ROLES else set()), role
    assert f"~{k.prefix}:op:*" not in text  # no role-blind grant is left, nor may one be
    with pytest.raises(ValueError, match="op keys are granted per role"):
        render("user a on (~${prefix}:op:* +get)", k.prefix, {})


def test_each_role_may_write_only_its_own_roles_heartbeats() -> None:
    """`sluice up` and `sluice status` act on heartbeats: a scorer must not fake or erase
    the trainer's. Only `monitor` (read-only) and `admin` see them all; the trainer also
    reads (only reads) the generators', for its rollout/* series."""
    k = Keys("demo")
    text = render(TEMPLATE.read_text(), k.prefix, {r: "pw" for r in ROLES})
    users = {line.split()[1]: line for line in text.splitlines()}
    for role in ROLES:
        line = users[username(role)]
        writes = set(re.findall(r"%W~(sluice:\{demo\}:workers[\w:*]*)", line))
        reads = set(re.findall(r"%R~(sluice:\{demo\}:workers[\w:*]*)", line))
        plain = set(re.findall(r"[ (]~(sluice:\{demo\}:workers[\w:*]*)", line))
        assert writes == ({k.heartbeats(role)} if role in HEARTBEAT_ROLES else set()), role
        assert not plain, role  # nobody but monitor/admin gets read-write on all
        assert reads == ({k.heartbeats("generator")} if role == "trainer" else set()), role


def test_template_fails_closed() -> None:
    with pytest.raises(ValueError, match="no value for placeholder"):
        render(TEMPLATE.read_text(), "sluice:{x}", {"generator": "only-one"})
    assert "${" in TEMPLATE.read_text()  # as committed, Redis cannot load it


def test_logical_lines_drop_comments_and_join_continuations() -> None:
    text = "# c\nuser a on\n  +ping\n  # inner\n   (~k +get)\n\nuser b off\n"
    assert logical_lines(text) == ["user a on +ping (~k +get)", "user b off"]


def test_make_acl_writes_both_files_and_refuses_to_overwrite(tmp_path: Path) -> None:
    done = make_acl(tmp_path / "acl", None)
    assert "sluice:{*}:rollouts" in done.acl_file.read_text()
    creds = load_credentials_file(done.credentials_file)
    assert set(creds) == set(ROLES)
    with pytest.raises(FileExistsError, match="--force"):
        make_acl(tmp_path / "acl", "x")
    again = make_acl(tmp_path / "acl", "x", force=True)
    assert load_credentials_file(again.credentials_file)["admin"] != creds["admin"]


def test_cli_refuses_a_readable_credentials_file_before_starting(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _creds_file(tmp_path, 0o644)
    run = tmp_path / "run.toml"
    run.write_text("")
    assert cli(["generate", str(run), "--set", f"bus.credentials_file={p}",
                "--set", "bus.redis_url=redis://127.0.0.1:1/0"]) == 2
    assert "chmod 600" in capsys.readouterr().err
    p.chmod(0o600)
    assert cli(["train", str(run), "--set", f"bus.credentials_file={p}",
                "--set", "bus.redis_url=redis://127.0.0.1:1/0"]) == 2
    assert "no [trainer] table" in capsys.readouterr().err
    # the embedded Redis of `sluice up` has no ACL users
    assert cli(["up", str(run), "--set", f"bus.credentials_file={p}"]) == 2
    assert "embedded Redis" in capsys.readouterr().err
