"""The k8s target's objects around the roles: the KEDA autoscaler of the scorers, the
NetworkPolicy in front of the bundled Redis, and the metrics Service / ServiceMonitor.

KEDA (its ``redis-streams`` scaler, Redis 7+: it reads the group's ``lag`` from XINFO
GROUPS): one trigger per lane, each watching that lane's `rollouts` stream and the
`scorers` consumer group (`Plan.streams`, `Plan.group`: what `workers.scorer` reads),
with ``lagCount`` = ``deploy.scorer_lag`` split over the lanes (`Plan.lane_lag`). KEDA
takes the largest replica count its triggers ask for, so with evenly loaded lanes the
scorers get about total lag / ``deploy.scorer_lag`` replicas, between
``deploy.scorers_min`` (at least 1: lag does not count entries a killed scorer left
pending; a running scorer reclaims them after ``bus.claim_idle_ms``) and
``deploy.scorers_max``. It reads as the run's `monitor` user (read only), through a
TriggerAuthentication on that user's Secret. A Redis Cluster (``bus.cluster``) uses the
``redis-cluster-streams`` scaler with the same fields. With TLS the TriggerAuthentication
also hands KEDA ``tls: enable`` and the CA (and a client certificate) from the roles'
TLS Secret; KEDA checks the server's certificate against that CA.
"""

from __future__ import annotations

from typing import Any

from sluice.deploy.plan import Plan

KEDA_API = "keda.sh/v1alpha1"
KEDA_VERSION = "2.15"
"""The KEDA release whose documented fields the ScaledObject follows
(deploy/keda/scaledobject.schema.json records the same)."""


def labels(plan: Plan, component: str) -> dict[str, str]:
    """The labels of every object of the run: ``instance`` selects the run's pods (the
    NetworkPolicy, the metrics Service), ``component`` one role's."""
    return {"app.kubernetes.io/part-of": "sluice", "app.kubernetes.io/instance": plan.name,
            "app.kubernetes.io/component": component}


def triggers(plan: Plan, host: str) -> list[dict[str, Any]]:
    """One KEDA trigger per lane of the scorers' stream (module docstring)."""
    cfg, d = plan.cfg, plan.cfg.deploy
    h, port, db = plan.redis_address(host)
    kind = "redis-cluster-streams" if cfg.bus.cluster else "redis-streams"
    out = []
    for i, stream in enumerate(plan.streams):
        meta: dict[str, str] = ({"addresses": f"{h}:{port}"} if cfg.bus.cluster
                                else {"address": f"{h}:{port}", "databaseIndex": str(db)})
        meta.update({"stream": stream, "consumerGroup": plan.group,
                     "lagCount": str(plan.lane_lag),
                     "activationLagCount": str(d.scorer_activation_lag)})
        # TLS is the TriggerAuthentication's (`tls`, `ca`): KEDA refuses a trigger that
        # also sets metadata.enableTLS
        trig: dict[str, Any] = {"type": kind, "name": f"lane-{i}", "metadata": meta}
        if d.acl or plan.tls:
            trig["authenticationRef"] = {"name": f"{plan.name}-keda"}
        out.append(trig)
    return out


def keda(plan: Plan, host: str) -> list[dict[str, Any]]:
    d = plan.cfg.deploy
    docs: list[dict[str, Any]] = []
    refs: list[dict[str, str]] = []
    if d.acl:
        secret = f"{plan.name}-monitor"
        refs += [{"parameter": "username", "name": secret,
                  "key": "SLUICE_REDIS_MONITOR_USERNAME"},
                 {"parameter": "password", "name": secret,
                  "key": "SLUICE_REDIS_MONITOR_PASSWORD"}]
    if plan.tls:  # the roles' TLS Secret: `tls` = enable, the CA, a client certificate
        params = {"tls": "tls", "ca": "ca.crt", "cert": "client.crt", "key": "client.key"}
        refs += [{"parameter": p, "name": f"{plan.name}-tls", "key": k}
                 for p, k in params.items() if p == "tls" or k in plan.tls.role_files]
    if refs:
        docs.append({"apiVersion": KEDA_API, "kind": "TriggerAuthentication",
                     "metadata": {"name": f"{plan.name}-keda",
                                  "labels": labels(plan, "scorer")},
                     "spec": {"secretTargetRef": refs}})
    docs.append({"apiVersion": KEDA_API, "kind": "ScaledObject",
                 "metadata": {"name": f"{plan.name}-scorer",
                              "labels": labels(plan, "scorer")},
                 "spec": {"scaleTargetRef": {"name": f"{plan.name}-scorer"},
                          "pollingInterval": d.polling_interval_s,
                          "minReplicaCount": d.scorers_min,
                          "maxReplicaCount": d.scorers_max,
                          "triggers": triggers(plan, host)}})
    return docs


def network_policy(plan: Plan) -> dict[str, Any]:
    """Only this run's pods (and KEDA's operator, when it scales the scorers) reach the
    bundled Redis, on its port."""
    d = plan.cfg.deploy
    sources: list[dict[str, Any]] = [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": plan.name}}}]
    if d.autoscale:
        sources.append({"namespaceSelector": {"matchLabels": {
                            "kubernetes.io/metadata.name": d.keda_namespace}},
                        "podSelector": {"matchLabels": {"app": "keda-operator"}}})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": f"{plan.name}-redis", "labels": labels(plan, "redis")},
            "spec": {"podSelector": {"matchLabels": labels(plan, "redis")},
                     "policyTypes": ["Ingress"],
                     "ingress": [{"from": sources,
                                  "ports": [{"protocol": "TCP", "port": d.redis_port}]}]}}


def metrics(plan: Plan) -> list[dict[str, Any]]:
    """A headless Service over every role pod's ``metrics`` port, and (with
    ``deploy.service_monitor``) the Prometheus Operator's ServiceMonitor of it."""
    d = plan.cfg.deploy
    sel = {"app.kubernetes.io/instance": plan.name, "sluice.metrics": "true"}
    svc = {"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": f"{plan.name}-metrics", "labels": labels(plan, "metrics")},
           "spec": {"clusterIP": "None", "selector": {"app.kubernetes.io/instance": plan.name},
                    "ports": [{"name": "metrics", "port": d.metrics_port,
                               "targetPort": "metrics"}]}}
    svc["metadata"]["labels"].update(sel)
    docs: list[dict[str, Any]] = [svc]
    if d.service_monitor:
        docs.append({"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
                     "metadata": {"name": plan.name, "labels": labels(plan, "metrics")},
                     "spec": {"selector": {"matchLabels": sel},
                              "endpoints": [{"port": "metrics", "path": "/metrics",
                                             "interval": "15s"}]}})
    return docs


def scaling_objects(plan: Plan, host: str) -> dict[str, list[dict[str, Any]]]:
    """File name -> objects, for the files the config asks for."""
    d = plan.cfg.deploy
    out: dict[str, list[dict[str, Any]]] = {}
    if plan.bundled:
        out["network-policy.yaml"] = [network_policy(plan)]
    if d.metrics_port:
        out["metrics.yaml"] = metrics(plan)
    if d.autoscale:
        out["keda.yaml"] = keda(plan, host)
    return out
