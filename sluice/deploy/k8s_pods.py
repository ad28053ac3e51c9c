"""The k8s target's pods: a role's container, the init container that waits for the
trainer, the vLLM servers as native sidecars, and the pod spec around them.

Invariants, for every container `k8s` renders (Redis's included, `k8s_redis`):

- security: a non-root uid, no privilege escalation, no capabilities, the runtime's
  default seccomp profile (the Restricted Pod Security Standard) and a read-only root
  filesystem. A role writes only to /data (the run's volume, its working directory),
  /tmp (an emptyDir; ``HOME`` points there, so library caches such as Triton's and
  vLLM's config land in it) and /dev/shm (a memory-backed emptyDir of
  ``deploy.shm_gib``: the runtime's 64 MB is too small for NCCL and vLLM).
- resources: a CPU request (no CPU limit: a limit throttles a busy trainer or engine
  while the node idles), a memory request equal to its limit, never 0
  (`containers.memory_gib`), GPUs as limits.
- images: ``deploy.image_pull_policy`` on every container, ``deploy.image_pull_secrets``
  on every pod, ``deploy.scheduler_name`` when set.
- probes: a vLLM server is probed on its /health (on the pod's loopback, where it
  listens, so by `containers.probe_argv` inside it rather than an httpGet to the pod IP)
  at startup (the role waits for it), for readiness and for liveness (a hung server is
  restarted); each probe may take 5 s (the check itself gives up after 2).
"""

from __future__ import annotations

import math
from typing import Any

from sluice.deploy.containers import (
    CONFIG_DIR,
    HF_HOME,
    ROLE_ENV,
    ROLE_TLS_DIR,
    SHM,
    VLLM_CACHE,
    image_for,
    probe_argv,
    wait_trainer_argv,
)
from sluice.deploy.plan import DATA_DIR, Plan, Server, mem_mib, memory_gib, needs_s3, vllm_cpus

UID = 1000
SCRATCH = "/tmp"
SCRATCH_ENV = {"HOME": SCRATCH}
"""Added to every sluice container's environment: the root filesystem is read-only."""
PROBE_TIMEOUT_S = 5
WAIT_MEMORY_GIB = 0.25
"""`sluice deploy wait` (about 80 MB resident)."""
SECURE = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
          "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}
MOUNTS = [{"name": "data", "mountPath": DATA_DIR},
          {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
          {"name": "scratch", "mountPath": SCRATCH},
          {"name": "shm", "mountPath": SHM}]


def resources(cpus: float, gpus: int, memory: float) -> dict[str, Any]:
    """Requests and limits (module docstring); ``memory`` in GiB, never 0."""
    mem = f"{mem_mib(memory)}Mi"
    lim: dict[str, Any] = {"memory": mem}
    if gpus:
        lim["nvidia.com/gpu"] = gpus
    return {"requests": {"cpu": str(cpus), "memory": mem}, "limits": lim}


def _tls(plan: Plan) -> bool:
    return bool(plan.tls and plan.tls.role_files)


def mounts(plan: Plan) -> list[dict[str, Any]]:
    """`MOUNTS`, and with TLS the roles' TLS files (`tls_secret`) at `ROLE_TLS_DIR`."""
    tls = [{"name": "tls", "mountPath": ROLE_TLS_DIR, "readOnly": True}] if _tls(plan) else []
    return [*MOUNTS, *tls]


def tls_secret(plan: Plan) -> str:
    """The Secret of ``secrets/tls`` (the CA, a client certificate), which every role
    pod mounts and KEDA's TriggerAuthentication reads."""
    return f"{plan.name}-tls"


def volumes(plan: Plan) -> list[dict[str, Any]]:
    """The volumes of `mounts`: the run's data volume (its own kustomization, ``data/``),
    the config (kustomize's generated, hashed ConfigMap: it rewrites this name), the
    two emptyDirs, and with TLS its Secret (group-readable: the pod's fsGroup)."""
    shm = f"{mem_mib(plan.cfg.deploy.shm_gib)}Mi"
    tls = ([{"name": "tls", "secret": {"secretName": tls_secret(plan), "defaultMode": 0o440}}]
           if _tls(plan) else [])
    return [{"name": "data", "persistentVolumeClaim": {"claimName": f"{plan.name}-data"}},
            {"name": "config", "configMap": {"name": f"{plan.name}-config"}},
            {"name": "scratch", "emptyDir": {}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}}, *tls]


def container(plan: Plan, name: str, image: str, command: list[str], *, role: str = "",
              res: dict[str, Any], metrics: bool = False) -> dict[str, Any]:
    """A sluice container: ``command`` in /data, the role's Redis user (and the object
    store's variables where it needs them) from Secrets, ``metrics`` on the pod IP."""
    d = plan.cfg.deploy
    env = [{"name": k, "value": v} for k, v in {**ROLE_ENV, **SCRATCH_ENV}.items()]
    c: dict[str, Any] = {"name": name, "image": image, "imagePullPolicy": d.image_pull_policy,
                         "workingDir": DATA_DIR, "command": command}
    if metrics and d.metrics_port:
        env.insert(0, {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
        c["command"] = [*command, "--set", "metrics.host=$(POD_IP)"]
        c["ports"] = [{"name": "metrics", "containerPort": d.metrics_port}]
    c["env"] = env
    env_from = []
    if role and d.acl:
        env_from.append({"secretRef": {"name": f"{plan.name}-{role}"}})
    if role and needs_s3(plan.cfg, role):
        # the object store's AWS_* variables, from a Secret the user creates (never in
        # a manifest): docs/deploying.md, "Weights across machines"
        env_from.append({"secretRef": {"name": f"{plan.name}-s3"}})
    if env_from:
        c["envFrom"] = env_from
    c["volumeMounts"] = mounts(plan)
    c["resources"] = res
    c["securityContext"] = SECURE
    return c


def _probe(s: Server, period_s: int, failures: int) -> dict[str, Any]:
    return {"exec": {"command": probe_argv(s)}, "periodSeconds": period_s,
            "timeoutSeconds": PROBE_TIMEOUT_S, "failureThreshold": failures}


def sidecar(plan: Plan, i: int, s: Server) -> dict[str, Any]:
    """A vLLM server as a native sidecar (an init container with ``restartPolicy:
    Always``): started before the role's container, which waits for its startup probe,
    restarted when its liveness probe fails, and ended by the kubelet once the role's
    container has exited (its GPU freed with the pod)."""
    d, v = plan.cfg.deploy, plan.cfg.generation.vllm
    env = {"HF_HOME": HF_HOME, **SCRATCH_ENV, **s.env(VLLM_CACHE)}
    return {"name": f"vllm-{i}", "image": image_for(plan, int(s.gpu)),
            "imagePullPolicy": d.image_pull_policy, "restartPolicy": "Always",
            "workingDir": DATA_DIR, "command": s.argv,
            "env": [{"name": k, "value": val} for k, val in sorted(env.items())],
            "volumeMounts": mounts(plan),
            "resources": resources(vllm_cpus(s), int(s.gpu),
                                   memory_gib(d.vllm_memory_gib, "vllm")),
            "startupProbe": _probe(s, 5, max(1, math.ceil(v.start_timeout_s / 5))),
            "readinessProbe": _probe(s, 10, 3),
            "livenessProbe": _probe(s, 15, 4),
            "securityContext": SECURE}


def wait(plan: Plan, role: str) -> dict[str, Any]:
    """Init container: wait for the trainer's first announcement, as the pod's role."""
    return container(plan, "wait-trainer", plan.cfg.deploy.image, wait_trainer_argv(role),
                     role=role, res=resources(0.1, 0, WAIT_MEMORY_GIB))


def pod_security(uid: int) -> dict[str, Any]:
    return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
            "seccompProfile": {"type": "RuntimeDefault"}}


def pod(plan: Plan, containers: list[dict[str, Any]], init: list[dict[str, Any]], *,
        restart: str, grace_s: int, uid: int = UID,
        own_volumes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A pod spec (module docstring); ``own_volumes`` replaces the role pods' volumes."""
    d = plan.cfg.deploy
    spec: dict[str, Any] = {"restartPolicy": restart, "terminationGracePeriodSeconds": grace_s,
                            "securityContext": pod_security(uid)}
    if d.scheduler_name:
        spec["schedulerName"] = d.scheduler_name
    if d.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in d.image_pull_secrets]
    if init:
        spec["initContainers"] = init
    spec["containers"] = containers
    vols = volumes(plan) if own_volumes is None else own_volumes
    if vols:
        spec["volumes"] = vols
    return spec
