"""The `sluice` command: one face for every role.

It parses, runs the roles' preflights and dispatches: it imports ``workers/`` and
``trainer/`` lazily, per subcommand, so a command loads only what it runs.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

if hasattr(signal, "SIGUSR2"):  # pipeline.runtime.END_SIGNAL: a request to end the run
    # that reaches a role still importing must not kill it (the default action); the
    # trainer takes it up once its loop runs (`pipeline.runtime.end_requests`)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)

from pipeline.config import Config, ConfigError, load_config


def _config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("config", nargs=None if required else "?", help="run TOML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set trainer.lr=3e-4 (repeatable)")


def _allow_change_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume run.output_dir although this config differs from the one "
                   "saved in its run.json (this one then becomes the run's)")


def _up_args(p: argparse.ArgumentParser) -> None:
    _config_args(p)
    p.add_argument("--fresh", action="store_true",
                   help="delete run.output_dir first instead of resuming it (refused for a "
                   "non-empty directory that is not a sluice run)")
    _allow_change_arg(p)
    p.add_argument("--eval-every", type=float, default=None, metavar="S",
                   help="held-out evaluation at most every S seconds (default eval.every_s)")


def _role_args(p: argparse.ArgumentParser) -> None:
    """`sluice generate|score|train`."""
    _config_args(p)
    p.add_argument("--name", default=None,
                   help="stable consumer/worker name (default: host-pid; trainer: rank)")
    _allow_change_arg(p)


def _archive_args(p: argparse.ArgumentParser) -> None:
    _config_args(p)
    p.add_argument("--name", default=None, help="stable consumer name (default archiver-0)")
    _allow_change_arg(p)
    p.add_argument("--dispositions", action="store_true",
                   help="only (re)write the archive's dispositions.parquet from the ledgers")


def _replay_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="ARCHIVE_OR_RUN",
                   help="a run's output_dir (its ledger has the steps) or an archive path/URL")
    p.add_argument("--config", required=True, help="run TOML to replay with")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where the replay writes (default run.output_dir, or <it>/replay "
                   "when that holds a run)")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="replay only the first N steps")


def _trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN", help="the run's output_dir")
    p.add_argument("gid", help="group id, <epoch>:<prompt index>")
    p.add_argument("--json", action="store_true")


def _eval_args(p: argparse.ArgumentParser) -> None:
    _config_args(p)
    p.add_argument("--name", default=None)
    _allow_change_arg(p)
    p.add_argument("--every", type=float, default=None, metavar="S",
                   help="at most every S seconds (default eval.every_s)")


def _tail_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("stream", choices=["rollouts", "scored", "control", "dlq"])
    _config_args(p, required=False)
    p.add_argument("--from-start", action="store_true")
    p.add_argument("--count", type=int, default=None, help="exit after this many entries")


def _status_args(p: argparse.ArgumentParser) -> None:
    _config_args(p, required=False)
    p.add_argument("--json", action="store_true", help="print the raw snapshot as JSON")
    p.add_argument("--watch", type=float, default=0.0, metavar="S", help="refresh every S s")
    p.add_argument("--wide", action="store_true",
                   help="every worker and every counter, continued on indented lines where "
                   "the terminal is too narrow (default: one line per worker, the counters "
                   "the width takes)")


def _audit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run's output_dir (holds ledger/)")
    p.add_argument("--config", default=None, help="run TOML: compare with its Redis counters "
                   "(default: run_dir/state.json, written when `sluice up` stops)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--drained", action="store_true",
                   help="also require that no admitted group is still in flight")


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run's output_dir (holds weights/, checkpoints/)")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write")
    p.add_argument("--version", type=int, default=None, metavar="N",
                   help="published version N (default: newest verified, else newest "
                   "checkpoint)")
    p.add_argument("--merge-lora", action="store_true",
                   help="LoRA runs: merge the adapter into full weights")
    p.add_argument("--push-to-hub", default=None, metavar="REPO",
                   help="then upload the folder to this Hugging Face model repo")
    p.add_argument("--config", default=None, help="run TOML, for runs without run.json")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")


def _init_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0, help="the tiny model's init seed")
    p.add_argument("--recipe", default="tiny-char-qwen2",
                   choices=("tiny-char-qwen2", "tiny-char-qwen2_5_vl"),
                   help="the tiny model to build (model.init's values): a Qwen2, or the "
                        "same text model inside a tiny Qwen2.5-VL")
    p.add_argument("--from-gguf", default=None, metavar="FILE",
                   help="instead: the model in this GGUF file, as a plain model folder")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="with --from-gguf: the dtype of the written weights")


def _acl_args(p: argparse.ArgumentParser) -> None:
    _config_args(p, required=False)
    p.add_argument("--out", required=True, metavar="DIR", help="where to write both files")
    p.add_argument("--all-runs", action="store_true",
                   help="users for every run on the server, not only run.name's keys")
    p.add_argument("--force", action="store_true",
                   help="overwrite existing credentials (rotates every password)")


def _deploy_args(p: argparse.ArgumentParser) -> None:
    dsub = p.add_subparsers(dest="deploy_cmd", required=True)
    d = dsub.add_parser("render", help="write the target's files from the config")
    _config_args(d)
    d.add_argument("--target", required=True, choices=["slurm", "k8s", "compose"])
    d.add_argument("--out", required=True, metavar="DIR", help="where to write (must be empty)")
    d.add_argument("--force", action="store_true", help="render over a non-empty --out")
    d = dsub.add_parser("wait", help="wait until Redis, the trainer or vLLM servers answer "
                        "(a deployed role's start order)")
    _config_args(d)
    d.add_argument("--role", default="monitor", help="the Redis identity to ask as")
    d.add_argument("--redis", action="store_true", help="Redis answers")
    d.add_argument("--trainer", action="store_true", help="the trainer has announced")
    d.add_argument("--http", action="append", default=[], metavar="URL",
                   help="the URL answers 200 (repeatable)")
    d.add_argument("--timeout", type=float, default=300.0, metavar="S")
    d = dsub.add_parser("certs", help="make a private CA and the bundled Redis's TLS "
                        "certificate (for deploy.redis_tls_dir)")
    d.add_argument("out", metavar="DIR", help="folder to write ca.crt, ca.key, redis.crt, "
                   "redis.key in (must not hold them)")
    d.add_argument("--host", action="append", required=True, metavar="NAME",
                   help="a DNS name or IP address the roles reach Redis at (repeatable)")
    d.add_argument("--days", type=int, default=365, help="validity in days")
    d = dsub.add_parser("check-cert", help="exit 1, saying why, unless a certificate names "
                        "a host (the Slurm job's check of the bundled Redis's, at start)")
    d.add_argument("cert", metavar="FILE", help="a PEM certificate (redis.crt)")
    d.add_argument("--host", required=True, metavar="NAME",
                   help="the DNS name or IP address the roles reach Redis at")


SUBCOMMANDS: tuple[tuple[str, str, Callable[[argparse.ArgumentParser], None]], ...] = (
    ("up", "run every role on this machine (embedded Redis)", _up_args),
    ("generate", "run one generator", _role_args),
    ("score", "run one scorer", _role_args),
    ("train", "run the trainer (rank 0)", _role_args),
    ("archive", "run the archiver: every scored group to Parquet (archive.enabled; "
     "docs/archive.md)", _archive_args),
    ("replay", "train again on an archive, step for step as the original trainer did (no "
     "generators, scorers or Redis)", _replay_args),
    ("trace", "the life of one group: every hop, its wait, how it ended (from the ledgers "
     "and the archive)", _trace_args),
    ("eval", "follow the run and score held-out prompts per version", _eval_args),
    ("tail", "follow a stream, one decoded line per entry", _tail_args),
    ("status", "streams, lag, pending, workers, version, conservation", _status_args),
    ("audit", "check a run's delivery history (ledgers) for losses, duplicates, stale "
     "training and counter drift", _audit_args),
    ("export", "write a run's weights as a Hugging Face model folder", _export_args),
    ("init-model", "build the tiny char-level Qwen2 model and tokenizer, or import a "
                   "GGUF file (--from-gguf)", _init_model_args),
    ("acl", "render deploy/redis/users.acl: one Redis user per role, fresh passwords "
     "(users.acl + credentials.toml, mode 0600)", _acl_args),
    ("deploy", "render a Slurm job, Kubernetes manifests or a compose project for the run "
     "(docs/deploying.md)", _deploy_args),
)
"""Every subcommand, in the order ``sluice --help`` lists them: (name, help, the function
that adds its arguments)."""


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sluice", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_, add_args in SUBCOMMANDS:
        add_args(sub.add_parser(name, help=help_))
    return ap


def _deploy(args: argparse.Namespace) -> int:
    """`sluice deploy render|wait|certs|check-cert`: a refused config exits 2 before
    anything is written (the caller's ConfigError path); a wait that times out, or a
    certificate that does not name the host, exits 1."""
    if args.deploy_cmd == "certs":
        from sluice.deploy.certs import make_certs

        written = make_certs(args.out, args.host, args.days)
        print(f"wrote {', '.join(p.name for p in written)} in {args.out}: set "
              f"deploy.redis_tls_dir = {str(args.out)!r} (keep ca.key off the cluster)")
        return 0
    if args.deploy_cmd == "check-cert":
        from pathlib import Path

        from sluice.deploy.tls import certificate_names

        try:
            names = certificate_names(Path(args.cert).read_text())
        except (OSError, ValueError) as e:
            print(f"sluice: cannot read the certificate {args.cert}: {e}", file=sys.stderr)
            return 1
        if args.host not in names:
            print(f"sluice: {args.cert} names {sorted(names)}, not {args.host!r}, the "
                  "address the roles reach Redis at; make it with `sluice deploy certs DIR "
                  f"--host {args.host}` (one --host for every node that may be the job's "
                  "first trainer node)", file=sys.stderr)
            return 1
        return 0
    if args.deploy_cmd == "render":
        from sluice.deploy import render

        written = render(args.config, args.overrides, args.target, args.out, force=args.force)
        print(f"wrote {len(written)} files for {args.target} in {args.out} "
              "(docs/deploying.md says how to start them)")
        return 0
    from sluice.deploy.wait import WaitTimeout, wait

    if not (args.redis or args.trainer or args.http):
        raise ValueError("sluice deploy wait: give --redis, --trainer and/or --http URL")
    try:
        wait(_load(args), args.role, redis=args.redis, trainer=args.trainer, http=args.http,
             timeout_s=args.timeout)
    except WaitTimeout as e:
        print(f"sluice: {e}", file=sys.stderr)
        return 1
    return 0


def _check_credentials(cfg: Config, cmd: str) -> None:
    """Resolve the credentials and TLS files of every role the command will run, so a
    missing, unreadable or too widely readable file fails now, naming the problem."""
    from pipeline.bus.security import COMMAND_ROLES, CredentialsError, credentials_path
    from pipeline.runtime import redis_options

    if cmd == "up":
        if not cfg.bus.redis_url and credentials_path(cfg.bus.credentials_file):
            raise CredentialsError("the embedded Redis of `sluice up` has no ACL users; set "
                                   "bus.redis_url to a Redis started with the rendered "
                                   "users.acl, or unset the credentials file")
        for role in ("trainer", "scorer", "generator", "evaluator", "monitor",
                     *(("archiver",) if cfg.archive.enabled else ())):
            redis_options(cfg, role)
    elif cmd in COMMAND_ROLES:
        redis_options(cfg, COMMAND_ROLES[cmd])


def _acl(cfg: Config, args: argparse.Namespace) -> int:
    from sluice.acl import make_acl

    done = make_acl(args.out, None if args.all_runs else cfg.run.name, force=args.force)
    print(f"wrote {done.acl_file} (ACL users, passwords as sha256)\n"
          f"wrote {done.credentials_file} (the passwords, mode 0600)\n"
          f"start Redis with:  redis-server --aclfile {done.acl_file.resolve()} ...\n"
          f"and give sluice:   bus.credentials_file = \"{done.credentials_file.resolve()}\"")
    return 0


# subcommand -> (the role module, its Redis identity); `sluice up` runs them all (the
# archiver with archive.enabled)
ROLES = {"train": ("trainer.trainer", "trainer"), "generate": ("workers.generator", "generator"),
         "score": ("workers.scorer", "scorer"), "eval": ("workers.evaluator", "evaluator"),
         "archive": ("workers.archiver", "archiver")}


def _preflight(cfg: Config, cmd: str) -> None:
    """Each role's start-up checks (its module's ``preflight``), run before it starts and
    before `sluice up` touches the run directory, so a wrong device, a tracker that is
    not installed, task data, a reward function that cannot be called or a teacher of
    another vocabulary fails here naming the key, not as a traceback from a role that
    started. `sluice up` runs every role's, the task built once. (A missing or unknown
    ``model.path`` fails when it is resolved and pinned; `sluice up` builds a missing
    tiny model itself when ``model.init`` says so, and the task is then checked without
    the tokenizer.)"""
    import functools

    @functools.cache
    def tokenizer() -> Any:  # imported here: `sluice archive` loads no transformers
        from pipeline.model import tokenizer_if_present

        return tokenizer_if_present(cfg)

    if cmd in ("train", "up"):
        from trainer.preflight import preflight

        preflight(cfg)
    task = None
    if cmd in ("generate", "up"):
        from workers import generator

        task = generator.preflight(cfg, tokenizer)
    if cmd in ("score", "up"):
        from workers import scorer

        scorer.preflight(cfg, task, tokenizer)
    if cmd in ("eval", "up"):
        from workers import evaluator

        evaluator.preflight(cfg, task, tokenizer, alone=cmd == "eval")
    if cmd == "archive" or (cmd == "up" and cfg.archive.enabled):
        from workers import archiver

        archiver.preflight(cfg)


def _pin(cfg: Config, args: argparse.Namespace) -> Config:
    """The config a role runs with: checked against run.json in ``run.output_dir`` and
    with ``model.path`` the run's pinned folder (`pipeline.rundir`). `sluice up` pins
    after ``--fresh`` and building the tiny model (`sluice.up.prepare`); the scorer
    loads no model, so it only checks an existing pin and never creates one."""
    from pipeline.rundir import pinned_config

    return pinned_config(cfg, allow_config_change=args.allow_config_change,
                         resolve=args.cmd != "score")


def _load(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.overrides)


def _replay(args: argparse.Namespace) -> int:
    """Exit 0 when every planned step was replayed (and, against a run directory, every
    version both weight stores hold is bit-identical: say so), 1 when the replay stopped
    at a gap or diverged, 2 for a refused config or source."""
    from trainer.replay import ReplayDiverged, replay

    cfg = load_config(args.config, args.overrides)
    from trainer.preflight import preflight

    preflight(cfg)
    try:
        res = replay(cfg, args.source, out=args.out, max_steps=args.steps)
    except ReplayDiverged as e:
        print(f"sluice: replay diverged: {e}", file=sys.stderr)
        return 1
    print(f"replayed {res.steps} of {res.planned} steps into {res.out}")
    if res.compared:
        byte = [k for k, v in res.compared.items() if v == "bytes"]
        tens = [k for k, v in res.compared.items() if v == "tensors"]
        bad = [k for k, v in res.compared.items() if v is None]
        print(f"against the original: bit-identical {'yes' if res.bit_exact else 'NO'}; "
              f"byte-identical files: {byte}; identical tensors, other safetensors header "
              f"(a run published before the header had one key): {tens}; differing: {bad}")
    if res.gap:
        print(f"sluice: replay stopped early: {res.gap}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.cmd == "init-model" and args.from_gguf:
            from sluice.gguf_import import import_gguf

            print(import_gguf(args.from_gguf, args.dir, args.dtype))
            return 0
        if args.cmd == "init-model":
            from pipeline.model import init_tiny_model

            print(init_tiny_model(args.dir, seed=args.seed, recipe=args.recipe))
            return 0
        if args.cmd == "audit":
            from sluice.audit_run import audit_command

            return audit_command(args.run_dir, args.config, args.overrides, args.drained)
        if args.cmd == "export":
            from sluice.export import main as export_main

            return export_main(args)
        if args.cmd == "trace":
            from sluice.trace import main as trace_main

            return trace_main(args.run_dir, args.gid, args.json)
        if args.cmd == "replay":
            return _replay(args)
        if args.cmd == "deploy":
            return _deploy(args)
        cfg = _load(args)
        if args.cmd == "acl":
            return _acl(cfg, args)
        _check_credentials(cfg, args.cmd)
        _preflight(cfg, args.cmd)
        if args.cmd == "up":
            from sluice.up import prepare

            cfg = prepare(cfg, fresh=args.fresh, allow_config_change=args.allow_config_change)
        elif args.cmd in ("generate", "score", "eval", "train", "archive"):
            cfg = _pin(cfg, args)
        if args.cmd == "archive" and args.dispositions:
            from pipeline.archive.store import write_dispositions

            print(f"wrote {write_dispositions(cfg)} dispositions")
            return 0
    except (ConfigError, ValueError, FileExistsError) as e:
        print(f"sluice: {e}", file=sys.stderr)
        return 2
    if args.cmd == "up":
        from sluice.up import run_up

        return run_up(cfg, args.config, args.overrides, eval_every_s=args.eval_every)
    if args.cmd == "status":
        from sluice.monitor import status_command

        return status_command(cfg, args.json, args.watch, args.wide)
    if args.cmd == "tail":
        from sluice.monitor import tail_command

        return tail_command(cfg, args.stream, args.from_start, args.count)

    from pipeline.runtime import FATAL_EXIT_CODE, RoleFatal

    try:
        _run_role(cfg, args)
    except ConfigError as e:  # found as the role starts (a metrics.port in use)
        print(f"sluice: {e}", file=sys.stderr)
        return 2
    except RoleFatal as e:  # no restart can fix it: `sluice up` ends the run on this code
        print(f"sluice: {args.cmd} stopped: {e}", file=sys.stderr, flush=True)
        return FATAL_EXIT_CODE
    return 0


def _run_role(cfg: Config, args: argparse.Namespace) -> None:
    """Hand the process to the role's ``main(cfg, stop, name, ...)`` (`ROLES`)."""
    import importlib

    from pipeline.runtime import run_role

    module, role = ROLES[args.cmd]
    main = importlib.import_module(module).main
    extra = {"every_s": args.every} if args.cmd == "eval" else {}
    run_role(lambda stop: main(cfg, stop, args.name, **extra), role)


if __name__ == "__main__":
    sys.exit(main())
