"""The `sluice` command: one face for every role.

This is the one module of ``pipeline/`` allowed to import ``workers/`` and ``trainer/``
(lazily, per subcommand), since it dispatches to them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence

from pipeline.config import Config, ConfigError, load_config


def _config_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("config", nargs=None if required else "?", help="run TOML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set trainer.lr=3e-4 (repeatable)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sluice", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("up", help="run every role on this machine (embedded Redis)")
    _config_args(p)
    p.add_argument("--fresh", action="store_true",
                   help="delete run.output_dir first instead of resuming it")
    p.add_argument("--eval-every", type=float, default=20.0, metavar="S",
                   help="held-out greedy evaluation at most every S seconds")

    for name, help_ in (("generate", "run one generator"), ("score", "run one scorer"),
                        ("train", "run the trainer (rank 0)")):
        p = sub.add_parser(name, help=help_)
        _config_args(p)
        p.add_argument("--name", default=None,
                       help="stable consumer/worker name (default: host-pid; trainer: rank)")
    p = sub.add_parser("eval", help="follow the run and evaluate held-out greedy exact match")
    _config_args(p)
    p.add_argument("--name", default=None)
    p.add_argument("--every", type=float, default=20.0, metavar="S")

    p = sub.add_parser("tail", help="follow a stream, one decoded line per entry")
    p.add_argument("stream", choices=["rollouts", "scored", "control", "dlq"])
    _config_args(p, required=False)
    p.add_argument("--from-start", action="store_true")
    p.add_argument("--count", type=int, default=None, help="exit after this many entries")

    p = sub.add_parser("status", help="streams, lag, pending, workers, version, conservation")
    _config_args(p, required=False)
    p.add_argument("--json", action="store_true", help="print the raw snapshot as JSON")
    p.add_argument("--watch", type=float, default=0.0, metavar="S", help="refresh every S s")

    p = sub.add_parser("init-model", help="build the tiny char-level Qwen2 model and tokenizer")
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    return ap


def _load(args: argparse.Namespace) -> Config:
    return load_config(args.config, args.overrides)


def _status(cfg: Config, as_json: bool, watch_s: float) -> int:
    from rich.console import Console
    from rich.live import Live

    from pipeline.monitor import render_status, snapshot
    from pipeline.runtime import connect

    async def once() -> dict:
        bus = connect(cfg)
        try:
            return await snapshot(bus)
        finally:
            await bus.close()

    if as_json:
        print(json.dumps(asyncio.run(once()), default=str, indent=1))
        return 0
    console = Console()
    if not watch_s:
        console.print(render_status(asyncio.run(once()), cfg.trainer.window))
        return 0
    import time

    with Live(console=console, auto_refresh=False) as live:
        try:
            while True:
                live.update(render_status(asyncio.run(once()), cfg.trainer.window), refresh=True)
                time.sleep(watch_s)
        except KeyboardInterrupt:
            return 0


def _tail(cfg: Config, stream: str, from_start: bool, count: int | None) -> int:
    from pipeline.monitor import tail
    from pipeline.runtime import connect

    async def go() -> None:
        bus = connect(cfg)
        try:
            await tail(bus, stream, from_start=from_start, count=count,
                       out=lambda s: print(s, flush=True))
        finally:
            await bus.close()

    try:
        asyncio.run(go())
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.cmd == "init-model":
            from pipeline.model import init_tiny_model

            print(init_tiny_model(args.dir, seed=args.seed))
            return 0
        cfg = _load(args)
    except (ConfigError, ValueError) as e:
        print(f"sluice: {e}", file=sys.stderr)
        return 2
    if args.cmd == "up":
        from pipeline.up import run_up

        return run_up(cfg, args.config, args.overrides, fresh=args.fresh,
                      eval_every_s=args.eval_every)
    if args.cmd == "status":
        return _status(cfg, args.json, args.watch)
    if args.cmd == "tail":
        return _tail(cfg, args.stream, args.from_start, args.count)

    from pipeline.runtime import run_role

    if args.cmd == "generate":
        from workers import generator

        run_role(lambda stop: generator.main(cfg, stop, args.name), "generator")
    elif args.cmd == "score":
        from workers import scorer

        run_role(lambda stop: scorer.main(cfg, stop, args.name), "scorer")
    elif args.cmd == "eval":
        from workers import evaluator

        run_role(lambda stop: evaluator.main(cfg, stop, args.every), "evaluator")
    elif args.cmd == "train":
        from trainer import loop

        rank = 0
        if args.name and args.name.rsplit("-", 1)[-1].isdigit():
            rank = int(args.name.rsplit("-", 1)[-1])
        run_role(lambda stop: loop.main(cfg, stop, rank), "trainer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
