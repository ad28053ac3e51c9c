"""What the two container targets, k8s and compose, share: where a role's container finds
the config and its caches, which image it runs, the environment every role starts with,
the bundled Redis's command, and the commands of the helpers around the roles (building
the model, waiting for the trainer, probing a vLLM server's /health).

Invariant: a container of either target sees the same paths (the shared volume at
`DATA_DIR`, its working directory; the config at `CONFIG`; the ACL file at `REDIS_ACL`),
so every command here is the same on both; only how each target wires volumes, secrets
and start order differs (`k8s`, `compose`).
"""

from __future__ import annotations

from sluice.deploy.plan import DATA_DIR, Plan, Server
from sluice.deploy.tls import check_names

CONFIG_DIR = "/etc/sluice"
CONFIG = f"{CONFIG_DIR}/run.toml"
"""The rendered ``run.toml``, mounted read-only into every container."""
HF_HOME = f"{DATA_DIR}/.cache/huggingface"
"""The Hugging Face cache on the shared volume, shared by every role."""
VLLM_CACHE = f"{DATA_DIR}/.cache/vllm"
"""The vLLM servers' cache root (``VLLM_CACHE_ROOT``) on the shared volume."""
REDIS_ACL_DIR = "/etc/redis"
REDIS_ACL = f"{REDIS_ACL_DIR}/users.acl"
"""Where the bundled Redis's container finds the users.acl of the render."""
ROLE_TLS_DIR = "/etc/sluice-tls"
"""Where every role's container finds the render's ``secrets/tls`` (CA, client
certificate): beside, not inside, the read-only config mount."""
REDIS_TLS_DIR = "/etc/redis-tls"
"""Where the bundled Redis's container finds ``secrets/redis-tls`` (its certificate and
key, and the CA)."""
ROLE_ENV = {"HF_HOME": HF_HOME, "PYTHONUNBUFFERED": "1"}
"""The variables every role's container starts with, in this order."""
INIT_MODEL_SH = '[ -d "$0" ] || exec sluice init-model "$0"'
"""``sh -c`` script that builds the model folder named by ``$0`` unless it exists."""
TRAINER_WAIT_S = 3600
"""How long the roles' wait for the trainer's first announcement may take."""
SHM = "/dev/shm"
"""Shared memory (NCCL's intra-node transport, vLLM's tensor-parallel workers): sized by
``deploy.shm_gib`` on both targets, far above the runtimes' 64 MB default."""
def image_for(plan: Plan, gpus: int) -> str:
    """The GPU image (``deploy.gpu_image``) for a process that asks for a GPU, the plain
    one (``deploy.image``) otherwise."""
    return plan.cfg.deploy.gpu_image if gpus else plan.cfg.deploy.image


def redis_argv(plan: Plan) -> list[str]:
    """The bundled Redis: AOF on the container's /data, and the ACL file's users when
    ``deploy.acl`` (else no password and protected mode off: the network, the NetworkPolicy
    on k8s, is all that keeps others out)."""
    d = plan.cfg.deploy
    port = ["--port", str(d.redis_port)]
    if plan.tls and plan.tls.serves:  # TLS only: no plaintext port
        port = plan.tls.server_args(REDIS_TLS_DIR, d.redis_port)
    argv = ["redis-server", *port, "--appendonly", "yes",
            "--appendfsync", "everysec", "--save", "", "--dir", "/data"]
    return argv + (["--aclfile", REDIS_ACL] if d.acl else ["--protected-mode", "no"])


def redis_url(plan: Plan, bundled_host: str) -> str:
    """``bus.redis_url`` of the rendered run.toml: the bundled Redis at ``bundled_host``
    (its Service or service name), or the external Redis's URL as given."""
    if plan.bundled:
        scheme = "rediss" if plan.tls else "redis"
        return f"{scheme}://{bundled_host}:{plan.cfg.deploy.redis_port}/0"
    return plan.cfg.bus.redis_url


def bus_settings(plan: Plan, bundled_host: str) -> dict[str, str]:
    """The ``bus.*`` keys of the rendered run.toml: the URL and, with TLS, the files at
    `ROLE_TLS_DIR`, where every role's container mounts ``secrets/tls``. The bundled
    Redis's certificate must name ``bundled_host`` (checked here, at render time)."""
    out = {"bus.redis_url": redis_url(plan, bundled_host)}
    if plan.tls:
        if plan.bundled:
            check_names(plan.tls, (bundled_host,), f"the {plan.target} target's name for "
                        "the bundled Redis")
        out.update(plan.tls.role_settings(ROLE_TLS_DIR))
    return out


def wait_trainer_argv(role: str) -> list[str]:
    """Wait, logged in as ``role``, until the trainer has announced (`sluice deploy
    wait`); the roles that read its versions start after it."""
    return ["sluice", "deploy", "wait", CONFIG, "--role", role, "--trainer",
            "--timeout", str(TRAINER_WAIT_S)]


def probe_argv(server: Server) -> list[str]:
    """A health check of ``server`` run inside its container: its /health on loopback
    within 2 s, with the server's own Python."""
    probe = f"import urllib.request; urllib.request.urlopen('{server.url}/health', timeout=2)"
    return [server.spec.python, "-c", probe]
