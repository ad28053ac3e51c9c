"""Security against a real redis-server: per-role ACL users and TLS.

- `sluice acl` renders deploy/redis/users.acl; a server started with it refuses the
  ``default`` user, and each role can do what its code does and nothing else (NOPERM).
- A short real pipeline (`sluice up`, then `sluice status` / `tail`) runs against that
  server with one user per role, over ``rediss://`` with a self-signed CA, and is refused
  nothing (the server's ACL LOG stays empty). One run covers both, to keep this file
  short; without openssl or a TLS-enabled redis-server it runs over plain TCP.
- A client that does not trust the CA is refused (certificate verify failed); a server
  that demands client certificates accepts sluice's configured one.

Every server and process is started here and ended by PID.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from pipeline.bus.client import Bus
from pipeline.bus.keys import SCORERS_GROUP, TRAINERS_GROUP, Keys
from pipeline.bus.security import Credentials, load_credentials_file
from pipeline.ports import free_port
from sluice.monitor import snapshot
from tests.helpers import ROOT, RedisProcess, make_certs, role_logs, run_header, tls_args

pytestmark = pytest.mark.integration

RUN = f"sec{uuid.uuid4().hex[:6]}"


def sluice(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sluice.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@dataclass
class AclServer:
    srv: RedisProcess  # srv.url: plain TCP
    creds: Path  # the rendered credentials file
    tls_url: str | None  # rediss:// on the same server (None: no TLS here)
    certs: Path | None


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """Test certificates, or None without openssl."""
    if shutil.which("openssl") is None:
        return None
    d = tmp_path_factory.mktemp("certs")
    make_certs(d)
    return d


@pytest.fixture(scope="module")
def acl(tmp_path_factory: pytest.TempPathFactory, certs: Path | None) -> Iterator[AclServer]:
    """A server loaded with `sluice acl`'s users for run RUN, on a plain and (when it can)
    a TLS port."""
    tmp = tmp_path_factory.mktemp("acl")
    p = sluice("acl", "--set", f"run.name={RUN}", "--out", str(tmp / "acl"))
    assert p.returncode == 0, p.stderr
    creds = tmp / "acl" / "credentials.toml"
    assert (creds.stat().st_mode & 0o777) == 0o600
    text = (tmp / "acl" / "users.acl").read_text()
    for c in load_credentials_file(creds).values():  # only hashes reach the ACL file
        assert c.password and c.password not in text
    port, tls_port = free_port(), free_port()
    args = ["--port", str(port), "--aclfile", str(tmp / "acl" / "users.acl")]
    url = f"redis://127.0.0.1:{port}/0"
    srv, tls_url = None, None
    if certs is not None:
        try:
            srv = RedisProcess(tmp / "redis", [*args, *tls_args(certs, tls_port, "no")],
                               url).start()
            tls_url = f"rediss://127.0.0.1:{tls_port}/0"
        except RuntimeError as e:
            if "tls" not in str(e).lower():
                raise
    if srv is None:  # no openssl, or a redis-server built without TLS
        srv = RedisProcess(tmp / "redis", args, url).start()
    try:
        yield AclServer(srv, creds, tls_url, certs if tls_url else None)
    finally:
        srv.stop()


def client(srv: RedisProcess, c: Credentials | None = None) -> redis.Redis:
    return redis.Redis.from_url(srv.url, username=c.username if c else None,
                                password=c.password if c else None, socket_timeout=10)


@pytest.fixture
def admin(acl: AclServer) -> Iterator[redis.Redis]:
    """An admin client; the run's keys and the ACL log are empty before and after."""
    srv, creds = acl.srv, acl.creds
    r = client(srv, load_credentials_file(creds)["admin"])

    def clean() -> None:
        keys = list(r.scan_iter(match=f"sluice:{{{RUN}}}:*"))
        if keys:
            r.delete(*keys)
        r.execute_command("ACL", "LOG", "RESET")

    clean()
    yield r
    clean()
    r.close()


def test_default_user_and_wrong_passwords_are_refused(acl: AclServer,
                                                      admin: redis.Redis) -> None:
    srv, creds = acl.srv, acl.creds
    with pytest.raises(redis.AuthenticationError):
        client(srv).ping()
    with pytest.raises(redis.AuthenticationError):
        client(srv, Credentials("default", "")).ping()
    with pytest.raises(redis.AuthenticationError):
        client(srv, Credentials("sluice-generator", "not-the-password")).ping()
    gen = load_credentials_file(creds)["generator"]
    assert client(srv, gen).ping()
    with pytest.raises(redis.AuthenticationError):  # one role's password is not another's
        client(srv, Credentials("sluice-scorer", gen.password)).ping()


K = Keys(RUN)
OTHER = Keys("someoneelse")
R, S, C, D, ST, L = K.rollouts, K.scored, K.control, K.dlq, K.state, K.leases
W = K.heartbeats("generator")

# (role, command, allowed): allowed = not refused by the ACL (the command may still fail
# for another reason, e.g. BUSYGROUP). Each role's allowed list is what its code runs.
CASES: list[tuple[str, tuple[Any, ...], bool]] = [
    # generator: gate + leases (state, leases), appends (rollouts, dlq), follows control
    ("generator", ("XADD", R, "*", "m", "x"), True),
    ("generator", ("XADD", D, "*", "m", "x"), True),
    ("generator", ("HGETALL", ST), True),
    ("generator", ("HSET", L, "0", "g|1"), True),
    ("generator", ("HSET", W, "generator/x", "{}"), True),
    ("generator", ("XREVRANGE", C, "+", "-", "COUNT", 1), True),
    # the rollout loop's per-prompt state (read and write), the per-epoch skip counts
    ("generator", ("HMGET", K.loop, "0", "1"), True),
    ("generator", ("HSET", K.loop, "0", "0.5"), True),
    ("generator", ("HGET", K.skipped, "0"), True),
    ("generator", ("DEL", K.loop), False),
    ("generator", ("XREAD", "COUNT", 1, "STREAMS", C, "0"), True),
    ("generator", ("XRANGE", R, "-", "+"), False),
    ("generator", ("XREADGROUP", "GROUP", TRAINERS_GROUP, "g", "STREAMS", S, ">"), False),
    ("generator", ("XADD", C, "*", "m", "x"), False),
    ("generator", ("XADD", S, "*", "m", "x"), False),
    ("generator", ("HGETALL", W), False),
    ("generator", ("XADD", OTHER.rollouts, "*", "m", "x"), False),
    ("generator", ("DEL", ST), False),
    ("generator", ("SET", "anything", "x"), False),
    ("generator", ("KEYS", "*"), False),
    ("generator", ("FLUSHALL",), False),
    ("generator", ("CONFIG", "GET", "port"), False),
    ("generator", ("SCRIPT", "FLUSH"), False),
    # scorer: consumer of rollouts, hands off to scored, counts retirements
    ("scorer", ("XREADGROUP", "GROUP", SCORERS_GROUP, "s", "COUNT", 1, "STREAMS", R, ">"),
     True),
    ("scorer", ("XPENDING", R, SCORERS_GROUP), True),
    ("scorer", ("XAUTOCLAIM", R, SCORERS_GROUP, "s", 0, "0-0"), True),
    ("scorer", ("XACK", R, SCORERS_GROUP, "0-1"), True),
    ("scorer", ("XINFO", "GROUPS", R), True),
    ("scorer", ("XLEN", R), True),  # /metrics: what it consumes
    ("scorer", ("XLEN", S), False),
    ("scorer", ("XINFO", "CONSUMERS", R, SCORERS_GROUP), True),
    ("scorer", ("XTRIM", R, "MINID", "0-1"), True),
    ("scorer", ("XGROUP", "DELCONSUMER", R, SCORERS_GROUP, "s"), True),
    ("scorer", ("XGROUP", "CREATE", S, TRAINERS_GROUP, "0", "MKSTREAM"), True),
    ("scorer", ("XADD", S, "*", "m", "x"), True),
    ("scorer", ("HINCRBY", ST, "retired", 0), True),
    ("scorer", ("HMGET", K.loop, "0"), True),
    ("scorer", ("HSET", K.loop, "0", "1.0"), True),
    ("scorer", ("HINCRBY", K.skipped, "0", 1), False),
    ("scorer", ("DEL", K.loop), False),
    ("scorer", ("XREVRANGE", C, "+", "-", "COUNT", 1), True),
    ("scorer", ("XADD", C, "*", "m", "x"), False),
    ("scorer", ("XREADGROUP", "GROUP", TRAINERS_GROUP, "s", "STREAMS", S, ">"), False),
    ("scorer", ("XRANGE", S, "-", "+"), False),
    ("scorer", ("XADD", R, "*", "m", "x"), False),
    ("scorer", ("HSET", ST, "version", 99), False),
    ("scorer", ("XGROUP", "DESTROY", R, SCORERS_GROUP), False),
    ("scorer", ("HSET", L, "0", "s|1"), False),
    # trainer: consumer of scored, owner of control and state.version
    ("trainer", ("XREADGROUP", "GROUP", TRAINERS_GROUP, "t", "COUNT", 1, "STREAMS", S, ">"),
     True),
    ("trainer", ("XACK", S, TRAINERS_GROUP, "0-1"), True),
    ("trainer", ("XTRIM", S, "MINID", "0-1"), True),
    ("trainer", ("XADD", C, "MAXLEN", "~", 10, "*", "m", "x"), True),
    ("trainer", ("XRANGE", C, "-", "+"), True),
    ("trainer", ("XDEL", C, "0-1"), True),
    ("trainer", ("HGETALL", ST), True),
    ("trainer", ("XLEN", S), True),  # /metrics: what it consumes, and the dlq
    ("trainer", ("XLEN", D), True),
    ("trainer", ("XLEN", R), False),
    ("trainer", ("XADD", D, "*", "m", "x"), True),
    ("trainer", ("XREADGROUP", "GROUP", SCORERS_GROUP, "t", "STREAMS", R, ">"), False),
    ("trainer", ("XRANGE", R, "-", "+"), False),
    ("trainer", ("XADD", R, "*", "m", "x"), False),
    ("trainer", ("XADD", S, "*", "m", "x"), False),
    ("trainer", ("HSET", L, "0", "t|1"), False),
    ("trainer", ("HSET", K.loop, "0", "1.0"), False),
    # evaluator: follows control, heartbeats
    ("evaluator", ("XREVRANGE", C, "+", "-", "COUNT", 1), True),
    ("evaluator", ("HSET", K.heartbeats("evaluator"), "evaluator/x", "{}"), True),
    ("evaluator", ("HSET", W, "generator/x", "{}"), False),
    ("evaluator", ("XADD", C, "*", "m", "x"), False),
    ("evaluator", ("HGETALL", ST), False),
    ("evaluator", ("HMGET", K.loop, "0"), False),
    ("evaluator", ("XRANGE", S, "-", "+"), False),
    # monitor: reads everything of the run, writes nothing
    ("monitor", ("XLEN", R), True),
    ("monitor", ("XINFO", "GROUPS", S), True),
    ("monitor", ("XINFO", "STREAM", C), True),
    ("monitor", ("XPENDING", S, TRAINERS_GROUP), True),
    ("monitor", ("XRANGE", S, "-", "+"), True),
    ("monitor", ("XREAD", "COUNT", 1, "STREAMS", D, "0"), True),
    ("monitor", ("HGETALL", W), True),
    ("monitor", ("HKEYS", L), True),
    ("monitor", ("HGETALL", K.loop), True),
    ("monitor", ("HSET", K.loop, "0", "1"), False),
    ("monitor", ("GET", K.op("generator", "emit:0:g")), True),  # `sluice audit` reads them
    ("monitor", ("GET", K.op("trainer", "trained:t:1:1-0")), True),
    ("monitor", ("SET", K.op("generator", "emit:0:g"), "1"), False),
    ("monitor", ("HGETALL", L), True),
    ("monitor", ("TIME",), True),
    ("monitor", ("XADD", D, "*", "m", "x"), False),
    ("monitor", ("HSET", W, "monitor/x", "{}"), False),
    ("monitor", ("XACK", R, SCORERS_GROUP, "0-1"), False),
    ("monitor", ("XREADGROUP", "GROUP", SCORERS_GROUP, "m", "STREAMS", R, ">"), False),
    ("monitor", ("XGROUP", "CREATE", R, "mine", "0"), False),
    ("monitor", ("XTRIM", R, "MAXLEN", 0), False),
    ("monitor", ("DEL", ST), False),
    ("monitor", ("SCRIPT", "LOAD", "return 1"), False),
    ("monitor", ("EVAL", "return 1", 1, ST), False),
    ("monitor", ("XRANGE", OTHER.rollouts, "-", "+"), False),
    # op keys (stored results of idempotent scripts, returned instead of acting): each
    # writing role reads and writes its own namespace only, so none can make another's
    # call look done (e.g. a scorer faking the trainer's retire, which stalls the gate)
    *[(role, (cmd, K.op(owner, "x:1:1-0"), *val), role == owner)
      for role in ("generator", "scorer", "trainer")
      for owner in ("generator", "scorer", "trainer")
      for cmd, val in (("SET", ("x",)), ("GET", ()))],
    ("scorer", ("SET", f"{K.prefix}:op:trained:trainer-0:1:1-0", "x"), False),  # old layout
    ("generator", ("SET", f"{K.prefix}:op:handoff:s:1-0:1", "x"), False),
    ("evaluator", ("SET", K.op("trainer", "x"), "x"), False),
    ("scorer", ("SET", OTHER.op("scorer", "x"), "x"), False),
    # admin: everything
    ("admin", ("CONFIG", "GET", "port"), True),
    ("admin", ("XRANGE", OTHER.rollouts, "-", "+"), True),
]


def test_each_role_can_do_its_own_work_and_nothing_else(acl: AclServer,
                                                       admin: redis.Redis) -> None:
    srv, creds_file = acl.srv, acl.creds
    creds = load_credentials_file(creds_file)
    admin.xgroup_create(R, SCORERS_GROUP, id="0", mkstream=True)
    admin.xgroup_create(S, TRAINERS_GROUP, id="0", mkstream=True)
    for stream in (R, S, C, D):
        admin.xadd(stream, {"m": "x"})
    clients = {role: client(srv, c) for role, c in creds.items()}
    wrong = []
    try:
        for role, cmd, allowed in CASES:
            try:
                clients[role].execute_command(*cmd)
                refused = False
            except redis.exceptions.NoPermissionError:
                refused = True
            except redis.ResponseError:
                refused = False  # allowed by the ACL, failed for another reason
            if refused == allowed:
                wrong.append(f"{role}: {' '.join(map(str, cmd))} "
                             f"{'refused' if refused else 'allowed'}")
        # inside Lua, commands are checked against the caller's rights too
        gen = clients["generator"]
        with pytest.raises(redis.ResponseError, match="user executing the script can't"):
            gen.eval("return redis.call('XRANGE', KEYS[1], '-', '+')", 1, R)
        with pytest.raises(redis.ResponseError, match="user executing the script can't"):
            gen.eval("return redis.call('XADD', KEYS[1], '*', 'm', 'x')", 1, ST)
        with pytest.raises(redis.exceptions.NoPermissionError):
            gen.eval("return 1", 1, C)  # a script may only name the role's script keys
        # nor another role's op keys, declared or not
        sc = clients["scorer"]
        with pytest.raises(redis.exceptions.NoPermissionError):
            sc.eval("return 1", 2, R, K.op("trainer", "trained:t:1:1-0"))
        with pytest.raises(redis.ResponseError, match="user executing the script can't"):
            sc.eval("return redis.call('SET', ARGV[1], 'x')", 1, K.op("scorer", "y"),
                    K.op("trainer", "trained:t:1:1-0"))
        assert admin.exists(K.op("trainer", "trained:t:1:1-0")) == 0
    finally:
        for c in clients.values():
            c.close()
    assert not wrong, "\n".join(wrong)


def test_roles_run_their_scripts_through_bus_with_their_own_users(
        acl: AclServer, admin: redis.Redis) -> None:
    """The Bus wrapper logs in per role (credentials file) and its Lua scripts pass the
    ACL, loaded on first use (NOSCRIPT -> SCRIPT LOAD) by the role's own user."""
    srv, creds_file = acl.srv, acl.creds
    admin.script_flush()

    async def go() -> None:
        def bus(role: str) -> Bus:
            return Bus.connect(srv.url, RUN, role=role, credentials_file=str(creds_file))

        gen, tr, mon = bus("generator"), bus("trainer"), bus("monitor")
        try:
            assert await gen.admit(8) == 0
            assert await tr.set_version(3)
            await gen.heartbeat("generator/g", {"version": 3})
            snap = await snapshot(mon)
            assert snap["state"]["version"] == 3 and snap["state"]["cursor"] == 1
            assert "generator/g" in snap["workers"]
            users = {c["user"] for c in admin.client_list()}
            assert {"sluice-generator", "sluice-trainer", "sluice-monitor"} <= users
        finally:
            for b in (gen, tr, mon):
                await b.close()

    asyncio.run(go())
    assert admin.acl_log() == []


def test_each_role_runs_its_idempotent_scripts_and_janitor_in_its_own_op_namespace(
        acl: AclServer, admin: redis.Redis) -> None:
    """Every idempotent script through `Bus`, each as the role that calls it in the
    pipeline (generator: emit, abandon, skip; scorer: hand-off, retire, dead-letter, janitor;
    trainer: retire, dead-letter, janitor): nothing refused, and each result is stored
    under its caller's op namespace only."""
    srv, creds_file = acl.srv, acl.creds
    admin.script_flush()

    async def go() -> None:
        def bus(role: str) -> Bus:
            return Bus.connect(srv.url, RUN, role=role, credentials_file=str(creds_file))

        gen, sc, tr = bus("generator"), bus("scorer"), bus("trainer")
        try:
            await sc.ensure_group(R, SCORERS_GROUP)
            await sc.ensure_group(S, TRAINERS_GROUP)
            cursors = [await gen.admit(8, "generator/g") for _ in range(6)]
            for c in cursors[:4]:
                assert await gen.emit(b"g", cursor=c, owner="generator/g", op=f"emit:{c}")
            assert await gen.abandon("0:4", cursor=cursors[4], owner="generator/g",
                                     reason="test", role="generator/g", op="abandon:4")
            assert await gen.skip(cursors[5], owner="generator/g", op="skip:5", epoch=0)
            assert await gen.skipped_in_epoch(0) == 1
            await gen.loop_write({5: "0.5"})
            assert await sc.loop_read([5, 6]) == {5: 0.5, 6: None}
            got = await sc.read_group(R, SCORERS_GROUP, "s", count=4, block_ms=10)
            for n, e in enumerate(got[:2]):
                assert await sc.handoff(R, SCORERS_GROUP, e.id, S, b"sg", op=f"handoff:{n}")
            assert await sc.retire(R, SCORERS_GROUP, [got[2].id], "filtered", op="filtered:2")
            assert await sc.dead_letter(R, SCORERS_GROUP, got[3], reason="test", role="s",
                                        retire=True, op="dead:3")
            assert await sc.trim_acked(R, keep_ms=0) == 3  # up to the last delivered one
            await sc.prune_consumers(R, SCORERS_GROUP, idle_ms=60_000)
            scored = await tr.read_group(S, TRAINERS_GROUP, "t", count=2, block_ms=10)
            assert await tr.retire(S, TRAINERS_GROUP, [scored[0].id], "trained",
                                   op="trained:0")
            assert await tr.dead_letter(S, TRAINERS_GROUP, scored[1], reason="test",
                                        role="t", retire=True, op="dead:1")
            assert await tr.trim_acked(S, keep_ms=0) == 1
            st = await tr.state()
            assert st["cursor"] == 6 and st["retired"] == 6 and st["generating"] == 0
        finally:
            for b in (gen, sc, tr):
                await b.close()

    asyncio.run(go())
    assert admin.acl_log() == [], admin.acl_log()
    stored = sorted(k.decode().removeprefix(f"{K.prefix}:op:")
                    for k in admin.scan_iter(match=f"{K.prefix}:op:*"))
    admits = [s for s in stored if s.startswith("generator:admit:")]  # one per admit call
    assert admits and len(admits) <= 6
    stored = [s for s in stored if s not in admits]
    assert stored == sorted([*(f"generator:emit:{c}" for c in range(4)), "generator:abandon:4",
                             "generator:skip:5",
                             "scorer:handoff:0", "scorer:handoff:1", "scorer:filtered:2",
                             "scorer:dead:3", "trainer:trained:0", "trainer:dead:1"])


# ---------------------------------------------------------------- short real pipelines

PIPELINE = """
[model]
path = "{model}"
init = ""
[task]
heldout = 4
[generation]
num_generations = 4
max_new_tokens = 4
batch_groups = 2
[trainer]
groups_per_step = 2
max_steps = 3
save_steps = 1000
[up]
scorers = 1
generators = 1
plot = false
"""


def short_run(tmp: Path, run: str, url: str, model: Path, bus: str = "") -> dict[str, Any]:
    """`sluice up` of a 3-step run against the server at ``url``; its summary."""
    out = tmp / "out"
    cfg = tmp / "run.toml"
    cfg.write_text(run_header(run, out, url, block_ms=200, heartbeat_s=0.5) + bus + "\n"
                   + PIPELINE.format(model=model))
    p = sluice("up", str(cfg), "--eval-every", "1000", timeout=240)
    logs = role_logs(out) if (out / "logs").exists() else ""
    assert p.returncode == 0, f"{p.stdout[-2000:]}\n{p.stderr[-3000:]}\n{logs}"
    assert "NOPERM" not in logs and "no permissions" not in logs, logs
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["conservation"]["balanced"], summary
    return summary


def test_short_pipeline_runs_with_one_acl_user_per_role_over_tls(
        acl: AclServer, admin: redis.Redis, tmp_path: Path, tiny_model_dir: Path) -> None:
    admin.script_flush()  # every role loads its own scripts (NOSCRIPT -> SCRIPT LOAD)
    bus = f'credentials_file = "{acl.creds}"'
    if acl.certs is not None:
        bus += f'\ntls_ca_file = "{acl.certs / "ca.crt"}"'
    short_run(tmp_path, RUN, acl.tls_url or acl.srv.url, tiny_model_dir, bus)
    # the monitor commands log in as `monitor` (read-only) and see the finished run
    status = sluice("status", str(tmp_path / "run.toml"), "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["conservation"]["balanced"]
    tail = sluice("tail", "control", str(tmp_path / "run.toml"), "--from-start", "--count", "1")
    assert tail.returncode == 0 and "weights v0" in tail.stdout, tail.stderr
    assert admin.acl_log() == [], admin.acl_log()  # nothing was refused, to anyone
    if acl.tls_url is None:
        pytest.skip("ran over plain TCP: no openssl or no TLS in this redis-server")


# ---------------------------------------------------------------- TLS


def test_a_client_that_does_not_trust_the_ca_is_refused(acl: AclServer, tmp_path: Path
                                                        ) -> None:
    from pipeline.bus.security import CredentialsError, TLSFiles, client_options

    if acl.tls_url is None:
        pytest.skip("no openssl or no TLS in this redis-server")
    url = acl.tls_url
    for opts in ({}, client_options(url)):  # redis-py's defaults, and sluice's
        with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
            redis.Redis.from_url(url, socket_connect_timeout=5, **opts).ping()
    with pytest.raises(CredentialsError, match="tls_ca_file: no such file"):
        client_options(url, tls=TLSFiles(ca_file=str(tmp_path / "missing.pem")))


def test_client_certificate_for_servers_that_demand_one(acl: AclServer, tmp_path: Path
                                                        ) -> None:
    from pipeline.bus.security import TLSFiles, client_options

    if acl.certs is None:
        pytest.skip("no openssl or no TLS in this redis-server")
    certs, port = acl.certs, free_port()
    url = f"rediss://127.0.0.1:{port}/0"
    ca_only = client_options(url, tls=TLSFiles(ca_file=str(certs / "ca.crt")))
    mine = client_options(url, tls=TLSFiles(str(certs / "ca.crt"), str(certs / "client.crt"),
                                            str(certs / "client.key")))
    with RedisProcess(tmp_path, ["--port", "0", *tls_args(certs, port, "yes")], url, **{
            k: v for k, v in mine.items() if k.startswith("ssl_")}):
        with pytest.raises(redis.ConnectionError):
            redis.Redis.from_url(url, socket_connect_timeout=5, **ca_only).ping()
        r = redis.Redis.from_url(url, socket_connect_timeout=5, **mine)
        assert r.ping()
        r.close()
