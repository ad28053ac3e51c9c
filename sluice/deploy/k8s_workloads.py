"""The k8s target's workloads: every role as a Job that ends with the run, and what keeps
a preempted or drained pod from ending the run.

Why Jobs: each role exits 0 once it has seen the trainer's `RunFinished` (the evaluator
after evaluating the final version, the archiver after draining `scored`), and a role
restarted after the end sees it again at once (they read the control stream from its
start). Under a Deployment that exit is restarted forever and a vLLM sidecar keeps its
GPU; in a Job the pod completes, and its native sidecars (`k8s_pods.sidecar`) are ended
by the kubelet with it. The trainer, generators, the evaluator, the archiver and (unless
KEDA scales them) the scorers are indexed Jobs of their process count. KEDA scales only
objects with a scale subresource, so with ``deploy.autoscale`` the scorers stay a
Deployment, restarted after the end until the run is deleted (docs/deploying.md).

Every Job: ``restartPolicy: Never`` (a failed pod is replaced by a new one, which
``podFailurePolicy`` requires), and
- ``podFailurePolicy``: a pod that failed because it was disrupted (preemption, eviction,
  a drain, node pressure: the ``DisruptionTarget`` condition) is replaced without
  counting against the backoff; a role that exits `FATAL_EXIT_CODE` (an error no
  restart can fix) fails its Job at once, as `sluice up` stops the run;
- ``up.max_restarts`` failures allowed (per process: ``backoffLimitPerIndex``; the
  trainer's pods together: ``backoffLimit``, torchrun restarting its ranks inside);
- ``podReplacementPolicy: Failed``: a replacement starts only once the old pod is gone,
  so two trainers never hold GPUs at once and two archivers never share a name;
- with ``deploy.queue_name``, Kueue's queue label: Kueue admits a Job whole, which gangs
  a multi-node trainer's pods (plain Kubernetes schedules them one by one).

A role stopped by SIGTERM (an eviction, a preemption, a drain) exits 0 after its orderly
stop, which would make its pod Succeeded and its Job index done: never replaced, and a
preempted trainer's Job complete. So each Job's container runs its command under
`SUPERVISE_SH`, which passes SIGTERM (and SIGUSR2, the orderly end) on to it and turns
the exit that follows a SIGTERM into 143; any other exit status passes through.

The trainer (and Redis, `k8s_redis`) also get a PodDisruptionBudget of all their pods,
so a drain waits for the run instead of evicting them, the annotations that keep the
cluster autoscaler and Karpenter from consolidating their nodes, and
``deploy.trainer_grace_s`` to write the final checkpoint on SIGTERM.
"""

from __future__ import annotations

from typing import Any

from pipeline.runtime import FATAL_EXIT_CODE
from sluice.deploy.containers import CONFIG, INIT_MODEL_SH, image_for
from sluice.deploy.k8s_pods import container, pod, resources, sidecar, wait
from sluice.deploy.k8s_scaling import labels
from sluice.deploy.plan import IMAGE_HOME, Plan, Proc, memory_gib

SUPERVISE_SH = ('"$@" & child=$!; stopped=; '
                "trap 'kill -USR2 $child' USR2; "
                "trap 'stopped=1; kill -TERM $child' TERM INT; "
                'while :; do wait "$child"; rc=$?; kill -0 "$child" 2>/dev/null || break; '
                'done; if [ -n "$stopped" ] && [ "$rc" = 0 ]; then rc=143; fi; exit "$rc"')
"""``sh -c SUPERVISE_SH NAME COMMAND...``: run COMMAND, pass SIGTERM, SIGINT and SIGUSR2 on
(a trapped signal interrupts ``wait``, so it waits again while the child lives), and
exit with its status, 143 in place of a 0 that followed a SIGTERM (module docstring).
No ``$(``: the kubelet would expand it as a variable reference."""
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KEEP = {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false",
        "karpenter.sh/do-not-disrupt": "true"}
"""Pod annotations asking node autoscalers not to evict a pod to consolidate nodes."""


def meta(plan: Plan, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "labels": labels(plan, component)}


def template(plan: Plan, component: str, spec: dict[str, Any], *,
             keep: bool = False) -> dict[str, Any]:
    """A pod template: the component's labels (and `KEEP` when ``keep``)."""
    md: dict[str, Any] = {"labels": labels(plan, component)}
    if keep:
        md["annotations"] = dict(KEEP)
    return {"metadata": md, "spec": spec}


def failure_policy(main: str) -> dict[str, Any]:
    """Disruptions are not failures; `FATAL_EXIT_CODE` of container ``main`` ends the
    Job (module docstring). Rules are tried in order."""
    return {"rules": [
        {"action": "Ignore",
         "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "FailJob", "onExitCodes": {"containerName": main, "operator": "In",
                                               "values": [FATAL_EXIT_CODE]}}]}


def supervised(c: dict[str, Any]) -> dict[str, Any]:
    """Container ``c`` with its command run under `SUPERVISE_SH`."""
    return {**c, "command": ["sh", "-c", SUPERVISE_SH, c["name"], *c["command"]]}


def job(plan: Plan, component: str, spec: dict[str, Any], count: int, *,
        per_index: bool = True, keep: bool = False) -> dict[str, Any]:
    """An indexed Job of ``count`` pods of ``spec`` (module docstring); a one-pod Job that
    is not ``per_index`` is a plain one."""
    up, d = plan.cfg.up, plan.cfg.deploy
    md = meta(plan, f"{plan.name}-{component}", component)
    if d.queue_name:
        md["labels"][QUEUE_LABEL] = d.queue_name
    js: dict[str, Any] = {}
    if per_index or count > 1:
        js.update(completionMode="Indexed", completions=count, parallelism=count)
    if per_index:
        js["backoffLimitPerIndex"] = up.max_restarts
    else:
        js["backoffLimit"] = up.max_restarts
    js["podReplacementPolicy"] = "Failed"
    js["podFailurePolicy"] = failure_policy(spec["containers"][0]["name"])
    js["template"] = template(plan, component, spec, keep=keep)
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": md, "spec": js}


def budget(plan: Plan, component: str, pods: int) -> dict[str, Any]:
    """A PodDisruptionBudget keeping all ``pods`` of ``component`` (``minAvailable``: the
    only form Kubernetes accepts for pods of a Job)."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": meta(plan, f"{plan.name}-{component}", component),
            "spec": {"minAvailable": pods,
                     "selector": {"matchLabels": labels(plan, component)}}}


def _role_pod(plan: Plan, proc: Proc, restart: str) -> dict[str, Any]:
    d = plan.cfg.deploy
    init = [wait(plan, proc.role), *(sidecar(plan, i, s) for i, s in enumerate(proc.servers))]
    main = container(plan, proc.role, image_for(plan, proc.gpus), proc.argv(CONFIG),
                     role=proc.role, metrics=True,
                     res=resources(proc.cpus, proc.gpus, memory_gib(proc.memory_gib, "role")))
    if restart == "Never":  # a Job's
        main = supervised(main)
    return pod(plan, [main], init, restart=restart, grace_s=d.grace_s)


def role_job(plan: Plan, proc: Proc) -> dict[str, Any]:
    """``proc.count`` processes of a role, one pod each, ending with the run."""
    return job(plan, proc.role, _role_pod(plan, proc, "Never"), proc.count)


def scaled_scorers(plan: Plan) -> dict[str, Any]:
    """The scorers as the Deployment KEDA scales (``deploy.autoscale``), from
    ``deploy.scorers_min`` replicas."""
    proc = plan.scorers
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": meta(plan, f"{plan.name}-{proc.role}", proc.role),
            "spec": {"replicas": plan.cfg.deploy.scorers_min,
                     "selector": {"matchLabels": labels(plan, proc.role)},
                     "template": template(plan, proc.role, _role_pod(plan, proc, "Always"))}}


def trainer(plan: Plan) -> list[dict[str, Any]]:
    """The trainer's Job, its disruption budget and, over several nodes, the headless
    Service of torchrun's rendezvous on pod 0 (an indexed Job's pod i is
    ``<job>-i.<subdomain>``)."""
    cfg, d, t = plan.cfg, plan.cfg.deploy, plan.trainer
    name = f"{plan.name}-trainer"
    init = []
    if plan.builds_model:
        init.append(container(plan, "init-model", d.image,
                              ["sh", "-c", INIT_MODEL_SH, cfg.model.path],
                              res=resources(1, 0, memory_gib(d.role_memory_gib, "role"))))
    if plan.ranks_per_node * d.trainer_nodes == 1:
        command = ["sluice", "train", CONFIG]
    else:
        command = [f"{IMAGE_HOME}/.venv/bin/python", "-m", "torch.distributed.run",
                   f"--nnodes={d.trainer_nodes}", f"--nproc-per-node={plan.ranks_per_node}",
                   "--rdzv-backend=c10d",
                   f"--rdzv-endpoint={name}-0.{name}:{d.rendezvous_port}",
                   f"--rdzv-id={plan.name}", f"--max-restarts={cfg.up.trainer_restarts}",
                   "-m", "sluice.cli", "train", CONFIG]
    main = container(plan, "trainer", image_for(plan, t.gpus), command, role="trainer",
                     metrics=True,
                     res=resources(t.cpus, t.gpus, memory_gib(t.memory_gib, "trainer")))
    spec = pod(plan, [supervised(main)], init, restart="Never", grace_s=d.trainer_grace_s)
    if d.trainer_nodes > 1:
        spec = {"subdomain": name, **spec}
    out = [job(plan, "trainer", spec, d.trainer_nodes, per_index=False, keep=True),
           budget(plan, "trainer", d.trainer_nodes)]
    if d.trainer_nodes > 1:
        out.append({"apiVersion": "v1", "kind": "Service",
                    "metadata": meta(plan, name, "trainer"),
                    "spec": {"clusterIP": "None", "selector": labels(plan, "trainer"),
                             "ports": [{"name": "rendezvous", "port": d.rendezvous_port}]}})
    return out
