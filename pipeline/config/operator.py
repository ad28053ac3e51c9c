"""The operator-only sections (`[up]`, `[deploy]`): no role reads them. `sluice up`
reads `up` to start and supervise the roles on one machine, and `sluice deploy render`
reads `deploy` to lay them out on a cluster; a role's behaviour never depends on them
(`up.stop_at` is checked against the evaluator's metrics by `pipeline.config.root`)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import _Section
from pipeline.evaluation import parse_target


class UpConfig(_Section):
    scorers: int = Field(2, ge=0, le=64)
    """Scorer processes `sluice up` starts."""
    generators: int = Field(1, ge=0, le=64)
    """Generator processes `sluice up` starts."""
    trainer_ranks: int = Field(1, ge=1, le=64)
    """Data-parallel trainer ranks: > 1 runs the trainer as one ``torchrun`` job of this
    many processes (FSDP2; gloo on CPU, nccl on GPU; docs/gpu.md)."""
    trainer_restarts: int = Field(3, ge=0, le=100)
    """With trainer_ranks > 1: torchrun's ``--max-restarts``. A rank that dies takes the
    job down; torchrun restarts every rank, which resume from the newest checkpoint."""
    max_restarts: int = Field(3, ge=0, le=100)
    """A role that exits abnormally (a crash, ``kill -9``) is restarted after a backoff
    (1 s, doubling per crash, at most 30 s; the trainer resumes from its checkpoint); the
    run stops, naming the role and its log tail, when one role crashed more than this many
    times within restart_window_s. 0 = stop the run at the first crash. A role that exits
    78 (an error no restart can fix, e.g. a filter that rejected a whole epoch) stops the
    run at once."""
    restart_window_s: float = Field(300.0, gt=0)
    """The window in which a role's crashes count against max_restarts."""
    end_timeout_s: float = Field(600.0, ge=0)
    """On ``run.max_time_s``, ``stop_at`` met and the first Ctrl-C the run ends in order:
    the trainer finishes its step and announces the end as at ``max_steps``, the evaluator
    evaluates that final version, then every role exits. This bounds how long that may
    take before every role is stopped as it stands (a second Ctrl-C or a SIGTERM does that
    at once); 0 = no orderly end (stop every role at once, the final version not
    evaluated)."""
    plot: bool = True
    """Write reward_curve.png into output_dir at the end."""
    metrics: bool = True
    """Every role `sluice up` starts serves ``/metrics`` on its own free port on
    metrics.host (listed by `sluice status`; a restarted role gets a new one); false = no
    role serves metrics (metrics.port is not used: roles on one machine cannot share it)."""
    stop_at: str = ""
    """Stop the run once an evaluation meets ``METRIC>=VALUE`` (or ``<=``), e.g.
    ``pass@1>=0.9`` or ``rewards/accuracy_reward>=0.5``; the metric is one the evaluator
    reports (`pipeline.evaluation`). The summary's time to target follows it. "" = never."""

    @field_validator("stop_at")
    @classmethod
    def _check_stop_at(cls, v: str) -> str:
        parse_target(v)
        return v


IMAGE_PATTERN = r"^[a-z0-9][a-z0-9._/:@-]{0,254}$"
"""A container image reference (``registry/name:tag`` or ``name@sha256:…``)."""


class DeployConfig(_Section):
    """`sluice deploy render` (docs/deploying.md). Counts come from the keys `sluice up`
    already reads: ``up.trainer_ranks``, ``up.generators``, ``up.scorers`` and
    ``generation.vllm.launch`` (the vLLM servers, shared out over the generators); the
    roles' devices decide their GPUs. These keys say only how the roles are laid out on
    machines; no role reads them."""

    image: str = Field("sluice:0.1.0", pattern=IMAGE_PATTERN)
    """k8s, compose: the image of the roles that use no GPU (deploy/docker/Dockerfile)."""
    gpu_image: str = Field("sluice-gpu:0.1.0", pattern=IMAGE_PATTERN)
    """k8s, compose: the image of the roles that use a GPU and of the vLLM servers
    (deploy/docker/Dockerfile.gpu, on vLLM's published image)."""
    redis: Literal["bundled", "external"] = "bundled"
    """`bundled`: the deployment runs its own Redis (AOF on, the ACL file of
    ``bus.credentials_file``'s folder); `external`: the roles use ``bus.redis_url``, a
    Redis 7+ you run."""
    redis_image: str = Field("redis:7.4", pattern=IMAGE_PATTERN)
    """k8s, compose: the image of the bundled Redis (7 or later: the ACL selectors)."""
    redis_port: int = Field(6379, ge=1, le=65535)
    """The bundled Redis's TCP port."""
    acl: bool = True
    """Every role logs in as its own Redis user: ``bus.credentials_file`` must name the
    credentials file `sluice acl` wrote (its users.acl beside it, for a bundled Redis);
    the render turns it into one credentials file or Secret per role. False: Redis's
    default user, no password (only for a Redis nothing else can reach)."""
    namespace: str = Field("sluice", pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
    """k8s: the namespace of every object."""
    trainer_nodes: int = Field(1, ge=1, le=64)
    """Machines the ``up.trainer_ranks`` ranks are spread over (torchrun, rendezvous on
    the first): slurm nodes of the trainer's component, k8s pods of the indexed Job. Must
    divide ``up.trainer_ranks``."""
    generator_nodes: int = Field(1, ge=1, le=64)
    """slurm: nodes of the generators' component; ``up.generators`` and
    ``generation.vllm.launch`` are spread evenly over them (each must be a multiple)."""
    scorers_with: Literal["trainer", "generators"] = "trainer"
    """slurm: the component the scorers run on (the trainer's first node, or spread over
    the generators' nodes)."""
    evaluator_with: Literal["trainer", "generators"] = "trainer"
    """slurm: the component the evaluator (and its vLLM server) runs on."""
    partition: str = Field("", pattern=r"^[A-Za-z0-9_.,-]{0,64}$")
    """slurm: partition of the trainer's component ("" = the cluster's default)."""
    gpu_partition: str = Field("", pattern=r"^[A-Za-z0-9_.,-]{0,64}$")
    """slurm: partition of the generators' component ("" = ``partition``)."""
    time_limit_min: int = Field(0, ge=0, le=525_600)
    """slurm: the job's time limit in minutes (0 = the partition's)."""
    exclusive: bool = True
    """slurm: every node of the job is the job's alone (``--exclusive``): its fixed ports
    (redis_port, vllm_port, rendezvous_port) and GPUs cannot meet another job's. False
    shares nodes; give each such job its own ports."""
    requeue: bool = True
    """slurm: the job may be requeued (``--requeue``: preemption, a node failure,
    ``scontrol requeue``) and requeues itself when it is told to stop before the run
    ends (the warning ``--signal`` sends ``trainer_grace_s + grace_s`` before the time
    limit); the next attempt resumes from the newest checkpoint, Redis from its AOF, and
    every log gets the attempt appended, not overwritten."""
    rendezvous_port: int = Field(29400, ge=1, le=65535)
    """torchrun's c10d rendezvous port on the trainer's first node (trainer_ranks > 1)."""
    vllm_port: int = Field(8000, ge=1, le=65000)
    """A role's vLLM servers listen on loopback, on this port and the next ones; each runs
    beside the role that uses it (same node, pod or network namespace)."""
    metrics_port: int = Field(9100, ge=0, le=65535)
    """k8s: the port every pod serves ``/metrics`` on, at its pod IP (0 = none); slurm
    and compose keep ``metrics.port``."""
    service_monitor: bool = False
    """k8s: also render a Prometheus Operator ServiceMonitor for the roles' ``/metrics``."""
    autoscale: bool = False
    """k8s: a KEDA ScaledObject scales the scorers' Deployment between scorers_min and
    scorers_max on the lag of the `scorers` group on `rollouts` (one trigger per lane;
    needs KEDA installed: a cluster without its CRDs refuses the ScaledObject); false:
    ``up.scorers`` scorers as a Job that ends with the run."""
    scorers_min: int = Field(1, ge=1, le=1000)
    """Fewest scorer replicas. At least 1: entries a killed scorer left pending are not
    lag, and only a running scorer reclaims them (after ``bus.claim_idle_ms``)."""
    scorers_max: int = Field(8, ge=1, le=1000)
    """Most scorer replicas."""
    scorer_lag: int = Field(16, ge=1, le=1_000_000)
    """KEDA's target: `rollouts` entries not yet delivered to the `scorers` group per
    scorer replica (its ``lagCount``, split over the lanes)."""
    scorer_activation_lag: int = Field(0, ge=0, le=1_000_000)
    """KEDA's ``activationLagCount`` per lane (below it a trigger is inactive)."""
    polling_interval_s: int = Field(15, ge=1, le=3600)
    """How often KEDA reads the lag."""
    keda_namespace: str = Field("keda", pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
    """k8s: the namespace of KEDA's operator, which the NetworkPolicy lets reach Redis."""
    grace_s: int = Field(60, ge=1, le=3600)
    """Pod termination grace (k8s), stop_grace_period (compose), and how long the slurm
    job waits for the roles to exit after the trainer ends. A scorer stopped by SIGTERM
    finishes the groups it holds within it (so at least ``scoring.reward_timeout_s``)."""
    trainer_grace_s: int = Field(600, ge=1, le=86_400)
    """k8s, compose: the trainer's termination grace, in place of grace_s (a stopped
    trainer writes its final checkpoint, which for a large model takes far longer than
    the other roles' exit). slurm: the job is told to stop (SIGTERM to its script)
    ``trainer_grace_s + grace_s`` before its time limit, so that checkpoint is written."""
    storage_gib: int = Field(50, ge=1, le=1_000_000)
    """k8s: size of the ReadWriteMany volume every pod mounts at /data (run.output_dir,
    the weight store, the HF cache)."""
    storage_class: str = Field("", pattern=r"^$|^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$")
    """k8s: its storage class ("" = the cluster's default)."""
    trainer_memory_gib: float = Field(0.0, ge=0, le=65536)
    """Memory of each trainer node/pod (0 = 16)."""
    role_memory_gib: float = Field(0.0, ge=0, le=65536)
    """Memory of each generator, scorer and evaluator process (0 = 4)."""
    vllm_memory_gib: float = Field(0.0, ge=0, le=65536)
    """Host memory of each vLLM server (0 = 16)."""
    redis_memory_gib: float = Field(0.0, ge=0, le=65536)
    """Memory of the bundled Redis (0 = 4). Slurm asks each node for the sum of what
    runs on it (``--mem``), and a step with a GPU is given its own share."""
    redis_tls_dir: str = ""
    """The bundled Redis serves TLS only (no plaintext port) with the ``ca.crt``,
    ``redis.crt`` and ``redis.key`` of this folder (`sluice deploy certs` makes them), and
    every role connects with ``rediss://``, checking the certificate and its host name;
    the files travel as secrets (docs/deploying.md). "" = plain TCP. An external Redis
    uses a rediss:// ``bus.redis_url`` and ``bus.tls_*`` instead."""
    shm_gib: float = Field(4.0, gt=0, le=65536)
    """k8s, compose: the size of /dev/shm in each role's pod or container (a
    memory-backed volume; the runtimes' default is 64 MB, too small for NCCL's shared
    memory transport and vLLM's tensor-parallel workers). It counts against the pod's
    memory as it is used."""
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = "IfNotPresent"
    """k8s: every container's imagePullPolicy (compose: ``pull_policy`` missing, always
    or never)."""
    image_pull_secrets: list[str] = Field(default_factory=list)
    """k8s: Secrets of type kubernetes.io/dockerconfigjson in ``namespace`` (created by
    you: docs/deploying.md) that every pod pulls its images with."""
    queue_name: str = Field("", pattern=r"^$|^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$")
    """k8s: a Kueue LocalQueue the run's Jobs are submitted to (the
    ``kueue.x-k8s.io/queue-name`` label): Kueue admits each Job whole, so a multi-node
    trainer's pods start together or not at all. "" = no Kueue."""
    scheduler_name: str = Field("", pattern=r"^$|^[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?$")
    """k8s: every pod's ``schedulerName`` ("" = the cluster's default scheduler)."""

    @field_validator("image_pull_secrets")
    @classmethod
    def _check_secret_names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not re.fullmatch(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?", name):
                raise ValueError(f"{name!r} is not a Secret name (a lower-case DNS "
                                 "subdomain)")
        return v

    @model_validator(mode="after")
    def _check(self) -> DeployConfig:
        if self.scorers_min > self.scorers_max:
            raise ValueError("scorers_min must be <= scorers_max")
        return self
