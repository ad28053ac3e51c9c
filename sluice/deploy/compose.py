"""The compose target: one compose project for one host with GPUs (``docker compose up``).

Services: the bundled Redis (AOF on a named volume, the ACL file bind-mounted); a one-shot
``prepare`` that builds the tiny model when ``model.init`` asks for it; the trainer (one
process: ``up.trainer_ranks`` > 1 is refused at render); a one-shot ``wait-trainer`` that
returns once the trainer has announced (`sluice deploy wait`), which the other roles wait
for (``service_completed_successfully``); the scorers (``up.scorers`` replicas); one
service per generator and the evaluator, each joined to the network namespace of its
first vLLM server (``network_mode: service:…``) so it reaches its servers on loopback,
and started once they are healthy. Every role works in the named volume ``data`` at
/data. Each role reads its own Redis user from ``secrets/<role>.env`` (``env_file``: the
passwords are in no compose file and no argv). GPUs are handed out in order as
``device_ids`` (trainer, then servers and roles as they come), so no two services share
one unless they are replicas of one service. Every service has a memory limit
(``deploy.*_memory_gib``, `containers.memory_gib` when 0) and a CPU limit (its threads;
a vLLM server: its front ends and engine), and every sluice service a /dev/shm of
``deploy.shm_gib``; the trainer stops within ``deploy.trainer_grace_s`` (its final
checkpoint), the others within ``deploy.grace_s``. No service restarts: a role that
exits at the end of the run stays exited; the vLLM servers run until ``docker compose
down`` (which keeps the named volumes, the run's data; ``down -v`` deletes them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sluice.deploy.containers import (
    CONFIG,
    INIT_MODEL_SH,
    REDIS_ACL,
    REDIS_TLS_DIR,
    ROLE_ENV,
    ROLE_TLS_DIR,
    VLLM_CACHE,
    bus_settings,
    image_for,
    probe_argv,
    redis_argv,
    wait_trainer_argv,
)
from sluice.deploy.files import Rendered, dump_yaml
from sluice.deploy.plan import (
    DATA_DIR,
    Plan,
    Proc,
    Server,
    credentials_env,
    mem_mib,
    memory_gib,
    needs_s3,
    vllm_cpus,
)
from sluice.deploy.runconfig import run_config
from sluice.deploy.tls import ROLE_SECRET_DIR, SERVER_SECRET_DIR


class _Gpus:
    """Hands out host GPU indices in order."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> dict[str, Any]:
        if not n:
            return {}
        ids = [str(self.next + i) for i in range(n)]
        self.next += n
        return {"deploy": {"resources": {"reservations": {"devices": [
            {"driver": "nvidia", "device_ids": ids, "capabilities": ["gpu"]}]}}}}


PULL_POLICY = {"IfNotPresent": "missing", "Always": "always", "Never": "never"}
"""``deploy.image_pull_policy`` in compose's words."""
WAIT_MEMORY_GIB = 0.25


def _limits(plan: Plan, cpus: float, memory: float, shm: bool = True) -> dict[str, Any]:
    """A service's CPU and memory limits (``memory`` in GiB, never 0) and its /dev/shm
    (``deploy.shm_gib``; Docker's default is 64 MB)."""
    out: dict[str, Any] = {"cpus": cpus, "mem_limit": f"{mem_mib(memory)}m"}
    if shm:
        out["shm_size"] = f"{mem_mib(plan.cfg.deploy.shm_gib)}m"
    return out


def _base(plan: Plan, image: str, command: list[str], role: str = "", *, cpus: float,
          memory: float, grace_s: int = 0) -> dict[str, Any]:
    d = plan.cfg.deploy
    svc: dict[str, Any] = {
        "image": image, "pull_policy": PULL_POLICY[d.image_pull_policy],
        "command": command, "working_dir": DATA_DIR,
        "environment": dict(ROLE_ENV),
        "volumes": ["data:/data", f"./run.toml:{CONFIG}:ro",
                    *([f"./secrets/{ROLE_SECRET_DIR}:{ROLE_TLS_DIR}:ro"]
                      if plan.tls and plan.tls.role_files else [])],
        "stop_grace_period": f"{grace_s or d.grace_s}s",
        **_limits(plan, cpus, memory),
    }
    env_files: list[Any] = []
    if role and d.acl:
        env_files.append(f"secrets/{role}.env")
    if role and needs_s3(plan.cfg, role):
        # the object store's AWS_* variables, a file the user writes (the roles' start
        # checks name weights.store when it is missing or wrong): docs/deploying.md
        env_files.append({"path": "secrets/s3.env", "required": False})
    if env_files:
        svc["env_file"] = env_files
    return svc


def _server(plan: Plan, s: Server, gpus: _Gpus, after: dict[str, Any],
            netns: str | None) -> dict[str, Any]:
    svc = _base(plan, image_for(plan, int(s.gpu)), s.argv, cpus=vllm_cpus(s),
                memory=memory_gib(plan.cfg.deploy.vllm_memory_gib, "vllm"))
    svc["environment"].update(s.env(VLLM_CACHE))
    svc["healthcheck"] = {"test": ["CMD", *probe_argv(s)], "interval": "5s",
                          "timeout": "5s",
                          "retries": max(1, int(plan.cfg.generation.vllm.start_timeout_s / 5))}
    svc["depends_on"] = after
    if netns:
        svc["network_mode"] = f"service:{netns}"
    svc.update(gpus.take(int(s.gpu)))
    return svc


def _with_servers(plan: Plan, proc: Proc, name: str, argv: list[str], gpus: _Gpus,
                  services: dict[str, Any], after: dict[str, Any]) -> None:
    """``name`` and its vLLM servers: the first server owns the network namespace."""
    deps = dict(after)
    owner = None
    for j, s in enumerate(proc.servers):
        sname = f"vllm-{name}-{j}"
        services[sname] = _server(plan, s, gpus, after, owner)
        owner = owner or sname
        deps[sname] = {"condition": "service_healthy"}
    svc = _base(plan, image_for(plan, proc.gpus), argv, proc.role, cpus=proc.cpus,
                memory=memory_gib(proc.memory_gib, "role"))
    svc["depends_on"] = deps
    if owner:
        svc["network_mode"] = f"service:{owner}"
    svc.update(gpus.take(proc.gpus))
    services[name] = svc


def render(plan: Plan, data: Mapping[str, Any]) -> Rendered:
    cfg, d = plan.cfg, plan.cfg.deploy
    gpus = _Gpus()
    services: dict[str, Any] = {}
    trainer_after: dict[str, Any] = {}
    if plan.bundled:
        vols = ["redis-data:/data"]
        if d.acl:
            vols.append(f"./secrets/users.acl:{REDIS_ACL}:ro")
        if plan.tls and plan.tls.serves:
            vols.append(f"./secrets/{SERVER_SECRET_DIR}:{REDIS_TLS_DIR}:ro")
        services["redis"] = {"image": d.redis_image,
                             "pull_policy": PULL_POLICY[d.image_pull_policy],
                             "command": redis_argv(plan), "volumes": vols,
                             "stop_grace_period": f"{d.grace_s}s",
                             **_limits(plan, 1, memory_gib(d.redis_memory_gib, "redis"),
                                       shm=False)}
        trainer_after["redis"] = {"condition": "service_started"}
    if plan.builds_model:  # $$: compose's escape of a literal $
        services["prepare"] = _base(plan, d.image, [
            "sh", "-c", INIT_MODEL_SH.replace("$", "$$"), cfg.model.path], cpus=1,
            memory=memory_gib(d.role_memory_gib, "role"))
        trainer_after["prepare"] = {"condition": "service_completed_successfully"}
    t = plan.trainer
    trainer = _base(plan, image_for(plan, t.gpus), t.argv(CONFIG), "trainer", cpus=t.cpus,
                    memory=memory_gib(t.memory_gib, "trainer"), grace_s=d.trainer_grace_s)
    if trainer_after:
        trainer["depends_on"] = trainer_after
    trainer.update(gpus.take(t.gpus))
    services["trainer"] = trainer
    wait = _base(plan, d.image, wait_trainer_argv("evaluator"), "evaluator", cpus=1,
                 memory=WAIT_MEMORY_GIB)
    wait["depends_on"] = {"trainer": {"condition": "service_started"}}
    services["wait-trainer"] = wait
    after = {"wait-trainer": {"condition": "service_completed_successfully"}}
    s = plan.scorers
    scorers = _base(plan, image_for(plan, s.gpus), s.argv(CONFIG), "scorer", cpus=s.cpus,
                    memory=memory_gib(s.memory_gib, "role"))
    scorers["depends_on"] = after
    scorers["deploy"] = {"replicas": s.count}
    if s.gpus:  # every replica gets the same GPU(s)
        scorers["deploy"].update(gpus.take(s.gpus)["deploy"])
    services["scorer"] = scorers
    g = plan.generators
    for i in range(g.count):
        _with_servers(plan, g, f"generator-{i}",
                      [*g.argv(CONFIG), "--name", f"generator-{i}"], gpus, services, after)
    e = plan.evaluator
    _with_servers(plan, e, "evaluator", [*e.argv(CONFIG), "--name", "evaluator"], gpus,
                  services, after)
    if plan.archiver:  # one, under its fixed name: compose never scales it
        a = plan.archiver
        archiver = _base(plan, d.image, a.argv(CONFIG), "archiver", cpus=a.cpus,
                         memory=memory_gib(a.memory_gib, "role"))
        archiver["depends_on"] = after
        services["archiver"] = archiver
    project = {"name": plan.name, "services": services,
               "volumes": {"data": {}, **({"redis-data": {}} if plan.bundled else {})}}
    r = Rendered()
    r.add("compose.yaml", dump_yaml(project, header=[
        f"Run {plan.run!r} on one host: rendered by `sluice deploy render --target compose`",
        "(docs/deploying.md); re-render instead of editing.  docker compose up -d"]))
    r.add("run.toml", run_config(plan, data, bus_settings(plan, "redis")))
    if plan.tls:  # read by the containers' own users: the 0700 secrets/ keeps others out
        plan.tls.add_secrets(r, mode=0o644)
    if d.acl:
        for role in plan.credentials:
            r.secret(f"{role}.env", credentials_env(plan, role))
        if plan.bundled:  # password hashes only: readable by the container's redis user
            r.secret("users.acl", plan.acl_text, mode=0o644)
    return r
