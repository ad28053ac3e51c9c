"""The run's identity and its bus (`[run]`, `[bus]`): every role reads both, before
anything else, to find its Redis keys, its output folder and how to reach the bus."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline.bus.keys import RUN_NAME_PATTERN
from pipeline.config.base import _Section


class RunConfig(_Section):
    name: str = Field("run", pattern=RUN_NAME_PATTERN)
    """Run namespace: every Redis key is ``sluice:{name}:…``. Letters, digits, ``_``,
    ``.``, ``-``, not starting with ``.`` or ``-`` (it also names files and folders)."""
    output_dir: str = "runs/run"
    """Checkpoints, weights, metrics, logs and the embedded Redis live here."""
    seed: int = Field(0, ge=0)
    """Seeds the prompt order, model init and sampling."""
    max_time_s: float = Field(0.0, ge=0)
    """`sluice up` stops the run after this many seconds (0 = no limit)."""
    ledger: bool = True
    """Every role appends its delivery events to ``output_dir/ledger/*.jsonl`` (about
    1 KB per group in all) so `sluice audit` can check the run's whole history."""
    report_to: list[Literal["trackio", "wandb", "tensorboard", "mlflow"]] = Field(
        default_factory=list)
    """Experiment trackers that get the trainer's metrics (TRL's names), the evaluator's
    `eval/…` results and the config (`pip install 'sluice[trackio]'` etc.; README: Track
    your run). Empty = metrics.jsonl and eval.jsonl only."""
    tracking_project: str = Field("sluice", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    """Tracker project (wandb project, mlflow experiment); the tracker runs are `run.name`
    (trainer) and `run.name`-eval (evaluator), grouped by `run.name`."""


class BusConfig(_Section):
    redis_url: str = ""
    """redis://, rediss:// or unix:// URL; empty = `sluice up` embeds a Redis on a unix
    socket in output_dir and every role started by it uses that."""
    credentials_file: str = ""
    """TOML file of per-role Redis users and passwords, as `sluice acl` writes it (refused
    if group/world readable); empty = ``SLUICE_REDIS_CREDENTIALS_FILE``, else credentials
    from the environment (docs/security.md). Never put a password in redis_url."""
    cluster: bool = False
    """redis_url names one node of a Redis Cluster: the client discovers the others and
    routes each key to its master (redis-py's RedisCluster). Every key of a lane shares
    one hash tag, so each Lua script and MULTI touches one slot (docs/design.md §3)."""
    partitions: int = Field(1, ge=1, le=64)
    """Lanes of the bus: rollouts, scored, dlq, admission counters and leases split into
    this many self-contained partitions, each under its own hash tag, so a Redis Cluster
    spreads them over its masters (set it to the number of masters). Fixed for the life
    of a run: a resumed run with another value is refused. Each lane gets an equal share
    of the admission window, so it must not exceed trainer.window."""
    tls_ca_file: str = ""
    """rediss:// only: PEM CA bundle the server's certificate must chain to (empty = the
    system's CAs); the hostname is always checked."""
    tls_cert_file: str = ""
    """rediss:// only: PEM client certificate, for servers with ``tls-auth-clients yes``."""
    tls_key_file: str = ""
    """rediss:// only: PEM private key of tls_cert_file (empty = inside tls_cert_file)."""
    block_ms: int = Field(1000, ge=10, le=60_000)
    """How long a blocking stream read waits before the loop checks for shutdown."""
    claim_idle_ms: int = Field(30_000, ge=100)
    """An entry pending this long on a dead consumer is reclaimed (XAUTOCLAIM)."""
    max_deliveries: int = Field(5, ge=1, le=100)
    """An entry delivered more often than this goes to the dead-letter stream."""
    max_message_bytes: int = Field(16 * 2**20, ge=1024)
    """Entries larger than this are rejected on decode (dead-lettered)."""
    heartbeat_s: float = Field(2.0, gt=0, le=60)
    """Each worker refreshes its heartbeat this often."""
    reconnect_max_s: float = Field(10.0, gt=0, le=300)
    """Ceiling of the exponential reconnect backoff."""
    control_maxlen: int = Field(1000, ge=10)
    """Approximate length cap of the control stream (announcements only)."""
    keep_acked_s: float = Field(60.0, ge=0, le=86400)
    """Acknowledged entries of ``rollouts`` and ``scored`` younger than this (by their
    stream id's time) are kept for `sluice tail`; older ones that every consumer group has
    acknowledged are trimmed by id, without reading payloads (never a pending or
    undelivered entry). A window in time, not a count: an id window needs no entry read."""

    @model_validator(mode="after")
    def _check_security(self) -> BusConfig:
        from pipeline.bus.security import TLSFiles, check_bus_url

        check_bus_url(self.redis_url, TLSFiles(self.tls_ca_file, self.tls_cert_file,
                                               self.tls_key_file))
        if self.cluster and not self.redis_url.startswith(("redis://", "rediss://")):
            raise ValueError("bus.cluster = true needs bus.redis_url = redis:// or rediss:// "
                             "naming one node of the cluster (an embedded Redis is not a "
                             f"cluster); got {self.redis_url!r}")
        return self
