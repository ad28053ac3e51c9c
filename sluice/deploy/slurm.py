"""The slurm target: one sbatch script of a heterogeneous job, and its files.

Component 0 (``deploy.trainer_nodes`` nodes, ``deploy.partition``): Redis (AOF, the
rendered ACL file) on its first node, the trainer (one process, or one torchrun per node
with c10d rendezvous on the first node's address), and the scorers and the evaluator
when ``deploy.scorers_with`` / ``deploy.evaluator_with`` say "trainer". Component 1
(``deploy.generator_nodes`` nodes, ``deploy.gpu_partition``): the generators, each with
its vLLM servers on its own node (loopback URLs), and whatever is placed "generators".

Every process is one ``srun`` step pinned to a node (``--overlap``: the component's
CPUs are sized to the sum of its processes, which then share them), with its log in
``<output_dir>/logs``. The script starts Redis, the trainer, waits for the trainer's
first announcement, starts vLLM servers and waits for their /health, then the other
roles; when the trainer ends the run it gives the others ``deploy.grace_s`` to exit (they
stop on the trainer's RunFinished), stops the servers, runs `sluice audit` against the
live Redis as its last step, stops Redis, and exits non-zero if the trainer or the audit
failed. GPU requests are per step (``--gpus``); Slurm (or its cgroups) decides which GPU
a step sees.

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

from sluice.deploy.files import Rendered
from sluice.deploy.plan import (
    ARCHIVER_NAME,
    Plan,
    Proc,
    Server,
    credentials_toml,
    mem_mib,
)
from sluice.deploy.runconfig import run_config

SCRIPT = "sluice.sbatch"
TEMPLATE = "sluice.sbatch.j2"  # under templates/, beside this module
TRAINER, GENERATORS = 0, 1  # het components


@dataclasses.dataclass
class Step:
    """One process of the job: where it runs and what it needs."""

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
        """Its srun resource options (the step's share of its component)."""
        return " ".join([f"--cpus-per-task={self.cpus}",
                         *([f"--gpus={self.gpus}"] if self.gpus else [])])

    @property
    def command(self) -> str:
        """Its command line as shell words: ``env VAR=…`` first when it has variables
        (``$``-words kept as expansions, in double quotes), then ``argv`` (`q`)."""
        env = [f"{k}={v}" if v.startswith("$") else f"{k}={shlex.quote(v)}"
               for k, v in sorted(self.env.items())]
        env_words = ["env", *[f'"{e}"' if "$" in e else e for e in env]] if env else []
        return " ".join([*env_words, *map(q, self.argv)])


def q(word: str) -> str:
    """A word of the script: ``$NAME``-prefixed words are kept as shell expansions."""
    if word.startswith('"$') or word.startswith("$"):
        return word
    return shlex.quote(word)


def layout(plan: Plan) -> list[Step]:
    """Every process but Redis, in start order: trainer, servers, scorers, generators,
    evaluator (module docstring), each on a node of its component."""
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
            steps.append(Step(group, node, f"vllm-{owner}-{j}", "-", s.argv, 1, int(s.gpu),
                              d.vllm_memory_gib, s.env("$RUN_DIR/vllm-cache"),
                              s.url + "/health"))
            out.append(s)
        return out

    def role(proc: Proc, group: int, node: int, name: str) -> None:
        mine = servers(proc, group, node, name)
        argv = dataclasses.replace(proc, servers=tuple(mine)).argv('"$CONFIG"', '"$SLUICE"')
        steps.append(Step(group, node, name, proc.role,
                          [*argv, '"${BUS[@]}"', "--name", name],
                          proc.cpus, proc.gpus, proc.memory_gib))

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


def _sizes(plan: Plan, steps: list[Step], group: int, nodes: int) -> tuple[int, int, float]:
    """(cpus, gpus, memory GiB) per node of a component: its busiest node's sum."""
    per: dict[int, list[float]] = {n: [0, 0, 0.0] for n in range(nodes)}
    if group == TRAINER:
        t = plan.trainer
        for n in range(nodes):
            per[n] = [t.cpus, t.gpus, t.memory_gib]
    for s in steps:
        if s.group == group:
            per[s.node][0] += s.cpus
            per[s.node][1] += s.gpus
            per[s.node][2] += s.memory_gib
    cpus = max(int(v[0]) for v in per.values())
    gpus = max(int(v[1]) for v in per.values())
    mem = max(v[2] for v in per.values())
    if group == TRAINER and plan.bundled:
        mem += plan.cfg.deploy.redis_memory_gib
    return max(cpus, 1), gpus, mem


def _components(plan: Plan, steps: list[Step]) -> list[dict[str, Any]]:
    """The ``#SBATCH`` resources of the two het components, trainer's first."""
    d = plan.cfg.deploy
    out = []
    for group, nodes, part in ((TRAINER, d.trainer_nodes, d.partition),
                               (GENERATORS, d.generator_nodes, d.gpu_partition or d.partition)):
        cpus, gpus, mem_gib = _sizes(plan, steps, group, nodes)
        out.append({"nodes": nodes, "cpus": cpus, "gpus": gpus, "partition": part,
                    "mem_mib": mem_mib(mem_gib) if mem_gib else 0})
    return out


def _torchrun(plan: Plan) -> dict[str, int] | None:
    """torchrun's launch over the trainer's nodes; None for a single trainer process."""
    d = plan.cfg.deploy
    if plan.ranks_per_node * d.trainer_nodes <= 1:
        return None
    return {"nodes": d.trainer_nodes, "ranks_per_node": plan.ranks_per_node,
            "rendezvous_port": d.rendezvous_port, "max_restarts": plan.cfg.up.trainer_restarts}


@functools.cache
def _template() -> jinja2.Template:
    """The script's template (package data). No autoescape: it renders bash, and every
    value reaching it is quoted here (`q`, `shlex.quote`) or needs no quoting (names
    checked by the config, numbers, loopback URLs)."""
    text = (resources.files("sluice.deploy") / "templates" / TEMPLATE).read_text()
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, autoescape=False)
    return env.from_string(text)


def script(plan: Plan) -> str:
    """The sbatch script of ``plan`` (the module docstring says what it runs)."""
    cfg, d = plan.cfg, plan.cfg.deploy
    steps = layout(plan)
    start_timeout_s = int(cfg.generation.vllm.start_timeout_s)
    return _template().render(
        run_repr=repr(plan.run), script=SCRIPT, job=plan.name,
        time_limit_min=d.time_limit_min, components=_components(plan, steps),
        run_dir=shlex.quote(cfg.run.output_dir), bundled=plan.bundled,
        redis_port=d.redis_port, redis_url=shlex.quote(cfg.bus.redis_url), acl=d.acl,
        init_model=q(cfg.model.path) if plan.builds_model else "",
        trainer=plan.trainer, torchrun=_torchrun(plan),
        trainer_timeout_s=start_timeout_s + 600, server_timeout_s=start_timeout_s,
        servers=[s for s in steps if s.health], roles=[s for s in steps if not s.health],
        grace_s=d.grace_s)


def render(plan: Plan, data: Mapping[str, Any]) -> Rendered:
    """The script, run.toml (no ``bus.redis_url``: the script passes it to every role),
    and with ``deploy.acl`` each role's credentials file and the bundled Redis's users.acl."""
    r = Rendered()
    r.add(SCRIPT, script(plan), 0o755)
    r.add("run.toml", run_config(plan, data, {"bus.redis_url": None}))
    if plan.cfg.deploy.acl:
        for role in plan.credentials:
            r.secret(f"{role}.toml", credentials_toml(plan, role))
        if plan.bundled:
            r.secret("users.acl", plan.acl_text)
    return r
