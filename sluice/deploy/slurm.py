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
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Mapping
from typing import Any

from pipeline.hub import is_hub_id
from sluice.deploy.files import Rendered
from sluice.deploy.plan import (
    ARCHIVER_NAME,
    Plan,
    Proc,
    Server,
    credentials_toml,
    slurm_mem_mb,
)
from sluice.deploy.runconfig import run_config

SCRIPT = "sluice.sbatch"
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


def _sbatch(plan: Plan, steps: list[Step]) -> list[str]:
    d = plan.cfg.deploy
    lines = [f"#SBATCH --job-name={plan.name}", f"#SBATCH --output={plan.name}-%j.out"]
    if d.time_limit_min:
        lines.append(f"#SBATCH --time={d.time_limit_min}")
    for group, nodes, part in ((TRAINER, d.trainer_nodes, d.partition),
                               (GENERATORS, d.generator_nodes, d.gpu_partition or d.partition)):
        cpus, gpus, mem = _sizes(plan, steps, group, nodes)
        if group:
            lines.append("#SBATCH hetjob")
        lines.append(f"#SBATCH --nodes={nodes} --ntasks-per-node=1 --cpus-per-task={cpus}")
        if part:
            lines.append(f"#SBATCH --partition={part}")
        if gpus:
            lines.append(f"#SBATCH --gpus-per-node={gpus}")
        if mem:
            lines.append(f"#SBATCH --mem={slurm_mem_mb(mem)}")
    return lines


def _step_fn(acl: bool) -> list[str]:
    cred = ('  [ "$role" = - ] || export SLUICE_REDIS_CREDENTIALS_FILE="$SECRETS/$role.toml"'
            if acl else "  :")
    return [
        "# step GROUP NODE NAME ROLE [srun options] -- COMMAND...: one process as one srun",
        "# step in the background, pinned to a node, logged to $LOGS/NAME.log, logged in to",
        "# Redis as ROLE (its own credentials file; - for none)",
        "step() {",
        '  local group=$1 node=$2 name=$3 role=$4; shift 4',
        "  local opts=()",
        '  while [ "$1" != -- ]; do opts+=("$1"); shift; done; shift',
        "  (",
        cred,
        '  exec srun --het-group="$group" --nodelist="$node" --nodes=1 --ntasks=1 --overlap \\',
        '    --kill-on-bad-exit=0 --output="$LOGS/$name.log" "${opts[@]}" "$@"',
        "  ) &",
        "}",
        "as_monitor() {",
        ('  SLUICE_REDIS_CREDENTIALS_FILE="$SECRETS/monitor.toml" "$@"' if acl else '  "$@"'),
        "}",
    ]


def _node(s: Step) -> str:
    return f'"${{{"TRAINER" if s.group == TRAINER else "GENERATOR"}_NODES[{s.node}]}}"'


def _launch(s: Step, var: str) -> list[str]:
    opts = [f"--cpus-per-task={s.cpus}"] + ([f"--gpus={s.gpus}"] if s.gpus else [])
    env = [f"{k}={v}" if v.startswith("$") else f"{k}={shlex.quote(v)}"
           for k, v in sorted(s.env.items())]
    env_words = ["env", *[f'"{e}"' if "$" in e else e for e in env]] if env else []
    words = [*env_words, *map(q, s.argv)]
    return [f"step {s.group} {_node(s)} {s.name} {s.role} {' '.join(opts)} -- \\",
            f"  {' '.join(words)}", f"{var}+=($!)"]


def script(plan: Plan) -> str:
    cfg, d = plan.cfg, plan.cfg.deploy
    steps = layout(plan)
    t = plan.trainer
    out = ["#!/bin/bash",
           f"# Run {plan.run!r} on Slurm: rendered by `sluice deploy render --target slurm`",
           "# (docs/deploying.md). Submit from the directory the config's relative paths",
           f"# start at:  sbatch DIR/{SCRIPT}   (SLUICE_VENV: the sluice virtualenv, default",
           "# ./.venv; SLUICE_DEPLOY_DIR: this folder, found from the job by default).",
           *_sbatch(plan, steps),
           "set -uo pipefail",
           'here=$(scontrol show job "$SLURM_JOB_ID" | sed -n "s/^ *Command=//p" | head -n 1)',
           'DEPLOY_DIR=${SLUICE_DEPLOY_DIR:-$(cd "$(dirname "$here")" && pwd)}',
           'CONFIG="$DEPLOY_DIR/run.toml"', 'SECRETS="$DEPLOY_DIR/secrets"',
           'SLUICE_VENV=${SLUICE_VENV:-$PWD/.venv}', 'SLUICE="$SLUICE_VENV/bin/sluice"',
           'PY="$SLUICE_VENV/bin/python"',
           f"RUN_DIR={shlex.quote(cfg.run.output_dir)}", 'LOGS="$RUN_DIR/logs"',
           'mkdir -p "$LOGS" "$RUN_DIR/redis"',
           'mapfile -t TRAINER_NODES < <(scontrol show hostnames '
           '"$SLURM_JOB_NODELIST_HET_GROUP_0")',
           'mapfile -t GENERATOR_NODES < <(scontrol show hostnames '
           '"$SLURM_JOB_NODELIST_HET_GROUP_1")',
           "# the first trainer node's address as Slurm knows it (NodeAddr)",
           'HEAD_ADDR=$(scontrol show node "${TRAINER_NODES[0]}" | grep -o "NodeAddr=[^ ]*" '
           '| head -n 1 | cut -d= -f2)']
    if plan.bundled:
        out.append(f'REDIS_URL="redis://$HEAD_ADDR:{d.redis_port}/0"')
    else:
        out.append(f"REDIS_URL={shlex.quote(cfg.bus.redis_url)}")
    out += ['BUS=(--set "bus.redis_url=$REDIS_URL")', "ROLES=() SERVERS=()",
            *_step_fn(d.acl),
            'fail() { echo "sluice: $*" >&2; tail -n 30 "$LOGS"/*.log >&2; exit 1; }']
    model = cfg.model.path
    if cfg.model.init and not is_hub_id(model):
        out += [f"[ -d {q(model)} ] || \"$SLUICE\" init-model {q(model)} "
                "|| fail \"cannot build the model\""]
    if plan.bundled:
        acl = ['--aclfile "$SECRETS/users.acl"'] if d.acl else []
        out += ['REDIS_DIR=$(cd "$RUN_DIR/redis" && pwd)',
                "step 0 \"${TRAINER_NODES[0]}\" redis - --cpus-per-task=1 -- \\",
                f"  redis-server --port {d.redis_port} --bind \"$HEAD_ADDR\" "
                '--dir "$REDIS_DIR" --pidfile "$REDIS_DIR/redis.pid" --appendonly yes '
                f"--appendfsync everysec --save '' {' '.join(acl)}".rstrip(),
                "REDIS_PID=$!"]
    out += ['as_monitor "$SLUICE" deploy wait "$CONFIG" "${BUS[@]}" --role monitor --redis '
            '--timeout 120 || fail "Redis did not answer"']
    if plan.ranks_per_node * d.trainer_nodes > 1:
        gpu = [f"--gpus-per-node={t.gpus}"] if t.gpus else []
        cred = (['SLUICE_REDIS_CREDENTIALS_FILE="$SECRETS/trainer.toml"'] if d.acl else [])
        out += [f"{' '.join(cred)} srun --het-group=0 --nodes={d.trainer_nodes} "
                f"--ntasks-per-node=1 --overlap --cpus-per-task={t.cpus} {' '.join(gpu)} \\"
                .replace("  ", " ").lstrip(),
                '  --kill-on-bad-exit=1 --output="$LOGS/trainer-%t.log" \\',
                f'  "$PY" -m torch.distributed.run --nnodes={d.trainer_nodes} '
                f"--nproc-per-node={plan.ranks_per_node} \\",
                f'  --rdzv-backend=c10d --rdzv-endpoint="$HEAD_ADDR:{d.rendezvous_port}" '
                f'--rdzv-id="$SLURM_JOB_ID" --max-restarts={cfg.up.trainer_restarts} \\',
                '  -m sluice.cli train "$CONFIG" "${BUS[@]}" &']
    else:
        opts = [f"--cpus-per-task={t.cpus}"] + ([f"--gpus={t.gpus}"] if t.gpus else [])
        out += [f"step 0 \"${{TRAINER_NODES[0]}}\" trainer-0 trainer {' '.join(opts)} -- \\",
                '  "$SLUICE" train "$CONFIG" "${BUS[@]}"']
    out += ["TRAINER_PID=$!",
            'as_monitor "$SLUICE" deploy wait "$CONFIG" "${BUS[@]}" --role monitor --trainer '
            f'--timeout {int(cfg.generation.vllm.start_timeout_s) + 600} '
            '|| fail "the trainer did not start"']
    servers = [s for s in steps if s.health]
    for s in servers:
        out += _launch(s, "SERVERS")
    for s in servers:  # loopback only: the check runs on the server's node
        out += [f"srun --het-group={s.group} --nodelist={_node(s)} --nodes=1 --ntasks=1 "
                "--overlap \\",
                f'  "$SLUICE" deploy wait "$CONFIG" --http {s.health} '
                f"--timeout {int(cfg.generation.vllm.start_timeout_s)} "
                f'|| fail "vLLM server {s.name} did not start"']
    for s in steps:
        if not s.health:
            out += _launch(s, "ROLES")
    out += [
        'wait "$TRAINER_PID"; TRAINER_RC=$?',
        'echo "sluice: the trainer exited with $TRAINER_RC"',
        "# the other roles stop on the trainer's RunFinished; then they are stopped",
        f"deadline=$((SECONDS + {d.grace_s}))",
        'for p in "${ROLES[@]}"; do',
        '  while kill -0 "$p" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 1; done',
        "done",
        'for p in "${ROLES[@]}" "${SERVERS[@]}"; do kill -TERM "$p" 2>/dev/null; done',
        'for p in "${ROLES[@]}" "${SERVERS[@]}"; do wait "$p"; done',
        'as_monitor "$SLUICE" audit "$RUN_DIR" --config "$CONFIG" "${BUS[@]}"; AUDIT_RC=$?',
    ]
    if plan.bundled:
        out += ["# SIGTERM to Redis itself (this script runs on its node): it writes its AOF",
                'kill -TERM "$(cat "$REDIS_DIR/redis.pid")"; wait "$REDIS_PID"']
    out += ['[ "$TRAINER_RC" -ne 0 ] && exit "$TRAINER_RC"', 'exit "$AUDIT_RC"']
    return "\n".join(out) + "\n"


def render(plan: Plan, data: Mapping[str, Any]) -> Rendered:
    r = Rendered()
    r.add(SCRIPT, script(plan), 0o755)
    r.add("run.toml", run_config(plan, data, {"bus.redis_url": None}))
    if plan.cfg.deploy.acl:
        for role in plan.credentials:
            r.secret(f"{role}.toml", credentials_toml(plan, role))
        if plan.bundled:
            r.secret("users.acl", plan.acl_text)
    return r
