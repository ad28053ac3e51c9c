"""`sluice deploy wait`: block until what a deployed role needs is up, within a timeout.

A deployment starts its roles in the order `sluice up` does — Redis, the trainer (which
creates the consumer groups and announces version 0), then the rest — but the processes
are started by Slurm, Kubernetes or compose, so each waits here first:

- ``--redis``: Redis answers PING as the given role (its own credentials);
- ``--trainer``: ``control`` holds an announcement (the trainer has started: it writes
  ``control`` before anything else reads it), read as the given role, which every role
  but the trainer may do;
- ``--http URL``: the URL answers 200 (a vLLM server's /health).

A lost connection or a server still starting is waited out; a refused login is not (it
cannot get better). Exit 0 when everything answered, 1 at the timeout, naming what did
not.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Sequence

from pipeline.config import Config

POLL_S = 0.5


class WaitTimeout(RuntimeError):
    """What was waited for did not answer in time (the message names it)."""


def _until(what: str, ready: Callable[[], bool], deadline: float) -> None:
    while not ready():
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out waiting for {what}")
        time.sleep(POLL_S)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def wait(cfg: Config, role: str, *, redis: bool = False, trainer: bool = False,
         http: Sequence[str] = (), timeout_s: float = 300.0) -> None:
    """Wait for each thing asked (module docstring); raises `WaitTimeout`."""
    import redis as redis_py

    from pipeline.bus.connection import sync_client
    from pipeline.bus.keys import Keys
    from pipeline.runtime import redis_options

    deadline = time.monotonic() + timeout_s
    for url in http:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--http {url!r}: expected an http:// URL")
        _until(url, lambda u=url: _http_ok(u), deadline)
    if not (redis or trainer):
        return
    client = sync_client(cfg.redis_url, cluster=cfg.bus.cluster, **redis_options(cfg, role))
    control = Keys(cfg.run.name).control

    def answers(probe: Callable[[], bool]) -> Callable[[], bool]:
        def check() -> bool:
            try:
                return probe()
            except redis_py.AuthenticationError:
                raise
            except (redis_py.ConnectionError, redis_py.TimeoutError,
                    redis_py.BusyLoadingError, OSError):
                return False
        return check

    try:
        _until(f"Redis at {cfg.redis_url}", answers(lambda: bool(client.ping())), deadline)
        if trainer:
            _until(f"the trainer's first announcement on {control}",
                   answers(lambda: bool(client.xrevrange(control, count=1))), deadline)
    except redis_py.AuthenticationError as e:
        raise WaitTimeout(f"Redis at {cfg.redis_url} refused the login of {role}: {e} (is "
                          "it the deployment's Redis, started with its users.acl?)") from None
    finally:
        client.close()
