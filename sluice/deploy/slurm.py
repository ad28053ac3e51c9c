"""The slurm target: one sbatch script of a heterogeneous job, and its files.

Component 0 (``deploy.trainer_nodes`` nodes, ``deploy.partition``): Redis (AOF, the
rendered ACL file, TLS with ``deploy.redis_tls_dir``) on its first node, the trainer (one
process, or one torchrun per node with c10d rendezvous on the first node's address), and
the scorers and the evaluator when ``deploy.scorers_with`` / ``deploy.evaluator_with``
say "trainer". Component 1 (``deploy.generator_nodes`` nodes, ``deploy.gpu_partition``):
the generators, each with its vLLM servers on its own node (loopback URLs), and whatever
is placed "generators".

Every process is one ``srun`` step pinned to a node, with its log in
``<output_dir>/logs`` (appended to: each attempt of a requeued job adds a banner and its
lines), but Redis: a child of the script itself on the head node, so that the steps can
be stopped (``scancel --signal=TERM``: srun answers its own SIGTERM by killing its step
at once, before a trainer could checkpoint) while Redis serves until the trainer is done.

A step without a GPU runs ``--overlap`` (the component's CPUs and memory are
sized to the sum of its processes, which then share them); a step with GPUs never does,
because ``--overlap`` shares GRES too: it asks for ``--exact --gpus=N`` and its own
``--mem``, so Slurm gives every GPU step devices no other step holds. Every node of a
component is asked for the same GPUs (``--gpus-per-node``), so a layout whose nodes would
need different counts is refused (`gpus_per_node`), never padded with idle GPUs.

The script starts Redis, the trainer, waits for the trainer's first announcement, starts
vLLM servers and waits for their /health, then the other roles; when the trainer ends the
run it gives the others ``deploy.grace_s`` to exit (they stop on the trainer's
RunFinished), stops the servers, runs `sluice audit` against the live Redis as its last
step, stops Redis, and exits non-zero if the trainer or the audit failed. A SIGTERM to the
script (``--signal`` before the time limit, ``scancel --batch``) stops the roles, lets the
trainer write its checkpoint, stops Redis last, and requeues the job (``deploy.requeue``):
the next attempt resumes.

Redis's address: the head node as Slurm names it (``NodeAddr``) is what every role
connects to, and Redis binds the address the *generator* nodes resolve that name to (and
the one the head node itself does, when it differs: Debian maps a host's own name to
127.0.1.1), so a node's own-name alias never leaves Redis on loopback; a name the other
nodes resolve to loopback stops the job with a message before anything starts.

The script's text is the Jinja2 template ``templates/sluice.sbatch.j2`` (package data);
this module lays the processes out (`layout`), sizes the components and quotes every
value the template receives, so the template itself never quotes or computes.
"""

from __future__ import annotations

import dataclasses
import functools
import shlex
from collections.abc import Mapping
from importlib import resources
from typing import Any

import jinja2

from pipeline.config import ConfigError
from pipeline.config.generation import VLLMConfig
from sluice.deploy.files import Rendered
from sluice.deploy.plan import (
    ARCHIVER_NAME,
    Plan,
    Proc,
    Server,
    credentials_toml,
    mem_mib,
    memory_gib,
    vllm_cpus,
)
from sluice.deploy.runconfig import run_config
from sluice.deploy.tls import ROLE_SECRET_DIR, SERVER_SECRET_DIR

SCRIPT = "sluice.sbatch"
TEMPLATE = "sluice.sbatch.j2"  # under templates/, beside this module
TRAINER, GENERATORS = 0, 1  # het components
COMPONENT_NAMES = {TRAINER: "trainer's", GENERATORS: "generators'"}


@dataclasses.dataclass
class Step:
    """One process of the job: where it runs and what it needs (``memory_gib``: its
    share of its node, given to it as ``--mem`` when it holds GPUs)."""

    group: int
    node: int  # index in its component's node list
    name: str
    role: str  # Redis identity ("-": none)
    argv: list[str]
    cpus: int = 1
    gpus: int = 0
    memory_gib: float = 0.0
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    health: str = ""  # a vLLM server's /health URL

    @property
    def node_ref(self) -> str:
        """Its node as the script names it: ``"${TRAINER_NODES[i]}"`` or
        ``"${GENERATOR_NODES[i]}"``."""
        nodes = "TRAINER" if self.group == TRAINER else "GENERATOR"
        return f'"${{{nodes}_NODES[{self.node}]}}"'

    @property
    def srun_opts(self) -> str:
        """Its srun resource options (`step_opts`)."""
        return step_opts(self.cpus, self.gpus, self.memory_gib)

    @property
    def command(self) -> str:
        """Its command line as shell words: ``env VAR=…`` first when it has variables
        (``$``-words kept as expansions, in double quotes), then ``argv`` (`q`)."""
        env = [f"{k}={v}" if v.startswith("$") else f"{k}={shlex.quote(v)}"
               for k, v in sorted(self.env.items())]
        env_words = ["env", *[f'"{e}"' if "$" in e else e for e in env]] if env else []
        return " ".join([*env_words, *map(q, self.argv)])


def step_opts(cpus: int, gpus: int, memory_gib: float, per_node: bool = False) -> str:
    """srun's resource options of a step (module docstring): CPUs only and
    ``--overlap``; or, holding GPUs, ``--exact`` with its GPUs (``--gpus-per-node`` for a
    step over several nodes) and its memory, never ``--overlap`` (which shares GRES:
    two steps on one GPU)."""
    opts = [f"--cpus-per-task={cpus}"]
    if not gpus:
        return " ".join(["--overlap", *opts])
    return " ".join(["--exact", *opts, f"--gpus{'-per-node' if per_node else ''}={gpus}",
                     f"--mem={mem_mib(memory_gib)}"])


def q(word: str) -> str:
    """A word of the script: ``$NAME``-prefixed words are kept as shell expansions."""
    if word.startswith('"$') or word.startswith("$"):
        return word
    return shlex.quote(word)


def dq(word: str) -> str:
    """A word built on one of the script's variables (``$SECRETS/…``), in double quotes:
    expanded, never split. Only for words made here, never a user's value (a ``$`` in
    one stays literal: `q`)."""
    return f'"{word}"'


def layout(plan: Plan) -> list[Step]:
    """Every process but Redis, in start order: trainer, servers, scorers, generators,
    evaluator (module docstring), each on a node of its component. A vLLM server runs the
    script's ``$VLLM_PY`` (``generation.vllm.python`` unless ``SLUICE_VLLM_PYTHON`` says
    otherwise at submit time)."""
    d = plan.cfg.deploy
    gnodes = d.generator_nodes
    steps: list[Step] = []
    ports: dict[tuple[int, int], int] = {}  # (group, node) -> next free vLLM port

    def servers(proc: Proc, group: int, node: int, owner: str) -> list[Server]:
        out = []
        for j, s in enumerate(proc.servers):
            port = ports.get((group, node), d.vllm_port)
            ports[(group, node)] = port + 1
            s = dataclasses.replace(s, port=port)
            steps.append(Step(group, node, f"vllm-{owner}-{j}", "-",
                              ['"$VLLM_PY"', *s.argv[1:]], vllm_cpus(s), int(s.gpu),
                              memory_gib(d.vllm_memory_gib, "vllm"),
                              s.env("$RUN_DIR/vllm-cache"), s.url + "/health"))
            out.append(s)
        return out

    def role(proc: Proc, group: int, node: int, name: str) -> None:
        mine = servers(proc, group, node, name)
        argv = dataclasses.replace(proc, servers=tuple(mine)).argv('"$CONFIG"', '"$SLUICE"')
        steps.append(Step(group, node, name, proc.role,
                          [*argv, '"${BUS[@]}"', "--name", name],
                          proc.cpus, proc.gpus, memory_gib(proc.memory_gib, "role")))

    for i in range(plan.scorers.count):
        g = TRAINER if d.scorers_with == "trainer" else GENERATORS
        role(plan.scorers, g, 0 if g == TRAINER else i % gnodes, f"scorer-{i}")
    for i in range(plan.generators.count):
        role(plan.generators, GENERATORS, i % gnodes, f"generator-{i}")
    g = TRAINER if d.evaluator_with == "trainer" else GENERATORS
    role(plan.evaluator, g, 0, "evaluator")
    if plan.archiver:  # beside Redis: it reads every scored group once more
        role(plan.archiver, TRAINER, 0, ARCHIVER_NAME)
    return steps


def _per_node(plan: Plan, steps: list[Step], group: int,
              nodes: int) -> dict[int, list[float]]:
    """[cpus, gpus, memory GiB] on each node of a component: the sum of its steps (the
    trainer's on every node of its component, Redis on the first)."""
    per: dict[int, list[float]] = {n: [0, 0, 0.0] for n in range(nodes)}
    if group == TRAINER:
        t = plan.trainer
        for n in range(nodes):
            per[n] = [t.cpus, t.gpus, memory_gib(t.memory_gib, "trainer")]
        if plan.bundled:
            per[0][0] += 1
            per[0][2] += memory_gib(plan.cfg.deploy.redis_memory_gib, "redis")
    for s in steps:
        if s.group == group:
            per[s.node][0] += s.cpus
            per[s.node][1] += s.gpus
            per[s.node][2] += s.memory_gib
    return per


def gpus_per_node(group: int, per: dict[int, list[float]]) -> int:
    """The component's ``--gpus-per-node``: the count every one of its nodes needs, or a
    `ConfigError` when they differ (Slurm would give each node the most, leaving GPUs
    idle: the evaluator's GPU asked for on every trainer node)."""
    counts = [int(v[1]) for _, v in sorted(per.items())]
    if len(set(counts)) > 1:
        raise ConfigError(
            f"deploy.evaluator_with: the {COMPONENT_NAMES[group]} nodes would need "
            f"{counts} GPUs, and Slurm asks every node of a component for the same count "
            "(the most), leaving GPUs idle; place the evaluator (and whatever else uses a "
            "GPU) so each node of a component needs as many as the others: the other "
            "component, a component of one node (deploy.trainer_nodes / "
            "deploy.generator_nodes), or generators and servers spread evenly")
    return counts[0]


def _components(plan: Plan, steps: list[Step]) -> list[dict[str, Any]]:
    """The ``#SBATCH`` resources of the two het components, trainer's first."""
    d = plan.cfg.deploy
    out = []
    for group, nodes, part in ((TRAINER, d.trainer_nodes, d.partition),
                               (GENERATORS, d.generator_nodes, d.gpu_partition or d.partition)):
        per = _per_node(plan, steps, group, nodes)
        cpus = max(int(v[0]) for v in per.values())
        mem_gib = max(v[2] for v in per.values())
        out.append({"nodes": nodes, "cpus": max(cpus, 1), "gpus": gpus_per_node(group, per),
                    "partition": part, "mem_mib": mem_mib(mem_gib) if mem_gib else 0})
    return out


def _torchrun(plan: Plan) -> dict[str, Any] | None:
    """torchrun's launch over the trainer's nodes; None for a single trainer process."""
    d, t = plan.cfg.deploy, plan.trainer
    if plan.ranks_per_node * d.trainer_nodes <= 1:
        return None
    return {"nodes": d.trainer_nodes, "ranks_per_node": plan.ranks_per_node,
            "rendezvous_port": d.rendezvous_port, "max_restarts": plan.cfg.up.trainer_restarts,
            "srun_opts": step_opts(t.cpus, t.gpus, memory_gib(t.memory_gib, "trainer"),
                                   per_node=True)}


@functools.cache
def _template() -> jinja2.Template:
    """The script's template (package data). No autoescape: it renders bash, and every
    value reaching it is quoted here (`q`, `shlex.quote`) or needs no quoting (names
    checked by the config, numbers, loopback URLs)."""
    text = (resources.files("sluice.deploy") / "templates" / TEMPLATE).read_text()
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, autoescape=False)
    return env.from_string(text)


def _tls(plan: Plan) -> dict[str, Any] | None:
    """The bundled Redis's TLS flags and the roles' ``bus.tls_*`` settings, at the
    render's ``secrets/`` folders (the script's ``$SECRETS``), as shell words; None
    without TLS. An external rediss:// Redis gets the settings only."""
    if plan.tls is None:
        return None
    roles = plan.tls.role_settings(f"$SECRETS/{ROLE_SECRET_DIR}")
    server = f"$SECRETS/{SERVER_SECRET_DIR}"
    args = [dq(w) if "$" in w else q(w) for w in plan.tls.server_args(server, "$REDIS_PORT")]
    return {"serves": plan.tls.serves, "cert": dq(f"{server}/redis.crt"),
            "server_args": " ".join(args),
            "bus": " ".join(f"--set {dq(f'{k}={v}')}" for k, v in sorted(roles.items()))}


def _vllm_python(plan: Plan) -> str:
    """The vLLM servers' python unless ``SLUICE_VLLM_PYTHON`` names one: beside the sluice
    virtualenv (``$SLUICE_VENV``'s folder, where `deploy/setup.sh --vllm` puts
    ``.venv-vllm``) while ``generation.vllm.python`` is its default, else that key."""
    python = plan.cfg.generation.vllm.python
    if python == VLLMConfig.model_fields["python"].default:
        return f'$(dirname "$SLUICE_VENV")/{python}'
    return shlex.quote(python)


def script(plan: Plan) -> str:
    """The sbatch script of ``plan`` (the module docstring says what it runs)."""
    cfg, d = plan.cfg, plan.cfg.deploy
    steps = layout(plan)
    start_timeout_s = int(cfg.generation.vllm.start_timeout_s)
    t = plan.trainer
    return _template().render(
        run_repr=repr(plan.run), script=SCRIPT, job=plan.name,
        time_limit_min=d.time_limit_min, components=_components(plan, steps),
        exclusive=d.exclusive, requeue=d.requeue, stop_s=d.trainer_grace_s + d.grace_s,
        run_dir=shlex.quote(cfg.run.output_dir), bundled=plan.bundled,
        redis_port=d.redis_port, redis_url=shlex.quote(cfg.bus.redis_url), acl=d.acl,
        tls=_tls(plan), vllm_python=_vllm_python(plan),
        init_model=q(cfg.model.path) if plan.builds_model else "",
        trainer=t, torchrun=_torchrun(plan),
        trainer_opts=step_opts(t.cpus, t.gpus, memory_gib(t.memory_gib, "trainer")),
        trainer_timeout_s=start_timeout_s + 600, server_timeout_s=start_timeout_s,
        servers=[s for s in steps if s.health], roles=[s for s in steps if not s.health],
        grace_s=d.grace_s, trainer_grace_s=d.trainer_grace_s)


def render(plan: Plan, data: Mapping[str, Any]) -> Rendered:
    """The script, run.toml (no ``bus.redis_url``: the script passes it to every role),
    with ``deploy.acl`` each role's credentials file and the bundled Redis's users.acl,
    and with TLS its files (`sluice.deploy.tls`: ``secrets/tls/``, ``secrets/redis-tls/``)."""
    r = Rendered()
    r.add(SCRIPT, script(plan), 0o755)
    r.add("run.toml", run_config(plan, data, {"bus.redis_url": None}))
    if plan.cfg.deploy.acl:
        for role in plan.credentials:
            r.secret(f"{role}.toml", credentials_toml(plan, role))
        if plan.bundled:
            r.secret("users.acl", plan.acl_text)
    if plan.tls is not None:
        plan.tls.add_secrets(r)
    return r
