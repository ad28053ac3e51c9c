"""Least privilege beyond what the ACL can express, against a real redis-server loaded
with `sluice acl`'s users (the `acl` fixture of test_security.py):

- a role that forges ``state.version`` (every writing role may HSET ``state``: its
  scripts write it) cannot make a resuming trainer trust it (`pipeline.bus.version_check`);
- a role writes only its own role's heartbeats (`workers:<role>`); the trainer reads the
  generators' (its rollout/* series) and no other role's;
- a child of `sluice up` holds only its own role's password (`sluice.up_credentials`).

Every server and process is started by the fixtures and ended by PID.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import redis

from pipeline.bus.client import Bus
from pipeline.bus.security import load_credentials_file
from pipeline.config import load_config
from tests.integration.test_security import RUN, AclServer, acl, admin, certs, client  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration


def test_a_forged_state_version_is_not_trusted_by_a_resuming_trainer(
        acl: AclServer, admin: redis.Redis, tmp_path: Path,  # noqa: F811
        tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    from trainer.trainer import Trainer

    cfg = load_config(None, [
        f"run.name={RUN}", f"run.output_dir={tmp_path / 'out'}",
        f"bus.redis_url={acl.srv.url}", f"bus.credentials_file={acl.creds}",
        "bus.block_ms=50", f"model.path={tiny_model_dir}", "trainer.max_steps=1"])
    creds = load_credentials_file(acl.creds)
    state_key = f"sluice:{{{RUN}}}:state"

    async def resume() -> tuple[int, int]:
        tr = Trainer(cfg)
        bus = Bus.connect(cfg.redis_url, RUN, role="trainer",
                          credentials_file=str(acl.creds))
        try:
            await tr.resume(bus)
            return tr.state.version, (await bus.state())["version"]
        finally:
            await bus.close()

    # a fresh run: the trainer announces version 0 and moves state.version to it
    assert asyncio.run(resume()) == (0, 0)
    gen = client(acl.srv, creds["generator"])
    try:
        gen.hset(state_key, "version", 999999)  # allowed: the generator's scripts write state
    finally:
        gen.close()
    assert int(admin.hget(state_key, "version")) == 999999
    with caplog.at_level(logging.ERROR, logger="sluice.version_check"):
        version, on_bus = asyncio.run(resume())
    # the trainer resumes as it would have without the forgery (no checkpoint: it
    # announces version 0 again), not after the forged version; state is repaired
    assert (version, on_bus) == (0, 0)
    assert any("999999" in r.getMessage() and state_key in r.getMessage()
               for r in caplog.records), caplog.text
    assert admin.acl_log() == [], admin.acl_log()


def test_a_role_can_write_only_its_own_roles_heartbeats(
        acl: AclServer, admin: redis.Redis) -> None:  # noqa: F811
    """`sluice up` waits for and watches the trainer's heartbeat, `sluice status` shows
    every role's: a scorer's user can neither fake nor erase the trainer's."""
    async def go() -> dict[str, dict[str, object]]:
        def bus(role: str) -> Bus:
            return Bus.connect(acl.srv.url, RUN, role=role, credentials_file=str(acl.creds))

        sc, tr, mon = bus("scorer"), bus("trainer"), bus("monitor")
        try:
            await tr.heartbeat("trainer/trainer-0", {"step": 7})
            await sc.heartbeat("scorer/s0", {"scored": 1})
            with pytest.raises(redis.exceptions.NoPermissionError):
                await sc.heartbeat("trainer/trainer-0", {"step": 999})
            with pytest.raises(redis.exceptions.NoPermissionError):
                await sc.forget_worker("trainer/trainer-0")
            for role in ("generator", "evaluator", "archiver", "trainer"):
                wid = f"{role}/x"
                with pytest.raises(redis.exceptions.NoPermissionError):
                    await sc.r.hset(sc.keys.heartbeat_key(wid), wid, "{}")
            return await mon.workers()
        finally:
            for b in (sc, tr, mon):
                await b.close()

    seen = asyncio.run(go())
    assert set(seen) == {"trainer/trainer-0", "scorer/s0"}
    assert seen["trainer/trainer-0"]["step"] == 7
    admin.execute_command("ACL", "LOG", "RESET")


def test_the_trainer_reads_but_cannot_write_the_generators_heartbeats(
        acl: AclServer, admin: redis.Redis) -> None:  # noqa: F811
    """Its rollout/* series (`pipeline.rollout_meter`) come from the generators' beats;
    reading them must not let a trainer fake or erase one, nor read other roles'."""
    async def go() -> dict[str, dict[str, object]]:
        def bus(role: str) -> Bus:
            return Bus.connect(acl.srv.url, RUN, role=role, credentials_file=str(acl.creds))

        gen, tr = bus("generator"), bus("trainer")
        try:
            await gen.heartbeat("generator/g0", {"tokens": 64})
            with pytest.raises(redis.exceptions.NoPermissionError):
                await tr.heartbeat("generator/g0", {"tokens": 0})
            with pytest.raises(redis.exceptions.NoPermissionError):
                await tr.forget_worker("generator/g0")
            with pytest.raises(redis.exceptions.NoPermissionError):
                await tr.heartbeats_of("scorer")
            return await tr.heartbeats_of("generator")
        finally:
            for b in (gen, tr):
                await b.close()

    seen = asyncio.run(go())
    assert seen["generator/g0"]["tokens"] == 64
    admin.execute_command("ACL", "LOG", "RESET")


def test_sluice_up_gives_each_role_only_its_own_password(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """A scorer started by `sluice up`'s supervisor: neither its environment nor any
    credentials file its command line or config names holds another role's password."""
    import os
    import signal
    import time

    from pipeline.ports import free_port
    from sluice.acl import make_acl
    from sluice.supervisor import Supervisor
    from tests.helpers import run_header

    done = make_acl(tmp_path / "acl", RUN)
    every = load_credentials_file(done.credentials_file)
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(run_header(RUN, tmp_path / "out", f"redis://127.0.0.1:{free_port()}/0")
                        + f'credentials_file = "{done.credentials_file}"\n')
    # what an operator might have exported for `sluice status`: must not reach the child
    monkeypatch.setenv("SLUICE_REDIS_CREDENTIALS_FILE", str(done.credentials_file))
    monkeypatch.setenv("SLUICE_REDIS_ADMIN_PASSWORD", every["admin"].password or "")
    sup = Supervisor(load_config(cfg_path), str(cfg_path), [])
    child = sup.spawn("score", "scorer-0", 1)
    try:
        deadline = time.time() + 60
        environ = cmdline = b""
        while time.time() < deadline and not (environ and cmdline):
            try:
                environ = Path(f"/proc/{child.proc.pid}/environ").read_bytes()
                cmdline = Path(f"/proc/{child.proc.pid}/cmdline").read_bytes()
            except OSError:
                pass
            time.sleep(0.05)
        assert environ and cmdline, "could not read the child's environment"
    finally:
        os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait(timeout=30)
    env = dict(kv.split(b"=", 1) for kv in environ.split(b"\0") if b"=" in kv)
    args = cmdline.decode().split("\0")
    # the credentials file in effect for the child: its --set override, else its config's
    sets = [a.removeprefix("bus.credentials_file=") for a in args
            if a.startswith("bus.credentials_file=")]
    in_effect = sets[-1] if sets else str(done.credentials_file)
    readable = environ + Path(in_effect.strip("'\"")).read_bytes()
    for role, c in every.items():
        assert c.password is not None
        held = c.password.encode() in readable  # (a bool: no password in a failure text)
        if role == "scorer":
            assert held, "the scorer lost its own password"  # it can still log in
        else:
            assert not held, f"the scorer can read {role}'s password"
    assert b"SLUICE_REDIS_CREDENTIALS_FILE" not in env or env[
        b"SLUICE_REDIS_CREDENTIALS_FILE"].decode() != str(done.credentials_file)
    assert (Path(in_effect.strip("'\"")).stat().st_mode & 0o777) == 0o600
