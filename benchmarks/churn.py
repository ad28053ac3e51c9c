"""Fleet churn: generators and scorers come and go at random while the run trains.

As spot capacity would: every few seconds (``--every``, uniform) one generator or one
scorer is started (a new name: a new machine) or stopped, by SIGTERM (a clean stop: it
finishes its batch) or by kill -9 (it vanishes mid-work: its leases expire and are taken
over, its pending entries are reclaimed), keeping between 1 and 3 of each alive. The
trainer is never touched. One phase without churn and one with it, each for the same
wall time after the first trained step, each on a fresh run; then every role is stopped,
the whole history is audited against Redis (`pipeline.bus.audit`), and the held-out
reward of the final checkpoint is measured (`benchmarks/heldout.py`). The run is the
quick start's (`examples/copy.toml`, from a fresh tiny model), on one Redis or, with
``--cluster``, on a 3-master Redis Cluster with the bus in 3 lanes.

    .venv/bin/python benchmarks/churn.py --minutes 5            # baseline + churn, one Redis
    .venv/bin/python benchmarks/churn.py --minutes 3 --cluster --phases churn

Prints one line per phase: trained groups and steps in the measured window, throughput
(trained groups per second), the held-out reward and pass@1, the starts, SIGTERMs and
kills, and the audit's verdict; ``--out``/report.json has it all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.bus.audit import audit, live_view, pending_intents  # noqa: E402
from pipeline.bus.client import Bus  # noqa: E402
from pipeline.bus.keys import Keys  # noqa: E402
from pipeline.bus.lanes import Lanes, add_states  # noqa: E402
from pipeline.bus.ledger import read_ledgers  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.model import init_tiny_model  # noqa: E402
from pipeline.ports import free_port  # noqa: E402
from sluice.embedded import EmbeddedCluster, EmbeddedRedis  # noqa: E402

# the quick start, with a bus tuned for churn: dead consumers' entries reclaimed after 3 s
# and dead generators' leases taken over after 5 s (the defaults, 30 s and 60 s, suit a
# fleet that rarely loses a machine)
SETS = ["bus.heartbeat_s=0.5", "bus.block_ms=200", "bus.claim_idle_ms=3000",
        "generation.lease_s=5", "trainer.max_steps=1000000", "trainer.save_steps=25"]
ROLE = {"generate": "generator", "score": "scorer", "train": "trainer"}


@dataclass
class Fleet:
    """The roles of one run as OS processes (logs in ``out/logs``), ended by PID."""

    out: Path
    config: Path
    sets: list[str]
    procs: dict[str, tuple[str, subprocess.Popen[bytes]]] = field(default_factory=dict)
    signalled: set[str] = field(default_factory=set)
    counts: dict[str, int] = field(default_factory=lambda: {"starts": 0, "sigterm": 0,
                                                            "kill9": 0})
    serial: int = 0

    def start(self, role: str, name: str | None = None) -> str:
        if name is None:
            self.serial += 1
            name = f"{role[0]}{self.serial}"
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        args = [sys.executable, "-m", "sluice.cli", role, str(self.config), "--name",
                name]
        for s in self.sets:
            args += ["--set", s]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
               "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        with open(self.out / "logs" / f"{name}.log", "ab") as log:
            p = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
        self.procs[name] = (role, p)
        self.counts["starts"] += role != "train"
        return name

    def alive(self, role: str) -> list[str]:
        """Names of ``role``'s processes running and not told to stop."""
        return [n for n, (r, p) in self.procs.items()
                if r == role and p.poll() is None and n not in self.signalled]

    def stop_one(self, name: str, sig: signal.Signals) -> None:
        self.signalled.add(name)
        self.counts["kill9" if sig == signal.SIGKILL else "sigterm"] += 1
        os.kill(self.procs[name][1].pid, sig)

    def crashed(self) -> list[str]:
        """Roles that exited although nobody stopped them."""
        return [n for n, (_, p) in self.procs.items()
                if n not in self.signalled and p.poll() is not None]

    def stop_all(self, timeout_s: float = 120) -> dict[str, int | None]:
        """Generators, then scorers, then the trainer, each by SIGTERM (kill -9 after
        ``timeout_s``); their exit codes."""
        codes: dict[str, int | None] = {}
        for role in ("generate", "score", "train"):
            for name, (r, p) in self.procs.items():
                if r != role or p.poll() is not None:
                    continue
                self.signalled.add(name)
                p.send_signal(signal.SIGTERM)
                try:
                    codes[name] = p.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    p.kill()
                    codes[name] = p.wait()
        return codes


def state(r: Any, lanes: Lanes) -> dict[str, int]:
    def read(key: str) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in r.hgetall(key).items()}

    return add_states(read(lanes.run.state), [read(k.state) for k in lanes.keys])


def wait(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.2)


def run_phase(out: Path, model: Path, url: str, *, churn: bool, seconds: float,
              every: tuple[float, float] = (2.0, 5.0), seed: int = 0, cluster: bool = False,
              heldout_n: int = 128, say: Any = print) -> dict[str, Any]:
    """One run of ``seconds`` (after its first trained step), with or without churn; its
    figures and the audit's verdict."""
    run = f"churn{uuid.uuid4().hex[:6]}"
    partitions = 3 if cluster else 1
    sets = [f"run.name={run}", f"run.output_dir={out}", f"bus.redis_url={url}",
            f"model.path={model}", "model.init=", *SETS,
            *(["bus.cluster=true", f"bus.partitions={partitions}"] if cluster else [])]
    fleet = Fleet(out, ROOT / "examples" / "copy.toml", sets)
    keys, rng = Keys(run), random.Random(seed)
    lanes = Lanes(keys, partitions)
    r = (redis.RedisCluster if cluster else redis.Redis).from_url(url, socket_timeout=10)
    try:
        fleet.start("train", "trainer-0")
        wait(lambda: r.hget(keys.heartbeats("trainer"), "trainer/trainer-0"), 300, "the trainer")
        for role in ("generate", "generate", "score", "score"):
            fleet.start(role)
        wait(lambda: state(r, lanes).get("retired:trained", 0) > 0, 300, "a trained step")
        t0, trained0 = time.time(), state(r, lanes).get("retired:trained", 0)
        next_event = t0 + rng.uniform(*every)
        while time.time() < t0 + seconds:
            if fleet.crashed():
                raise RuntimeError(f"roles crashed: {fleet.crashed()} (logs in {out}/logs)")
            if churn and time.time() >= next_event:
                event(fleet, rng, say)
                next_event = time.time() + rng.uniform(*every)
            time.sleep(0.1)
        t1, trained1 = time.time(), state(r, lanes).get("retired:trained", 0)
        beat = r.hget(keys.heartbeats("trainer"), "trainer/trainer-0")
        steps = json.loads(beat or b"{}").get("step")
        codes = fleet.stop_all()
    finally:
        for _, p in fleet.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        leftover = {k: v for k, v in state(r, lanes).items()}
        r.close()
    bad_exits = {n: c for n, c in codes.items() if c not in (0, -signal.SIGTERM)}
    report = check(out, url, run, cluster, partitions)
    from benchmarks.heldout import heldout, newest_checkpoint

    cfg = load_config(ROOT / "examples" / "copy.toml", sets)
    res = heldout(cfg, newest_checkpoint(out), heldout_n) if heldout_n else {}
    return {"phase": "churn" if churn else "baseline", "redis": "cluster" if cluster else
            "redis", "seconds": round(t1 - t0, 1), "trained_groups": trained1 - trained0,
            "groups_per_s": round((trained1 - trained0) / (t1 - t0), 2), "steps": steps,
            "heldout_reward": res.get("reward"), "heldout_pass@1": res.get("pass@1"),
            **fleet.counts, "bad_exits": bad_exits, "audit_ok": report.ok,
            "audit": report.summary(), "state": leftover}


def event(fleet: Fleet, rng: random.Random, say: Any) -> None:
    """Start or stop one generator or scorer (keeping 1 to 3 of each alive)."""
    role = rng.choice(["generate", "score"])
    alive = fleet.alive(role)
    if len(alive) >= 3 or (len(alive) >= 2 and rng.random() < 0.5):
        name = rng.choice(alive)
        sig = rng.choice([signal.SIGTERM, signal.SIGKILL])
        fleet.stop_one(name, sig)
        say(f"  {time.strftime('%H:%M:%S')} {sig.name} {ROLE[role]} {name}")
    else:
        say(f"  {time.strftime('%H:%M:%S')} start {ROLE[role]} {fleet.start(role)}")


def check(out: Path, url: str, run: str, cluster: bool, partitions: int) -> Any:
    """The whole history of the run against where Redis says its unfinished groups are."""
    rows = read_ledgers(out)

    async def view() -> Any:
        bus = Bus.connect(url, run, cluster=cluster, partitions=partitions)
        try:
            return await live_view(bus, pending_intents(rows))
        finally:
            await bus.close()

    return audit(out, live=asyncio.run(view()), rows=rows, num_generations=8)


def line(x: dict[str, Any]) -> str:
    f = "-" if x["heldout_reward"] is None else f"{x['heldout_reward']:.3f}"
    p = "-" if x["heldout_pass@1"] is None else f"{x['heldout_pass@1']:.3f}"
    return (f"{x['phase']:<8} {x['redis']:<7} {x['seconds']:>6.0f}s  trained "
            f"{x['trained_groups']:>6} groups ({x['groups_per_s']:>6.2f}/s, step "
            f"{x['steps']})  held-out reward {f} pass@1 {p}  starts {x['starts']} "
            f"SIGTERM {x['sigterm']} kill-9 {x['kill9']}  audit "
            f"{'OK' if x['audit_ok'] else 'FAILED'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="measured time per phase")
    ap.add_argument("--phases", default="baseline,churn")
    ap.add_argument("--cluster", action="store_true", help="a 3-master Redis Cluster")
    ap.add_argument("--every", type=float, nargs=2, default=(2.0, 5.0), metavar=("MIN", "MAX"),
                    help="seconds between churn events (uniform)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout", type=int, default=256, help="held-out prompts")
    ap.add_argument("--out", default="runs/churn")
    a = ap.parse_args()
    out = Path(a.out).resolve()
    model = init_tiny_model(out / "model", seed=0) if not (out / "model" / "config.json"
                                                           ).exists() else out / "model"
    rows = []
    for phase in a.phases.split(","):
        d = out / f"{phase}-{'cluster' if a.cluster else 'redis'}"
        if a.cluster:
            server: Any = EmbeddedCluster(d / "redis", masters=3)
        else:
            server = EmbeddedRedis(d / "redis", port=free_port(), appendonly=True)
        server.start()
        try:
            print(f"{phase}: {a.minutes} min on {'a 3-master cluster' if a.cluster else 'Redis'}",
                  flush=True)
            rows.append(run_phase(d, model, server.url, churn=phase == "churn",
                                  seconds=a.minutes * 60, every=tuple(a.every), seed=a.seed,
                                  cluster=a.cluster, heldout_n=a.heldout))
        finally:
            server.stop()
        print(line(rows[-1]), flush=True)
    (out / "report.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(line(x) for x in rows))


if __name__ == "__main__":
    main()
