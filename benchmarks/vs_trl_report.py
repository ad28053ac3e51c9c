"""The report of ``benchmarks/vs_trl.py`` and ``benchmarks/vs_trl_real.py``: thresholds,
areas under the learning curves with Student-t intervals over seeds (`benchmarks.curves`),
per-seed curves against time and samples, and the mechanism table (what each run's own
metrics say about how it learned)."""

from __future__ import annotations

import math
import statistics
from typing import Any

from benchmarks.curves import area, curve, mean_ci, paired_ci, sign_flip_p, value_at

EXACT_TARGETS = (0.2, 0.5)  # secondary, below --target
REWARD_TARGETS = (0.6, 0.7, 0.8, 0.9)
Results = dict[str, dict[str, dict[str, Any]]]  # arm -> seed -> run

# metrics read from each run's metrics rows (sluice: metrics.jsonl; TRL: its logs), with
# the name printed; TRL's own names where they exist
MECHANISM = [("entropy", "H"), ("clip_ratio/region_mean", "clip"),
             ("is_ratio/outside_frac", "IS_out"), ("frac_reward_zero_std", "flat"),
             ("grad_norm", "|g|"), ("logprob_diff/mean_abs", "dlogp"),
             ("staleness_mean", "stale"), ("is_ratio/min", "IS_min"),
             ("is_ratio/max", "IS_max"), ("sampling/sampler_mass", "mass")]


def common_samples(res: Results, target: float) -> float:
    """The samples window every run covers: the smallest final sample count over the
    runs, leaving out runs that reached ``target`` (they stopped because they were done,
    so holding their last value is a measurement, not an extrapolation). Areas against
    samples taken past a run's end would hold that run flat over samples it never drew.
    0 when no run has an evaluation."""
    ends = [max(e["samples"] for e in r["evals"]) for seeds in res.values()
            for r in seeds.values() if r.get("evals")
            and max(e.get("exact", 0.0) for e in r["evals"]) < target]
    return float(min(ends)) if ends else 0.0


def first(evals: list[dict[str, Any]], thr: float, key: str = "exact") -> dict[str, Any] | None:
    return next((e for e in evals if e[key] >= thr), None)


def mechanism(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each `MECHANISM` metric's mean over the first and the last quarter of a run's
    logged steps (NaN-aware; absent metrics omitted), and the run's steps."""
    rows = [r for r in rows if "step" in r and any(k in r for k, _ in MECHANISM)]
    if not rows:
        return {}
    n = max(1, len(rows) // 4)
    out: dict[str, dict[str, float]] = {}
    for phase, part in (("early", rows[:n]), ("late", rows[-n:])):
        vals = {}
        for key, _ in MECHANISM:
            xs = [float(r[key]) for r in part if isinstance(r.get(key), int | float)
                  and not math.isnan(float(r[key]))]
            if xs:
                vals[key] = statistics.fmean(xs)
        out[phase] = vals
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("inf")


def span(xs: list[float], spec: str) -> str:
    """``median [min-max]``; a seed that never reached the threshold shows as ``never``."""
    if med(xs) == float("inf"):
        return "-"
    if len(xs) == 1:
        return format(xs[0], spec)
    hi = max(xs)
    hi_s = "never" if hi == float("inf") else format(hi, spec)
    return f"{format(med(xs), spec)} [{format(min(xs), spec)}-{hi_s}]"


def arm_hits(runs: list[dict[str, Any]], thr: float, key: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"t": [], "samples": [], "step": []}
    for r in runs:
        hit = first(r["evals"], thr, key)
        for k in out:
            out[k].append(float("inf") if hit is None else float(hit[k]))
    return out


def thresholds(res: dict[str, dict[str, dict[str, Any]]], target: float) -> list[str]:
    """Time, samples and steps to each held-out threshold, per arm (median [min-max])."""
    lines: list[str] = []
    base_arm = next((n for n in res if n.startswith("trl")), None)
    rows = [("exact", target)] + [("exact", t) for t in EXACT_TARGETS if t < target] + \
        [("reward", t) for t in REWARD_TARGETS]
    for key, thr in rows:
        lines.append(f"held-out {'greedy exact match' if key == 'exact' else 'reward'} >= "
                     f"{thr}: median [min-max] over seeds")
        hdr = (f"  {'arm':<10} {'reached':>7} {'time s':>22} {'samples':>26} {'steps':>20}"
               f" {'time/TRL':>9} {'samples/TRL':>11}")
        lines += [hdr, "  " + "-" * (len(hdr) - 2)]
        base = arm_hits(list(res[base_arm].values()), thr, key) if base_arm else None
        for name, seeds in res.items():
            h = arm_hits(list(seeds.values()), thr, key)
            reached = sum(x != float("inf") for x in h["t"])
            rt = rs = "-"
            if base and name != base_arm and med(h["t"]) < float("inf") > med(base["t"]):
                rt = f"{med(h['t']) / med(base['t']):.2f}"
                rs = f"{med(h['samples']) / med(base['samples']):.2f}"
            lines.append(f"  {name:<10} {reached:>3}/{len(seeds):<3} {span(h['t'], '.0f'):>22} "
                         f"{span(h['samples'], '.0f'):>26} {span(h['step'], '.0f'):>20} "
                         f"{rt:>9} {rs:>11}")
        lines.append("")
    return lines


def best_at_samples(res: dict[str, dict[str, dict[str, Any]]], samples: float) -> list[str]:
    """Each run's best held-out value so far at 1/3, 2/3, 1, 4/3 and 2 x ``samples``."""
    lines: list[str] = []
    marks = [int(samples * f) for f in (1 / 3, 2 / 3, 1, 4 / 3, 2)]
    for key in ("reward", "exact"):
        lines.append(f"held-out {key} (best so far) at equal samples generated (thousands); "
                     "'-' = the run ended before")
        lines.append(f"  {'arm':<10} {'seed':>4}" + "".join(f"{m / 1000:>7.3g}" for m in marks))
        for name, seeds in res.items():
            for seed, r in seeds.items():
                ev = r["evals"]
                cells = [max((e[key] for e in ev if e["samples"] <= m), default=None)
                         if any(e["samples"] >= m for e in ev) else None for m in marks]
                lines.append(f"  {name:<10} {seed:>4}" + "".join(
                    f"{'-' if c is None else format(c, '.3f'):>7}" for c in cells))
        lines.append("")
    return lines


def per_run(res: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    lines: list[str] = []
    lines.append("per run: seed, best exact, steps, steps/s, late entropy / grad norm "
                 "(last 20% of steps), filtered, stale; CPU seconds per role (sluice) or "
                 "wall seconds per phase (TRL)")
    for name, seeds in res.items():
        for seed, r in seeds.items():
            late = r.get("late", {})
            best = max((e["exact"] for e in r["evals"]), default=0.0)
            prof = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r["profile"].items(),
                                                                key=lambda kv: -kv[1]))
            lines.append(
                f"  {name:<10} {seed:>3} best {best:.3f}  {r['steps']:>5} steps "
                f"{r.get('steps_per_s') or 0:5.2f}/s  H {late.get('entropy', float('nan')):.3f}"
                f"  |g| {late.get('grad_norm', float('nan')):6.2f}  filtered "
                f"{r.get('filtered', 0):>6} stale {r.get('dropped_stale', 0):>5}  ({prof})")
    return lines


def areas(res: Results, budget_s: float, samples: float) -> list[str]:
    """Area under the held-out reward curve (its mean over the span) against time
    ([0, budget_s]) and against samples ([0, samples]): per arm the mean over seeds with
    a 95% Student-t interval, and against the baseline arm (TRL's, else the first) the
    paired difference (same seeds) with its t interval and the exact sign-flip p-value
    (`benchmarks.curves`)."""
    lines = ["area under the held-out reward curve = its mean over the span; 95% t intervals "
             "over seeds (none with one seed); 'vs' pairs the seeds, p = exact sign-flip "
             "test (its floor is 2/2^seeds)"]
    base = next((n for n in res if n.startswith("trl")), next(iter(res), None))
    for x, span_x, unit in (("t", budget_s, "s"), ("samples", samples, "samples")):
        lines.append(f"  against {unit}, over [0, {span_x:g}]:")
        per_arm = {name: {seed: area(curve(r["evals"], x, "reward"), span_x)
                          for seed, r in seeds.items()} for name, seeds in res.items()}
        for name, by_seed in per_arm.items():
            m, lo, hi = mean_ci(list(by_seed.values()))
            row = f"    {name:<10} {m:.3f} [{lo:.3f}, {hi:.3f}] over {len(by_seed)} seeds"
            if base and name != base:
                common = sorted(set(by_seed) & set(per_arm[base]))
                if common:
                    a = [by_seed[s] for s in common]
                    b = [per_arm[base][s] for s in common]
                    d, dlo, dhi = paired_ci(a, b)
                    p = sign_flip_p([x - y for x, y in zip(a, b, strict=True)])
                    row += (f"   vs {base}: {d:+.3f} [{dlo:+.3f}, {dhi:+.3f}] p={p:.3g} "
                            f"({len(common)} seeds)")
            lines.append(row)
    return [*lines, ""]


def per_seed_curves(res: Results, budget_s: float, samples: float) -> list[str]:
    """Each run's held-out reward at fixed times and at fixed sample counts."""
    lines = []
    for x, span_x, unit in (("t", budget_s, "s"), ("samples", samples, "k samples")):
        marks = [span_x * i / 6 for i in range(1, 7)]
        scale = 1000 if x == "samples" else 1
        lines.append(f"held-out reward against {unit} (the curve, interpolated)")
        lines.append(f"  {'arm':<10} {'seed':>4}" + "".join(f"{m / scale:>8.3g}" for m in marks))
        for name, seeds in res.items():
            for seed, r in seeds.items():
                pts = curve(r["evals"], x, "reward")
                ends = pts[-1][0] if pts else 0.0
                lines.append(f"  {name:<10} {seed:>4}" + "".join(
                    f"{value_at(pts, m):>8.3f}" if m <= ends * 1.05 else f"{'-':>8}"
                    for m in marks))
        lines.append("")
    return lines


def mechanism_table(res: Results) -> list[str]:
    """The `MECHANISM` metrics of each run, early and late."""
    names = [short for _, short in MECHANISM]
    lines = ["mechanism: each run's metrics averaged over its first / last quarter of logged "
             "steps (H entropy nats/token, clip = PPO clip fraction, IS_out = tokens the IS "
             "correction truncates, flat = zero-variance groups, |g| grad norm, dlogp = "
             "|trained - behaviour| nats/token, stale = versions, IS_min / IS_max = each "
             "step's smallest / largest raw IS ratio, mass = the sampler's top-k "
             "probability mass where score centering ran); steps/s, samples/s",
             f"  {'arm':<10} {'seed':>4} {'phase':<6}" + "".join(f"{n:>8}" for n in names)]
    for name, seeds in res.items():
        for seed, r in seeds.items():
            mech = r.get("mech") or {}
            for phase in ("early", "late"):
                vals = mech.get(phase, {})
                lines.append(f"  {name:<10} {seed:>4} {phase:<6}" + "".join(
                    f"{vals[k]:>8.3f}" if k in vals else f"{'-':>8}" for k, _ in MECHANISM))
            steps = r.get("steps", 0)
            t_end = max((e["t"] for e in r["evals"]), default=0.0) or 1.0
            s_end = max((e["samples"] for e in r["evals"]), default=0)
            lines.append(f"  {'':<10} {'':>4} {'rates':<6} {steps / t_end:>7.2f} steps/s "
                         f"{s_end / t_end:>8.0f} samples/s")
    return [*lines, ""]


def report(res: Results, target: float, budget_s: float, samples: float) -> list[str]:
    return (areas(res, budget_s, samples) + per_seed_curves(res, budget_s, samples)
            + thresholds(res, target) + best_at_samples(res, samples) + mechanism_table(res)
            + per_run(res))
