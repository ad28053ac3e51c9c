"""sluice vs TRL's GRPOTrainer: learning per second and per sample on the ``copy`` task.

    .venv/bin/python benchmarks/vs_trl.py [--budget-s 600] [--beta 0] [--runs trl,s1,s0,s4]

One after the other on this machine, from the same locally built tiny model, with the
same prompts, reward, held-out set (256 prompts, greedy) and hyperparameters (64
completions per step in groups of 8, lr 1e-4 constant, AdamW, max 8 new tokens,
temperature 1, dapo, ε 0.2, ``--beta``):

* ``trl``: TRL's GRPOTrainer, synchronous, torch threads = all cores
  (``benchmarks/trl_copy.py``);
* ``s1``/``s0``/``s4``: ``sluice up examples/copy.toml`` at ``max_staleness`` 1 (the
  example's setting), 0 and 4, each role its own process on the same cores.

Each run stops at ``--target`` held-out exact match or after ``--budget-s``. Clocks start
at each run's step-0 evaluation (process start-up and imports are not counted on either
side). TRL's clock pauses while it evaluates; sluice's evaluator shares the cores, so
that cost is charged to sluice. "samples" is completions *generated*: for sluice that
includes groups the scorers filtered (all rewards equal) or the trainer dropped as stale,
because generating them cost time; TRL trains every group it generates.

Prints a table, the ratios sluice / TRL, and where each run's CPU time went (per role
for sluice, generate+score vs the rest for TRL); writes ``results.json`` in ``--out``.
Ratios, not absolute times, are the result: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from pipeline.report import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
THRESHOLDS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
ROLES = {"up": "up", "generate": "generator", "score": "scorer", "train": "trainer",
         "eval": "evaluator"}  # sluice subcommand -> role


def run_trl(a: argparse.Namespace, model: Path, out: Path) -> dict[str, Any]:
    cmd = [PY, str(ROOT / "benchmarks" / "trl_copy.py"), "--out", str(out), "--model",
           str(model), "--seed", str(a.seed), "--budget-s", str(a.budget_s),
           "--eval-every-s", str(a.eval_every_s), "--target", str(a.target),
           "--beta", str(a.beta)]
    if not a.kl_bias_correction:
        cmd.append("--no-kl-bias-correction")
    log = open(out.parent / f"{out.name}.log", "w")
    t = time.time()
    subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    log.close()
    prof = json.loads((out / "profile.json").read_text())
    evals = read_jsonl(out / "eval.jsonl")
    return {"evals": [{"t": e["t"], "samples": e["samples"], "trained": e["samples"],
                       "exact": e["exact_match"], "reward": e["reward"]} for e in evals],
            "completions_per_s": rate(evals),
            "wall_s": time.time() - t, "steps": prof["steps"],
            "profile": {"generate+score": prof["generate_and_score_s"],
                        "optimize+rest": prof["optimize_and_rest_s"]}}


def role_of(p: psutil.Process) -> str:
    """The sluice subcommand in argv (an exact token: overrides mention "trainer." too)."""
    try:
        argv, name = p.cmdline(), p.name()
    except psutil.Error:
        return "?"
    if "redis" in name:
        return "redis"
    return next((ROLES[tok] for tok in argv if tok in ROLES), "other")


def run_sluice(a: argparse.Namespace, model: Path, out: Path, staleness: int) -> dict[str, Any]:
    sets = {"run.output_dir": out, "model.path": model, "run.seed": a.seed,
            "trainer.beta": a.beta, "trainer.max_staleness": staleness,
            "trainer.kl_bias_correction": str(a.kl_bias_correction).lower(),
            "trainer.max_steps": 10**6, "run.max_time_s": a.budget_s + 60,
            "up.stop_at_eval_exact": a.target, "up.plot": "false"}
    sets.update(kv.split("=", 1) for kv in a.sluice_set)
    cmd = [str(ROOT / ".venv" / "bin" / "sluice"), "up", str(ROOT / "examples" / "copy.toml"),
           "--fresh", "--eval-every", str(a.eval_every_s)]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    log = open(out.parent / f"{out.name}.log", "w")
    t = time.time()
    proc = psutil.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    cpu: dict[int, tuple[str, float]] = {}
    t_first: float | None = None
    while proc.poll() is None:
        for p in [proc, *proc.children(recursive=True)]:
            try:
                ct = p.cpu_times()
                cpu[p.pid] = (cpu.get(p.pid, ("", 0.0))[0] or role_of(p), ct.user + ct.system)
            except psutil.Error:
                pass
        evals = read_jsonl(out / "eval.jsonl")
        if evals and t_first is None:
            t_first = evals[0]["ts"]
        if t_first is not None and time.time() - t_first > a.budget_s + 5:
            proc.terminate()  # the budget is counted from the step-0 eval, like TRL's
        time.sleep(1.0)
    log.close()
    evals = read_jsonl(out / "eval.jsonl")
    metrics = read_jsonl(out / "metrics.jsonl")
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() \
        else {}
    group = 8
    generated = {m["step"]: (m["step"] * 8 + m.get("filtered", 0) + m.get("dropped_stale", 0))
                 * group for m in metrics}
    t0 = evals[0]["ts"] if evals else 0.0
    rows = [{"t": e["ts"] - t0, "samples": generated.get(e["step"], 0),
             "trained": e["step"] * 8 * group, "exact": e["exact_match"], "reward": e["reward"]}
            for e in evals if e["ts"] - t0 <= a.budget_s + 1e-6]
    by_role: dict[str, float] = {}
    for role, sec in cpu.values():
        by_role[role] = by_role.get(role, 0.0) + sec
    return {"evals": rows, "completions_per_s": rate(rows),
            "wall_s": time.time() - t, "profile": by_role,
            "dropped_stale": summary.get("dropped_stale"), "filtered": summary.get("filtered")}


def rate(evals: list[dict[str, Any]]) -> float | None:
    """Completions generated per second of the run's clock, at its last evaluation."""
    last = evals[-1] if evals else None
    return last["samples"] / last["t"] if last and last["t"] > 0 else None


def first_reaching(evals: list[dict[str, Any]], thr: float,
                   key: str = "exact") -> dict[str, Any] | None:
    return next((e for e in evals if e[key] >= thr), None)


def fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def common_threshold(res: dict[str, dict[str, Any]], key: str, label: str) -> list[str]:
    """Time and samples to the highest held-out ``key`` threshold that every run reached,
    and their ratios to TRL: the comparison that exists even when 0.9 is out of reach."""
    common = next((thr for thr in THRESHOLDS
                   if all(first_reaching(r["evals"], thr, key) for r in res.values())), None)
    if common is None:
        return [f"no held-out {label} threshold reached by every run"]
    lines = [f"highest held-out {label} reached by every run: {common}"]
    base = first_reaching(res["trl"]["evals"], common, key) if "trl" in res else None
    for n, r in res.items():
        hit = first_reaching(r["evals"], common, key)
        assert hit is not None
        ratio = "" if base is None or n == "trl" else (
            f"   / TRL: time {hit['t'] / max(base['t'], 1e-9):.2f}, "
            f"samples {hit['samples'] / max(base['samples'], 1):.2f}")
        trained = f"  trained={hit['trained']:>7}" if "trained" in hit else ""
        lines.append(f"  {n:<6} t={hit['t']:7.1f}s  samples={hit['samples']:>8}{trained}{ratio}")
    return lines


def report(res: dict[str, dict[str, Any]], target: float) -> list[str]:
    lines = []
    names = list(res)
    hdr = (f"{'run':<6} {'evals':>5} {'best exact':>10} {'final exact':>11} {'final reward':>12}"
           f" {'t->' + str(target):>8} {'samples->' + str(target):>13} {'completions/s':>13}")
    lines += [hdr, "-" * len(hdr)]
    for n in names:
        ev = res[n]["evals"]
        hit = first_reaching(ev, target)
        lines.append(
            f"{n:<6} {len(ev):>5} {max((e['exact'] for e in ev), default=0):>10.3f} "
            f"{ev[-1]['exact'] if ev else 0:>11.3f} {ev[-1]['reward'] if ev else 0:>12.3f} "
            f"{fmt(hit and hit['t']):>8} {fmt(hit and hit['samples']):>13} "
            f"{fmt(res[n]['completions_per_s'], '.0f'):>13}")
    for key, label in (("exact", "exact match"), ("reward", "reward")):
        lines += ["", *common_threshold(res, key, label)]
    if "trl" in res and res["trl"]["completions_per_s"]:
        lines.append("completions/s ratio (sluice / TRL): " + "  ".join(
            f"{n} {r['completions_per_s'] / res['trl']['completions_per_s']:.2f}"
            for n, r in res.items() if n != "trl" and r["completions_per_s"]))
    lines.append("")
    marks = [60, 120, 180, 300, 420, 600, 900]
    smarks = [20_000, 50_000, 100_000, 150_000, 200_000]
    for key, label in (("exact", "exact match"), ("reward", "reward")):
        lines.append(f"held-out {label} (best so far) at equal wall time (s):")
        lines.append("  run   " + "".join(f"{m:>7}" for m in marks))
        for n, r in res.items():
            ev = r["evals"]
            cells = [max((e[key] for e in ev if e["t"] <= m), default=None)
                     if any(e["t"] >= m - 1 for e in ev) else None for m in marks]
            lines.append(f"  {n:<6}" + "".join(f"{fmt(c, '.3f'):>7}" for c in cells))
        lines.append(f"held-out {label} (best so far) at equal samples generated (thousands):")
        lines.append("  run   " + "".join(f"{m // 1000:>7}" for m in smarks))
        for n, r in res.items():
            ev = r["evals"]
            cells = [max((e[key] for e in ev if e["samples"] <= m), default=None)
                     if any(e["samples"] >= m for e in ev) else None for m in smarks]
            lines.append(f"  {n:<6}" + "".join(f"{fmt(c, '.3f'):>7}" for c in cells))
    lines.append("")
    lines.append("where the time went (sluice: CPU seconds per role process; "
                 "TRL: wall seconds per phase, each phase using every core):")
    for n, r in res.items():
        tot = sum(r["profile"].values()) or 1.0
        parts = sorted(r["profile"].items(), key=lambda kv: -kv[1])
        lines.append(f"  {n:<6} " + ", ".join(f"{k} {v:.0f}s ({v / tot:.0%})" for k, v in parts))
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_vs_trl")
    p.add_argument("--runs", default="trl,s1,s0,s4",
                   help="comma list of trl, s<max_staleness> (e.g. s0, s4)")
    p.add_argument("--budget-s", type=float, default=600.0)
    p.add_argument("--eval-every-s", type=float, default=10.0)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--kl-bias-correction", action=argparse.BooleanOptionalAction,
                   default=True, help="TRL's use_bias_correction_kl, on both sides")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sluice-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra `sluice up --set` for every sluice run (e.g. trainer.is_mode=...)")
    p.add_argument("--report-only", action="store_true",
                   help="print the report of an earlier run from OUT/results.json")
    a = p.parse_args()
    if a.report_only:
        saved = json.loads((a.out / "results.json").read_text())
        print("\n".join(report(saved["runs"], float(saved["args"]["target"]))))
        return
    a.out.mkdir(parents=True, exist_ok=True)
    model = a.out / "model"
    if not (model / "config.json").exists():
        from pipeline.model import init_tiny_model

        init_tiny_model(model, seed=a.seed)
    res: dict[str, dict[str, Any]] = {}
    for name in a.runs.split(","):
        print(f"== {name} (budget {a.budget_s:.0f}s, beta {a.beta}) ...", flush=True)
        out = a.out / name
        if name == "trl":
            res[name] = run_trl(a, model, out)
        elif name.startswith("s") and name[1:].isdigit():
            shutil.rmtree(out, ignore_errors=True)  # no stale eval.jsonl to misread
            out.mkdir(parents=True)
            res[name] = run_sluice(a, model, out, int(name[1:]))
        else:
            raise SystemExit(f"unknown run {name!r}: use trl or s<max_staleness>")
        ev = res[name]["evals"]
        print(f"   {len(ev)} evals, best exact {max((e['exact'] for e in ev), default=0):.3f}",
              flush=True)
    print(f"\ncpus={os.cpu_count()} budget={a.budget_s:.0f}s beta={a.beta} "
          f"kl_bias_correction={a.kl_bias_correction} target={a.target}")
    lines = report(res, a.target)
    print("\n".join(lines))
    (a.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in
                                                             vars(a).items()}, "runs": res},
                                                   indent=1))


if __name__ == "__main__":
    main()
