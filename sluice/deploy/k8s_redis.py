"""The k8s target's bundled Redis: a one-replica StatefulSet, its Services and its
disruption budget.

- AOF on its own volume (``redis-data``), kept when the StatefulSet is deleted
  (``persistentVolumeClaimRetentionPolicy: Retain``, stated rather than left to the
  default): the run's cleanup keeps the bus with the run's data, so a resumed run finds
  its streams; the ACL file from a Secret.
- ``{name}-redis``: the Service the roles and KEDA connect to; ``{name}-redis-headless``
  (``clusterIP: None``): the StatefulSet's governing Service, which gives its pod a
  stable DNS name.
- Probes that ask Redis itself, logged in as the read-only `monitor` user from its
  Secret (``REDISCLI_AUTH``: the password is in no argv): ready when ``PING`` answers
  ``PONG``, alive when it answers ``PONG`` or ``LOADING`` (a large AOF being replayed is
  not a hung server). redis-cli exits 0 on an error reply, so the probe reads the reply.
- A PodDisruptionBudget of its one pod and `KEEP`: a drain waits for the run.
"""

from __future__ import annotations

from typing import Any

from sluice.deploy.containers import REDIS_ACL_DIR, REDIS_TLS_DIR, redis_argv
from sluice.deploy.k8s_pods import SECURE, pod, resources
from sluice.deploy.k8s_scaling import labels
from sluice.deploy.k8s_workloads import budget, meta, template
from sluice.deploy.plan import Plan, memory_gib

REDIS_UID = 999  # the official redis image's user
REDIS_STORAGE = "10Gi"


def ping_script(plan: Plan, *, loading_ok: bool) -> str:
    """``sh -c`` script: exit 0 when PING answers PONG (or ``LOADING`` when
    ``loading_ok``), as the monitor user when the run has ACL users. No ``$(``: the
    kubelet expands ``$(NAME)`` in an exec probe's command before the shell sees it."""
    d = plan.cfg.deploy
    tls = "".join(f"{a} " for a in (plan.tls.cli_args(REDIS_TLS_DIR) if plan.tls else []))
    cli = f"redis-cli {tls}-p {d.redis_port} ping"
    if d.acl:
        cli = ('REDISCLI_AUTH="$SLUICE_REDIS_MONITOR_PASSWORD" redis-cli --no-auth-warning '
               f'--user "$SLUICE_REDIS_MONITOR_USERNAME" {tls}-p {d.redis_port} ping')
    ok = "grep -Eqx 'PONG|LOADING.*'" if loading_ok else "grep -qx PONG"
    return f"{cli} 2>&1 | {ok}"


def _probe(plan: Plan, *, loading_ok: bool, period_s: int, failures: int) -> dict[str, Any]:
    return {"exec": {"command": ["sh", "-c", ping_script(plan, loading_ok=loading_ok)]},
            "periodSeconds": period_s, "timeoutSeconds": 5, "failureThreshold": failures}


def redis(plan: Plan) -> list[dict[str, Any]]:
    d = plan.cfg.deploy
    name = f"{plan.name}-redis"
    headless = f"{name}-headless"
    mounts = [{"name": "redis-data", "mountPath": "/data"}]
    volumes = []
    if d.acl:
        mounts.append({"name": "acl", "mountPath": REDIS_ACL_DIR, "readOnly": True})
        volumes.append({"name": "acl", "secret": {"secretName": f"{plan.name}-redis-acl",
                                                 "defaultMode": 0o444}})
    if plan.tls and plan.tls.serves:  # its certificate and key: no role pod mounts them
        mounts.append({"name": "tls", "mountPath": REDIS_TLS_DIR, "readOnly": True})
        volumes.append({"name": "tls", "secret": {"secretName": f"{plan.name}-redis-tls",
                                                 "defaultMode": 0o440}})
    pvc: dict[str, Any] = {"accessModes": ["ReadWriteOnce"],
                           "resources": {"requests": {"storage": REDIS_STORAGE}}}
    if d.storage_class:
        pvc["storageClassName"] = d.storage_class
    c: dict[str, Any] = {"name": "redis", "image": d.redis_image,
                         "imagePullPolicy": d.image_pull_policy, "command": redis_argv(plan),
                         "ports": [{"name": "redis", "containerPort": d.redis_port}]}
    if d.acl:
        c["envFrom"] = [{"secretRef": {"name": f"{plan.name}-monitor"}}]
    c.update({"readinessProbe": _probe(plan, loading_ok=False, period_s=2, failures=3),
              "livenessProbe": _probe(plan, loading_ok=True, period_s=10, failures=6),
              "volumeMounts": mounts,
              "resources": resources(1, 0, memory_gib(d.redis_memory_gib, "redis")),
              "securityContext": SECURE})
    spec = pod(plan, [c], [], restart="Always", grace_s=d.grace_s, uid=REDIS_UID,
               own_volumes=volumes)
    port = [{"name": "redis", "port": d.redis_port, "targetPort": d.redis_port}]
    return [{"apiVersion": "apps/v1", "kind": "StatefulSet",
             "metadata": meta(plan, name, "redis"),
             "spec": {"serviceName": headless, "replicas": 1,
                      "selector": {"matchLabels": labels(plan, "redis")},
                      "template": template(plan, "redis", spec, keep=True),
                      "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Retain",
                                                               "whenScaled": "Retain"},
                      "volumeClaimTemplates": [{"metadata": {"name": "redis-data",
                                                             "labels": labels(plan, "redis")},
                                                "spec": pvc}]}},
            {"apiVersion": "v1", "kind": "Service", "metadata": meta(plan, name, "redis"),
             "spec": {"selector": labels(plan, "redis"), "ports": port}},
            {"apiVersion": "v1", "kind": "Service", "metadata": meta(plan, headless, "redis"),
             "spec": {"clusterIP": "None", "selector": labels(plan, "redis"), "ports": port}},
            budget(plan, "redis", 1)]


def redis_host(plan: Plan) -> str:
    """The bundled Redis's Service as pods of any namespace (KEDA's) reach it."""
    return f"{plan.name}-redis.{plan.cfg.deploy.namespace}.svc"
