"""sluice vs TRL's GRPOTrainer on the ``copy`` task: time and samples to a held-out target.

    .venv/bin/python benchmarks/vs_trl.py --arms trl,s1 --seeds 0,1,2 [--budget-s 480]
    .venv/bin/python benchmarks/vs_trl.py --arms s1,keep --arm keep=scoring.zero_variance=train
    .venv/bin/python benchmarks/vs_trl.py --out runs/bench_vs_trl --report-only

One run at a time on this machine, from the same locally built tiny model (one per seed),
with the same prompts, reward, held-out set (256 prompts, greedy exact match) and
hyper-parameters on both sides: 64 completions per step in groups of 8, lr 1e-4 constant,
AdamW betas (0.9, ``--adam-beta2``), no weight decay, grad-norm clip 1, at most 8 new
tokens, temperature 1, dapo, ε 0.2, ``--beta``.

Arms:

* ``trl``: TRL's ``GRPOTrainer`` (``benchmarks/trl_copy.py``), synchronous, at its
  fastest torch thread count: unless ``--trl-threads`` is given, a probe first runs TRL
  for ``--probe-s`` seconds of training at 1 and at 2 threads (seed 0, both printed) and
  the faster is used for every seed. ``trl1``/``trl2`` force a thread count; ``trl#2``
  runs TRL again on the same seeds, so the report shows how far two runs of one seed
  land apart (TRL is not bit-reproducible across runs: thread scheduling).
* ``s<N>``: ``sluice up examples/copy.toml`` at ``trainer.max_staleness`` N with the
  example's other settings (``--set`` overrides from ``--sluice-set`` apply to every
  sluice arm).
* ``none``, ``ent``, ``b08`` and their TRL twins ``trl-none``, ``trl-ent``, ``trl-b08``:
  the ablations of `ABLATIONS` (rewards not scaled by the group std, adaptive entropy
  control, AdamW β1 0.8), the same change on both sides.
* ``--arm NAME=key=value;key=value``: a sluice arm with its own ``--set`` overrides on
  top of s1's (an ablation, e.g. ``keep=scoring.zero_variance=train``);
  ``--arm NAME=trl:field=value`` a TRL arm with ``GRPOConfig`` fields.

Runs go seed by seed, the arms interleaved and their order reversed on every other seed
(ABBA, `run_order`). The ablation screen as one command, resumable (a finished run is
saved at once; rerun the same command after an interruption):

    .venv/bin/python benchmarks/vs_trl.py --arms trl,s1,s0,none,trl-none,ent,trl-ent \
        --seeds 0,1,2 --budget-s 300 --out runs/bench_ablation \
        --results benchmarks/results/ablation.json

Each run stops at ``--target`` held-out exact match or after ``--budget-s``. Clocks start
at each run's step-0 evaluation (imports and start-up are not counted on either side).
TRL's clock pauses while it evaluates; sluice's evaluator shares the cores, so that cost
is charged to sluice. "samples" are completions *generated*: for sluice that includes
groups filtered (all rewards equal) or dropped stale. Results are saved after every run
in ``OUT/results.json``; a run already there is not repeated (``--redo`` to force).

The same comparison on SmolLM2-135M-Instruct and the ``compare`` task, with vLLM
generation on sluice's side: ``benchmarks/vs_trl_real.py`` (it reuses this module's
process watching, thread probe and result reading).

The report (`benchmarks/vs_trl_report.py`) gives the area under each run's held-out
reward curve against time and against samples with 95% Student-t intervals over seeds
(and paired with TRL's on the same seeds), each seed's curve at fixed times and sample
counts, per threshold how many seeds reached it and the median and range of time,
samples and steps to it, and the mechanism table: entropy, clip and IS-truncation
fractions, zero-variance groups, grad norms, the behaviour-vs-trained logprob distance
and staleness over each run's first and last quarter, with step and sample rates.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script (the docstring's commands) or with -m

from benchmarks.vs_trl_report import (  # noqa: E402
    binned,
    common_samples,
    first,
    mechanism,
    report,
)
from sluice.report import read_jsonl  # noqa: E402

PY = sys.executable
ROLES = {"up": "up", "generate": "generator", "score": "scorer", "train": "trainer",
         "eval": "evaluator"}  # sluice subcommand -> role


def common_args(a: argparse.Namespace) -> dict[str, Any]:
    return {"beta": a.beta, "lr": a.lr, "adam_beta2": a.adam_beta2}


def run_trl(a: argparse.Namespace, model: Path, out: Path, seed: int, threads: int,
            budget_s: float, config: dict[str, str] | None = None) -> dict[str, Any]:
    """One TRL run; ``config``: ``GRPOConfig`` fields over ``trl_copy.py``'s (an
    ablation arm's)."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [PY, str(ROOT / "benchmarks" / "trl_copy.py"), "--out", str(out), "--model",
           str(model), "--seed", str(seed), "--budget-s", str(budget_s),
           "--eval-every-s", str(a.eval_every_s), "--target", str(a.target),
           "--threads", str(threads), "--beta", str(a.beta), "--lr", str(a.lr),
           "--adam-beta2", str(a.adam_beta2)]
    for k, v in (config or {}).items():
        cmd += ["--config", f"{k}={v}"]
    with open(out / "run.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    return trl_result(out, threads)


def parts_of(row: dict[str, Any]) -> dict[str, float]:
    """An eval row's figures a report may pick as its "reward" later (`pick_metric`):
    pass@1, the total reward and each reward's own mean."""
    return {k: v for k, v in row.items() if k in ("pass@1", "reward") or k.startswith("rewards/")}


def pick_metric(res: dict[str, dict[str, dict[str, Any]]], metric: str) -> None:
    """Make every stored eval row's "reward" the figure ``metric`` (rows saved with their
    `parts_of`; older rows keep theirs), so one set of runs is reported by any metric."""
    for seeds in res.values():
        for r in seeds.values():
            for e in r.get("evals", []):
                if metric in e.get("parts", {}):
                    e["reward"] = e["parts"][metric]


def trl_result(out: Path, threads: int, metric: str = "reward") -> dict[str, Any]:
    """A finished TRL run (``trl_copy.py`` or ``trl_real.py``) as a results entry: its
    eval rows (the report's "reward" = the eval row's ``metric``), mechanism metrics,
    steps, steps per second of training clock and the generation/optimization split of
    that clock."""
    prof = json.loads((out / "profile.json").read_text())
    evals = read_jsonl(out / "eval.jsonl")
    rows = read_jsonl(out / "metrics.jsonl")
    return {"evals": [{"t": e["t"], "samples": e["samples"], "step": e["step"],
                       "exact": e["pass@1"], "reward": e[metric], "parts": parts_of(e)}
                      for e in evals],
            "mech": mechanism(rows), "series": binned(rows),
            "steps": prof["steps"], "steps_per_s": prof["steps"] / max(prof["train_clock_s"], 1e-9),
            "threads": threads,
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
    if name.startswith("VLLM") or (argv and ("vllm" in argv[0] or argv[0].startswith("VLLM"))):
        return "vllm"  # a server `sluice up` launched, its engine and workers (vs_trl_real)
    return next((ROLES[tok] for tok in argv if tok in ROLES), "other")


def watch(proc: psutil.Popen, tick: Callable[[], bool], every_s: float = 1.0,
          stop_signal: int = signal.SIGTERM) -> dict[str, float]:
    """Until ``proc`` exits: every ``every_s`` sample the CPU seconds of it and all its
    descendants, then call ``tick``, which returns True to stop the run (``proc`` gets
    ``stop_signal``, once: SIGTERM stops `sluice up` at once, SIGINT ends it in order,
    its final version evaluated). CPU seconds per role (`role_of`), summed over
    processes."""
    cpu: dict[int, tuple[str, float]] = {}
    stopped = False
    while proc.poll() is None:
        for p in [proc, *proc.children(recursive=True)]:
            try:
                ct = p.cpu_times()
                cpu[p.pid] = (cpu.get(p.pid, ("", 0.0))[0] or role_of(p), ct.user + ct.system)
            except psutil.Error:
                pass
        if not stopped and tick():
            proc.send_signal(stop_signal)
            stopped = True
        time.sleep(every_s)
    by_role: dict[str, float] = {}
    for role, sec in cpu.values():
        by_role[role] = by_role.get(role, 0.0) + sec
    return by_role


def run_sluice(a: argparse.Namespace, model: Path, out: Path, seed: int,
               overrides: dict[str, str]) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)  # no stale eval.jsonl to misread
    out.mkdir(parents=True)
    sets: dict[str, Any] = {
        "run.output_dir": out, "model.path": model, "run.seed": seed, "trainer.beta": a.beta,
        "trainer.lr": a.lr, "trainer.adam_betas": f"[0.9,{a.adam_beta2}]",
        "trainer.max_steps": 10**6, "run.max_time_s": a.budget_s + 60,
        "up.stop_at": f"pass@1>={a.target}", "up.plot": "false"}
    sets.update(kv.split("=", 1) for kv in a.sluice_set)
    sets.update(overrides)
    cmd = [str(ROOT / ".venv" / "bin" / "sluice"), "up", str(ROOT / "examples" / "copy.toml"),
           "--fresh", "--eval-every", str(a.eval_every_s)]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    t_first: list[float] = []

    def tick() -> bool:  # the budget is counted from the step-0 eval, like TRL's
        if not t_first and (evals := read_jsonl(out / "eval.jsonl")):
            t_first.append(evals[0]["ts"])
        return bool(t_first) and time.time() - t_first[0] > a.budget_s

    with open(out.parent / f"{out.name}.log", "w") as log:  # SIGINT: the final version
        by_role = watch(psutil.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT),
                        tick, stop_signal=signal.SIGINT)  # is evaluated, as TRL's end is
    evals = read_jsonl(out / "eval.jsonl")
    metrics = read_jsonl(out / "metrics.jsonl")
    generated = generated_samples(metrics, groups_per_step=8, group=8)  # copy.toml's
    t0 = evals[0]["ts"] if evals else 0.0
    rows = [{"t": e["ts"] - t0, "samples": generated.get(e["step"], 0), "step": e["step"],
             "exact": e["pass@1"], "reward": e["reward"], "parts": parts_of(e)}
            for e in evals if e["ts"] - t0 <= a.budget_s + 1e-6]
    if evals and evals[-1]["ts"] - t0 > a.budget_s + 1e-6:  # the orderly end's evaluation
        e = evals[-1]  # of the weights at the budget's end (+ the step in hand), at its mark
        rows.append({"t": a.budget_s, "samples": generated.get(e["step"], 0),
                     "step": e["step"], "exact": e["pass@1"], "reward": e["reward"],
                     "parts": parts_of(e)})
    last = metrics[-1] if metrics else {}
    late = [m for m in metrics if m["step"] >= 0.8 * last.get("step", 0)] or [{}]
    return {"evals": rows, "steps": last.get("step", 0), "profile": by_role,
            "mech": mechanism(metrics), "series": binned(metrics),
            "steps_per_s": last.get("step", 0) / max(rows[-1]["t"], 1e-9) if rows else None,
            "late": {k: statistics.fmean(vals) for k in ("entropy", "grad_norm",
                                                          "staleness_mean")
                     if (vals := [m[k] for m in late if k in m and m[k] == m[k]])},
            "filtered": last.get("filtered", 0), "dropped_stale": last.get("dropped_stale", 0)}


def generated_samples(metrics: list[dict[str, Any]], groups_per_step: int, group: int
                      ) -> dict[int, int]:
    """Completions generated by the time each trainer step ended (metrics.jsonl rows):
    those trained plus those of groups filtered (all rewards equal) or dropped stale."""
    return {m["step"]: (m["step"] * groups_per_step + m.get("filtered", 0)
                        + m.get("dropped_stale", 0)) * group for m in metrics}


def probe_trl_threads(a: argparse.Namespace, model: Path) -> tuple[int, dict[int, float]]:
    """TRL's training steps per second at 1 and 2 torch threads (seed 0, ``--probe-s``
    of training each, no target); the faster count is TRL's best setting here."""
    return probe_fastest(lambda threads: run_trl(
        argparse.Namespace(**{**vars(a), "target": 2.0}), model,
        a.out / f"probe-trl{threads}", 0, threads, a.probe_s), (1, 2))


def probe_fastest(run: Callable[[Any], dict[str, Any]], settings: Sequence[Any]
                  ) -> tuple[Any, dict[Any, float]]:
    """``run(setting)`` (a short TRL run) for each setting: the fastest by training steps
    per second, and every setting's rate."""
    rates = {}
    for setting in settings:
        print(f"== probe: TRL at {setting}", flush=True)
        rates[setting] = run(setting)["steps_per_s"]
        print(f"   {rates[setting]:.4f} steps/s", flush=True)
    return max(rates, key=lambda t: rates[t]), rates


ABLATIONS: dict[str, tuple[dict[str, str], dict[str, str]]] = {
    "none": ({"scoring.scale_rewards": "none"}, {"scale_rewards": "none"}),
    "ent": ({"trainer.adaptive_entropy": "true"}, {"use_adaptive_entropy": "True"}),
    "b08": ({"trainer.adam_betas": "[0.8,0.99]"}, {"adam_beta1": "0.8"}),
}
"""The ablations at TRL's settings, each on both sides: arm ``X`` is sluice (staleness
1, the example's) with the first overrides (``sluice up --set``), ``trl-X`` is TRL with
the second (``GRPOConfig`` fields): rewards not scaled by the group's std (Dr. GRPO),
adaptive entropy control (TRL 1.16's defaults: target 0.2, step 0.005, from 0), AdamW
β1 0.8. ``s0`` (staleness 0) has no TRL twin: TRL is synchronous already."""


@dataclasses.dataclass(frozen=True)
class Arm:
    """A run recipe: TRL (``trl`` set: its ``GRPOConfig`` overrides; ``threads`` 0 = the
    probed count) or sluice (``sets``: ``sluice up --set`` overrides on top of s1's)."""

    sets: dict[str, str] | None = None
    trl: dict[str, str] | None = None
    threads: int = 0


def parse_arms(a: argparse.Namespace) -> dict[str, Arm]:
    """Arm name -> recipe: ``trl``, ``trl1``/``trl2`` (a thread count), ``trl#N`` (TRL
    again on the same seeds: the noise), ``s<N>`` (staleness N), ``sluice`` (the example
    as it is), an `ABLATIONS` name or ``trl-<name>``, or one ``--arm NAME=K=V;K=V``
    (sluice overrides; ``NAME=trl:K=V;K=V`` for TRL ``GRPOConfig`` fields)."""
    custom: dict[str, Arm] = {}
    for spec in a.arm:
        name, _, sets = spec.partition("=")
        is_trl = sets.startswith("trl:")
        pairs = dict(kv.split("=", 1) for kv in sets.removeprefix("trl:").split(";") if kv)
        custom[name] = Arm(trl=pairs) if is_trl else Arm(sets=pairs)
    arms: dict[str, Arm] = {}
    for name in a.arms.split(","):
        if name in custom:
            arms[name] = custom[name]
        elif name == "trl" or name.startswith("trl#"):
            arms[name] = Arm(trl={})
        elif name in ("trl1", "trl2"):
            arms[name] = Arm(trl={}, threads=int(name[3]))
        elif name.startswith("trl-") and name[4:] in ABLATIONS:
            arms[name] = Arm(trl=ABLATIONS[name[4:]][1])
        elif name in ABLATIONS:
            arms[name] = Arm(sets=ABLATIONS[name][0])
        elif name == "sluice":
            arms[name] = Arm(sets={})  # the example as it is (vs_trl_real.py)
        elif name.startswith("s") and name[1:].isdigit():
            arms[name] = Arm(sets={"trainer.max_staleness": name[1:]})
        else:
            raise SystemExit(f"unknown arm {name!r}: trl, trl1, trl2, trl#N, sluice, s<N>, "
                             f"{', '.join(ABLATIONS)}, trl-<ablation> or one --arm names")
    return arms


def run_order(arms: Sequence[str], seeds: Sequence[int]) -> list[tuple[str, int]]:
    """(arm, seed) runs, the arms interleaved within each seed and their order reversed
    on every other seed (ABBA: A B C, C B A, A B C, ...), so slow drift of the machine
    (thermal, neighbours) falls on every arm alike instead of on whichever ran last."""
    order = []
    for i, seed in enumerate(seeds):
        order += [(name, seed) for name in (arms if i % 2 == 0 else list(reversed(arms)))]
    return order


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_vs_trl")
    p.add_argument("--results", type=Path, default=None,
                   help="the results file (default OUT/results.json): every finished run "
                        "with its curves and mechanism series; runs in it are not repeated")
    p.add_argument("--arms", default="trl,s1")
    p.add_argument("--arm", action="append", default=[], metavar="NAME=K=V;K=V")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--auc-samples", type=float, default=0.0,
                   help="area under the held-out reward curve over [0, this] samples; "
                        "0 = the window every run covers (vs_trl_report.common_samples)")
    p.add_argument("--budget-s", type=float, default=480.0)
    p.add_argument("--probe-s", type=float, default=45.0)
    p.add_argument("--trl-threads", type=int, default=0, help="0 = probe 1 and 2")
    p.add_argument("--eval-every-s", type=float, default=10.0)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--adam-beta2", type=float, default=0.99)
    p.add_argument("--sluice-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra `sluice up --set` for every sluice arm")
    p.add_argument("--redo", action="store_true", help="repeat runs already in results.json")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--report-arms", default="",
                   help="with --report-only: report only these arms (comma-separated), "
                        "so the samples window and the mechanism's steps are theirs")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.results or a.out / "results.json"
    saved = json.loads(path.read_text()) if path.exists() else {"runs": {}}
    res: dict[str, dict[str, dict[str, Any]]] = saved["runs"]
    if a.report_only:
        res = select_arms(res, a.report_arms)
        print(f"settings: {saved.get('args')}\n"
              + "\n".join(report(res, a.target, a.budget_s,
                                  a.auc_samples or common_samples(res, a.target) or 1000)))
        return
    arms = parse_arms(a)
    seeds = [int(s) for s in a.seeds.split(",")]
    threads = a.trl_threads or int(saved.get("trl_threads", 0))
    todo = [(n, s) for n, s in run_order(list(arms), seeds)
            if a.redo or str(s) not in res.get(n, {})]
    if not threads and any(arms[n].trl is not None and not arms[n].threads for n, _ in todo):
        threads, rates = probe_trl_threads(a, model_for(a, 0))
        saved["trl_threads_probe"] = {str(k): v for k, v in rates.items()}
        saved["trl_threads"] = threads  # a resumed run keeps the probed count
    for i, (name, seed) in enumerate(todo):
        arm = arms[name]
        print(f"== [{i + 1}/{len(todo)}] {name} seed {seed} (budget {a.budget_s:.0f}s)",
              flush=True)
        model, out = model_for(a, seed), a.out / f"{name}-seed{seed}"
        if arm.trl is not None:
            r = run_trl(a, model, out, seed, arm.threads or threads, a.budget_s, arm.trl)
        else:
            r = run_sluice(a, model, out, seed, arm.sets or {})
        r["sets"] = arm.sets if arm.trl is None else {"trl": arm.trl}
        r["machine"] = machine()
        res.setdefault(name, {})[str(seed)] = r
        best = max((e["exact"] for e in r["evals"]), default=0.0)
        hit = first(r["evals"], a.target)
        at = "not reached" if hit is None else f"reached at {hit['t']:.0f}s"
        print(f"   best exact {best:.3f}; target {at}", flush=True)
        saved["args"] = {"cpus": os.cpu_count(), **common_args(a),
                         "budget_s": a.budget_s, "target": a.target,
                         "sluice_set": a.sluice_set}
        save_results(path, saved)
    print(f"\ncpus={os.cpu_count()} {common_args(a)} target={a.target} "
          f"TRL threads={threads or '-'} probe={saved.get('trl_threads_probe')}")
    print("\n".join(report(res, a.target, a.budget_s,
                                  a.auc_samples or common_samples(res, a.target) or 1000)))


def save_results(path: Path, saved: dict[str, Any]) -> None:
    """``saved`` as ``path``'s JSON, written beside it and renamed over it: a kill
    mid-write leaves the last good file (benchmarks that resume read it back)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(saved, indent=1))
    tmp.replace(path)


def select_arms(res: dict[str, dict[str, dict[str, Any]]], spec: str
                ) -> dict[str, dict[str, dict[str, Any]]]:
    """The arms named in ``spec`` (comma-separated, in that order; all when empty). The
    report's samples window and mechanism steps are then those of these arms' runs only.
    An unknown name is an error that lists the arms there are."""
    if not spec:
        return res
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if missing := [n for n in names if n not in res]:
        raise SystemExit(f"--report-arms: no runs of {', '.join(missing)} in the results "
                         f"(arms there: {', '.join(res)})")
    return {n: res[n] for n in names}


def machine() -> str:
    """The CPU model and core count a run had (results gathered over several sessions
    may come from different machines; the report should say which)."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cpus"


def model_for(a: argparse.Namespace, seed: int) -> Path:
    """The tiny model of one seed, built once and shared by every arm."""
    model = a.out / f"model-seed{seed}"
    if not (model / "config.json").exists():
        from pipeline.model import init_tiny_model

        init_tiny_model(model, seed=seed)
    return model


if __name__ == "__main__":
    main()
