"""A Redis loaded with `sluice acl`'s users keeps every write across a restart from its
AOF, transactions and scripts included.

Why this is a test: when Redis replays its AOF, a ``MULTI``/``EXEC`` block (and every Lua
script's effects, which Redis 7 logs wrapped in one) is checked again against the ACL of
the client replaying it, which runs as the ``default`` user. With ``default`` stripped of
every permission, each such block was refused at load ("-NOPERM ACLs rules changed
between the moment the transaction was accumulated and the EXEC call", logged as
CRITICAL) and silently dropped: a restarted bundled Redis came back with its plain
writes and without the pipeline's state (every bus operation is a script), and the run
stalled. Seen first on a requeued Slurm job (tests/deploy/test_slurm.py).
"""

from __future__ import annotations

from pathlib import Path

import redis

from pipeline.bus.keys import Keys
from pipeline.bus.security import load_credentials_file
from pipeline.ports import free_port
from sluice.acl import make_acl
from tests.helpers import RedisProcess

RUN = "aof"


def test_transactions_and_scripts_survive_a_restart_from_the_aof(tmp_path: Path) -> None:
    acl = make_acl(tmp_path / "acl", RUN)
    admin = load_credentials_file(acl.credentials_file)["admin"]
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    args = ["--port", str(port), "--aclfile", str(acl.acl_file), "--appendonly", "yes",
            "--appendfsync", "always"]
    data = tmp_path / "redis"
    prefix = Keys(RUN).prefix
    with RedisProcess(data, args, url):
        r = redis.Redis.from_url(url, username=admin.username, password=admin.password)
        r.set(f"{prefix}:plain", "1")
        with r.pipeline(transaction=True) as tx:  # MULTI ... EXEC
            tx.hset(f"{prefix}:state", "version", 7)
            tx.xadd(f"{prefix}:control", {"kind": "announce"})
            tx.execute()
        r.eval("redis.call('SET', KEYS[1], ARGV[1]); return 1", 1, f"{prefix}:script", "2")
        r.close()
    log = data / "redis.log"
    with RedisProcess(data, args, url):
        r = redis.Redis.from_url(url, username=admin.username, password=admin.password)
        try:
            assert r.get(f"{prefix}:plain") == b"1"
            assert r.hget(f"{prefix}:state", "version") == b"7", log.read_text()[-1500:]
            assert r.xlen(f"{prefix}:control") == 1
            assert r.get(f"{prefix}:script") == b"2"
        finally:
            r.close()
    assert "NOPERM" not in log.read_text()
    # and the default user still serves nobody: a connection without a login is refused
    anonymous = redis.Redis.from_url(url)
    with RedisProcess(data, args, url):
        try:
            anonymous.ping()
            raise AssertionError("the default user answered without a login")
        except redis.AuthenticationError:
            pass
        finally:
            anonymous.close()
