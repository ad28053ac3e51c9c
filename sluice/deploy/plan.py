"""The deployment of one run, computed once from its config: every target renders this.

A `Plan` holds what a deployment is made of, whatever it runs on: the role processes and
how many of each (``up.trainer_ranks`` over ``deploy.trainer_nodes``, ``up.generators``,
``up.scorers``, one evaluator), what each runs (`Proc.argv`: ``sluice <role> CONFIG``),
its CPUs, GPUs and memory, the vLLM servers beside it (`ServerSpec`, the same flags
`sluice up` launches with), the Redis user it logs in as and that user's credentials, and
the stream and consumer group the scorers consume in each lane (what an autoscaler must
watch). Every check a target cannot pass raises `ConfigError` naming the key, before
anything is rendered or written.

Invariants: counts, GPUs, users and stream names are derived here only, and a target
never re-derives one; ``trainer_ranks == ranks_per_node * deploy.trainer_nodes``; each
generator has ``generation.vllm.launch / up.generators`` servers; the scorers' `streams`
are ``pipeline.bus.lanes.Lanes(Keys(run), bus.partitions).streams("rollouts")`` with the
group ``pipeline.bus.keys.SCORERS_GROUP``, exactly what `workers.scorer` reads
(tests/deploy/test_keda_scorer.py runs a scorer to check it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

from pipeline.bus.keys import SCORERS_GROUP, Keys
from pipeline.bus.lanes import Lanes
from pipeline.bus.security import (
    Credentials,
    CredentialsError,
    credentials_path,
    load_credentials_file,
)
from pipeline.config import Config, ConfigError
from pipeline.hub import is_hub_id
from sluice.acl import username
from sluice.deploy.tls import DeployTLS, deploy_tls
from sluice.vllm_launch import ServerSpec
from sluice.vllm_placement import launches_eval_server

TARGETS = ("slurm", "k8s", "compose")

ROLE_COMMANDS = {"trainer": "train", "generator": "generate", "scorer": "score",
                 "evaluator": "eval", "archiver": "archive"}
"""Each role's `sluice` subcommand (its Redis identity is the role itself)."""

DEPLOY_ROLES = ("trainer", "generator", "scorer", "evaluator", "monitor")
"""The Redis users every deployment needs: the four roles, and `monitor` (the Slurm job's
waits and audit, KEDA's lag reads); `deploy_roles` adds the archiver's when it runs."""

ARCHIVER_NAME = "archiver-0"
"""The archiver's consumer name, the same across restarts (`sluice up` uses it too): a
restarted archiver must read its own pending entries and recognise its newest file
(docs/archive.md), so a deployment runs exactly one, under this name, never two at once."""


def needs_s3(cfg: Config, role: str) -> bool:
    """Whether ``role`` reads or writes an object store: the weight roles when
    ``weights.store`` is one, the archiver when ``archive.path`` is (its AWS_*
    variables come from a secret the user writes: docs/deploying.md)."""
    if role in ("trainer", "generator", "evaluator"):
        return cfg.weights.store.startswith("s3://")
    return role == "archiver" and cfg.archive.path.startswith("s3://")


def deploy_roles(cfg: Config) -> tuple[str, ...]:
    """The Redis users ``cfg``'s deployment logs in as."""
    return (*DEPLOY_ROLES, *(("archiver",) if cfg.archive.enabled else ()))

IMAGE_HOME = "/app"
"""Where the images (deploy/docker) keep the checkout and its virtualenvs."""
DATA_DIR = "/data"
"""k8s, compose: the shared volume, every role's working directory (relative
``run.output_dir`` and model folders resolve under it)."""


@dataclass(frozen=True)
class Server:
    """One vLLM server beside a role process: its flags (`ServerSpec.command`), port,
    the environment it adds, and whether it takes a GPU."""

    spec: ServerSpec
    port: int
    gpu: bool

    @property
    def argv(self) -> list[str]:
        return self.spec.command(self.port)

    def env(self, cache_dir: str) -> dict[str, str]:
        """Its variables; the GPU it sees is the one Slurm or the container runtime gives
        it, so ``CUDA_VISIBLE_DEVICES`` is left to them."""
        env = self.spec.own_env(cache_dir)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        return env

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class Proc:
    """``count`` processes of one role. ``cpus``, ``gpus`` and ``memory_gib`` are per
    process (for the trainer: per node, i.e. per torchrun), not counting its servers."""

    role: str
    count: int
    cpus: int
    gpus: int
    memory_gib: float
    servers: tuple[Server, ...] = ()

    @property
    def command(self) -> str:
        return ROLE_COMMANDS[self.role]

    @property
    def user(self) -> str:
        return username(self.role)

    def argv(self, config: str, sluice: str = "sluice") -> list[str]:
        """``sluice <role> CONFIG``, plus the URLs of its own vLLM servers (the
        archiver: plus its fixed name, `ARCHIVER_NAME`)."""
        out = [sluice, self.command, config]
        if self.role == "archiver":
            out += ["--name", ARCHIVER_NAME]
        urls = [s.url for s in self.servers]
        if urls and self.role == "generator":
            out += ["--set", "generation.vllm.urls=" + _json_list(urls)]
        if urls and self.role == "evaluator":
            out += ["--set", "eval.vllm_urls=" + _json_list(urls)]
        return out


def _json_list(items: list[str]) -> str:
    return "[" + ",".join(f'"{i}"' for i in items) + "]"


@dataclass(frozen=True)
class Plan:
    cfg: Config
    target: str
    name: str  # DNS-1123 prefix of every object: sluice-<run>
    trainer: Proc
    generators: Proc
    scorers: Proc
    evaluator: Proc
    ranks_per_node: int
    streams: tuple[str, ...]  # the scorers' `rollouts` key in each lane
    group: str  # the scorers' consumer group
    credentials: dict[str, Credentials] = field(default_factory=dict)  # role -> its user
    acl_text: str = ""  # users.acl for a bundled Redis with ACL users
    archiver: Proc | None = None  # with archive.enabled: one, named ARCHIVER_NAME
    tls: DeployTLS | None = None  # the Redis's TLS (sluice.deploy.tls); None: plain TCP

    @property
    def run(self) -> str:
        return self.cfg.run.name

    @property
    def roles(self) -> tuple[Proc, ...]:
        return (self.trainer, self.generators, self.scorers, self.evaluator,
                *((self.archiver,) if self.archiver else ()))

    @property
    def bundled(self) -> bool:
        return self.cfg.deploy.redis == "bundled"

    @property
    def builds_model(self) -> bool:
        """Whether the deployment builds ``model.path`` before the trainer starts
        (``model.init`` names a recipe and the path is a folder, not a hub id); the
        build is skipped at run time when the folder already exists."""
        return (bool(self.cfg.model.init) and not self.cfg.model.from_gguf
                and not is_hub_id(self.cfg.model.path))

    @property
    def lane_lag(self) -> int:
        """KEDA's lagCount per lane: the scorers' target split over the lanes, so the
        busiest lane's trigger asks for about total lag / ``deploy.scorer_lag`` replicas
        when the lanes share the work evenly."""
        return max(1, round(self.cfg.deploy.scorer_lag / len(self.streams)))

    def redis_address(self, bundled_host: str) -> tuple[str, int, int]:
        """(host, port, database) of Redis as the deployment's pods reach it."""
        if self.bundled:
            return bundled_host, self.cfg.deploy.redis_port, 0
        u = urlparse(self.cfg.bus.redis_url)
        db = int(u.path.strip("/") or 0) if u.path.strip("/").isdigit() else 0
        return u.hostname or "", u.port or 6379, db


def dns_name(run: str) -> str:
    """``sluice-<run>`` made a DNS-1123 label: lower case, ``_`` and ``.`` as ``-``."""
    label = re.sub(r"[^a-z0-9-]", "-", f"sluice-{run}".lower()).strip("-")
    return re.sub(r"-+", "-", label)[:40].rstrip("-")


def _gpu(device: str) -> bool:
    """A role asks for a GPU when its device names CUDA (`auto` runs where it lands)."""
    return device.startswith("cuda")


def make_plan(cfg: Config, target: str) -> Plan:
    """The plan of ``cfg`` on ``target`` (`TARGETS`), or `ConfigError` naming the key."""
    if target not in TARGETS:
        raise ConfigError(f"--target: one of {', '.join(TARGETS)}, not {target!r}")
    d, up, gen = cfg.deploy, cfg.up, cfg.generation
    _check(cfg, target)
    ranks_per_node = up.trainer_ranks // d.trainer_nodes
    home = IMAGE_HOME if target != "slurm" else ""
    vllm_python = (f"{home}/.venv-vllm/bin/python" if home else gen.vllm.python)
    per_gen = gen.vllm.launch // up.generators if gen.engine == "vllm" else 0
    gen_servers = tuple(_server(cfg, vllm_python, d.vllm_port + j) for j in range(per_gen))
    eval_servers = ((_server(cfg, vllm_python, d.vllm_port),)
                    if launches_eval_server(cfg) else ())
    mem = d.role_memory_gib
    trainer = Proc("trainer", 1, cfg.trainer.threads * ranks_per_node,
                   ranks_per_node if _gpu(cfg.trainer.device) else 0, d.trainer_memory_gib)
    generators = Proc("generator", up.generators, gen.threads,
                      int(gen.engine == "transformers" and _gpu(gen.device)), mem,
                      gen_servers)
    teacher_gpu = bool(cfg.scoring.teacher) and not cfg.scoring.teacher_urls and _gpu(
        cfg.scoring.teacher_device)
    scorers = Proc("scorer", up.scorers, 1, int(teacher_gpu), mem)
    evaluator = Proc("evaluator", 1, 1,
                     int(cfg.eval_engine == "transformers" and _gpu(gen.device)), mem,
                     eval_servers)
    archiver = Proc("archiver", 1, 1, 0, mem) if cfg.archive.enabled else None
    lanes = Lanes(Keys(cfg.run.name), cfg.bus.partitions)
    creds, acl_text = _credentials(cfg)
    return Plan(cfg=cfg, target=target, name=dns_name(cfg.run.name), trainer=trainer,
                generators=generators, scorers=scorers, evaluator=evaluator,
                ranks_per_node=ranks_per_node, streams=tuple(lanes.streams("rollouts")),
                group=SCORERS_GROUP, credentials=creds, acl_text=acl_text,
                archiver=archiver, tls=deploy_tls(cfg))


def _server(cfg: Config, python: str, port: int) -> Server:
    """A vLLM server as `sluice.vllm_placement.vllm_specs` launches one, except that
    it loads ``model.path`` as written (a hub id through the shared HF cache, a folder
    relative to the role's working directory) and its GPU comes from the scheduler."""
    v, lora = cfg.generation.vllm, cfg.model.serving_lora
    gpu = v.gpu_memory_utilization > 0
    extra = list(v.extra_args)
    if is_hub_id(cfg.model.path) and cfg.model.revision != "main":
        extra = ["--revision", cfg.model.revision, *extra]
    spec = ServerSpec(python=python, model=cfg.model.path, dtype=cfg.model.dtype,
                      max_model_len=v.max_model_len,
                      kv_cache_memory_bytes=v.kv_cache_memory_bytes,
                      gpu_memory_utilization=v.gpu_memory_utilization,
                      lora_rank=lora.rank if lora else 0,
                      max_loras=cfg.trainer.max_staleness + 2, cpu_core=None,
                      max_logprobs=max(20, cfg.generation.num_sampler_logprobs + 1),
                      api_server_count=v.api_server_count,
                      cuda_device="0" if gpu else None, extra_args=extra)
    return Server(spec, port, gpu)


def _check(cfg: Config, target: str) -> None:
    """What ``target`` cannot run, each naming its key (the module docstring)."""
    d, up, v = cfg.deploy, cfg.up, cfg.generation.vllm
    if up.generators < 1:
        raise ConfigError("up.generators: a deployment needs at least one generator")
    if cfg.model.init not in ("", "tiny-char-qwen2") and not cfg.model.from_gguf \
            and not is_hub_id(cfg.model.path):
        raise ConfigError(f"model.init: a deployment builds only the tiny-char-qwen2 model; "
                          f"build {cfg.model.init} with `sluice init-model --recipe "
                          f"{cfg.model.init} {cfg.model.path}` where the roles read it, and "
                          "set model.init = \"\"")
    if up.trainer_ranks % d.trainer_nodes:
        raise ConfigError(f"deploy.trainer_nodes: {d.trainer_nodes} node(s) cannot share "
                          f"up.trainer_ranks = {up.trainer_ranks} ranks evenly")
    if target == "compose" and up.trainer_ranks > 1:
        raise ConfigError(f"up.trainer_ranks: compose runs one trainer process on one host "
                          f"(got {up.trainer_ranks} ranks); use the slurm or k8s target for a "
                          "torchrun trainer, or up.trainer_ranks = 1")
    if v.weight_transfer == "nccl":
        raise ConfigError('generation.vllm.weight_transfer: a deployment renders "file" '
                          "(servers reload versions from the weight store); nccl pushes "
                          "need the trainer and every server in one NCCL group, which only "
                          "`sluice up` on one machine sets up")
    if cfg.generation.engine == "vllm" and v.launch:
        if v.launch % up.generators:
            raise ConfigError(f"generation.vllm.launch: {v.launch} server(s) cannot be shared "
                              f"evenly by up.generators = {up.generators}: each generator "
                              "runs its own servers beside it")
    if target == "slurm":
        if up.generators % d.generator_nodes or (v.launch % d.generator_nodes):
            raise ConfigError(f"deploy.generator_nodes: up.generators = {up.generators} and "
                              f"generation.vllm.launch = {v.launch} must both spread evenly "
                              f"over {d.generator_nodes} node(s)")
        if cfg.metrics.port:
            raise ConfigError("metrics.port: roles share Slurm nodes, so one port cannot "
                              "serve them all; leave it 0 on the slurm target")
    else:
        for key, value in (("run.output_dir", cfg.run.output_dir),
                           ("archive.path", cfg.archive.path)):
            if "://" in value:  # an object store (archive.path = s3://...): no volume
                continue
            out = PurePosixPath(value)
            if out.is_absolute() or ".." in out.parts:
                raise ConfigError(f"{key}: {value!r} must be a relative path inside the "
                                  f"shared volume ({DATA_DIR}, every role's working "
                                  f"directory) on the {target} target")
    if d.redis == "external":
        if not cfg.bus.redis_url:
            raise ConfigError('bus.redis_url: deploy.redis = "external" needs the URL of '
                              "your Redis (redis:// or rediss://)")
        if cfg.bus.redis_url.startswith("unix:"):
            raise ConfigError("bus.redis_url: a unix socket cannot be reached from other "
                              "machines or containers; give redis:// or rediss://")
    else:
        if cfg.bus.redis_url:
            raise ConfigError('deploy.redis: "bundled" runs its own Redis, but bus.redis_url '
                              f"is set ({cfg.bus.redis_url!r}); unset it or use "
                              'deploy.redis = "external"')
        if cfg.bus.cluster:
            raise ConfigError('bus.cluster: the bundled Redis is one server; use deploy.redis '
                              '= "external" with your cluster')
    if d.grace_s < cfg.scoring.reward_timeout_s:
        raise ConfigError(f"deploy.grace_s: {d.grace_s} s is shorter than "
                          f"scoring.reward_timeout_s = {cfg.scoring.reward_timeout_s} s; a "
                          "scorer stopped mid-group needs that long to finish it")


def _credentials(cfg: Config) -> tuple[dict[str, Credentials], str]:
    """Each deployed role's Redis user from ``bus.credentials_file`` (and, for a bundled
    Redis, the users.acl `sluice acl` wrote beside it, checked to be this run's)."""
    if not cfg.deploy.acl:
        return {}, ""
    path = credentials_path(cfg.bus.credentials_file)
    if not path:
        raise ConfigError("bus.credentials_file: deploy.acl = true needs the per-role "
                          "credentials `sluice acl CONFIG --out DIR` writes; set "
                          "bus.credentials_file = DIR/credentials.toml (or deploy.acl = false "
                          "for a Redis nothing else can reach)")
    try:
        creds = load_credentials_file(path)
    except CredentialsError as e:
        raise ConfigError(f"bus.credentials_file: {e}") from None
    plain = re.compile(r"^[A-Za-z0-9_.@~+-]+$")  # safe as an env file's value, unquoted
    bad = [r for r, c in creds.items() if not (plain.match(c.username or "")
                                                and plain.match(c.password or ""))]
    if bad:
        raise ConfigError(f"bus.credentials_file: the user or password of [{bad[0]}] has "
                          "characters an env file cannot hold unquoted; render it with "
                          "`sluice acl`")
    missing = [r for r in deploy_roles(cfg) if r not in creds]
    if missing:
        raise ConfigError(f"bus.credentials_file: {path} has no [{'], ['.join(missing)}] "
                          "table(s); render it with `sluice acl`")
    acl = ""
    if cfg.deploy.redis == "bundled":
        acl_path = Path(path).parent / "users.acl"
        try:
            acl = acl_path.read_text()
        except OSError as e:
            raise ConfigError(f"bus.credentials_file: the bundled Redis loads the users.acl "
                              f"written beside it, and {acl_path} cannot be read: "
                              f"{e.strerror or e}") from None
        mine, every = Keys(cfg.run.name).prefix, "sluice:{*}"
        if mine not in acl and every not in acl:
            raise ConfigError(f"bus.credentials_file: {acl_path} grants no key of run "
                              f"{cfg.run.name!r} (run.name); render it with `sluice acl` "
                              "for this run")
    return {r: creds[r] for r in deploy_roles(cfg)}, acl


MEMORY_DEFAULT_GIB = {"trainer": 16.0, "role": 4.0, "vllm": 16.0, "redis": 4.0}
"""What a container gets (request = limit on k8s, ``mem_limit`` on compose) when its
``deploy.*_memory_gib`` key is 0 (slurm: what a step is given and its node is asked
for): a container without a limit is the first the kernel kills under memory pressure,
and a node full of them is overcommitted."""


def memory_gib(value_gib: float, kind: str) -> float:
    """``value_gib`` (a ``deploy.*_memory_gib`` key), or `MEMORY_DEFAULT_GIB` [``kind``]
    when it is 0."""
    return value_gib or MEMORY_DEFAULT_GIB[kind]


def vllm_cpus(server: Server) -> int:
    """CPUs a vLLM server keeps busy: each HTTP front end, and the engine's process."""
    return server.spec.api_server_count + 1


def mem_mib(gib: float) -> int:
    """``gib`` GiB in MiB, rounded up: Slurm's ``--mem`` unit, k8s's ``Mi``."""
    return math.ceil(gib * 1024)


def credentials_toml(plan: Plan, role: str) -> str:
    """A credentials file (`pipeline.bus.security` format) holding ``role``'s user only."""
    c = plan.credentials[role]
    return (f"# Redis user of the {role} of run {plan.run!r} (secret: keep it mode 0600)\n"
            f"[{role}]\nusername = {_quote(c.username)}\npassword = {_quote(c.password)}\n")


def credentials_env(plan: Plan, role: str) -> str:
    """``SLUICE_REDIS_<ROLE>_USERNAME`` / ``_PASSWORD`` lines: an env file (compose) or a
    generated Secret's keys (k8s), read by `pipeline.bus.security` before any file."""
    c, r = plan.credentials[role], role.upper()
    return f"SLUICE_REDIS_{r}_USERNAME={c.username}\nSLUICE_REDIS_{r}_PASSWORD={c.password}\n"


def _quote(s: str | None) -> str:
    return '"' + (s or "").replace("\\", "\\\\").replace('"', '\\"') + '"'
