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
MECHANISM = [("entropy/adv_nonzero", "H_adv"), ("entropy", "H"),
             ("clip_ratio/region_mean", "clip"), ("is_ratio/outside_frac", "IS_out"),
             ("frac_reward_zero_std/solved", "solved"), ("frac_reward_zero_std/stuck", "stuck"),
             ("grad_norm", "|g|"), ("logprob_diff/mean_abs", "dlogp"),
             ("staleness_mean", "stale"), ("is_ratio/min", "IS_min"),
             ("is_ratio/max", "IS_max"), ("sampling/sampler_mass", "mass")]
SERIES_EVERY = 25
"""Steps per point of a run's stored mechanism series: TRL logs its metrics averaged over
``logging_steps`` = 25 (``trl_copy.py``), and sluice's per-step rows are averaged over
the same bins (`binned`), so both sides' points cover the same steps."""


def base_arm(res: Results) -> str | None:
    """The arm others are paired with: ``trl`` if present, else the first TRL arm, else
    the first arm (independent of the order runs finished in)."""
    if "trl" in res:
        return "trl"
    return next((n for n in res if n.startswith("trl")), next(iter(res), None))


def _means(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each `MECHANISM` metric's NaN-aware mean over ``rows`` (absent ones omitted)."""
    vals = {}
    for key, _ in MECHANISM:
        xs = [float(r[key]) for r in rows if isinstance(r.get(key), int | float)
              and not math.isnan(float(r[key]))]
        if xs:
            vals[key] = statistics.fmean(xs)
    return vals


def binned(rows: list[dict[str, Any]], every: int = SERIES_EVERY) -> list[dict[str, Any]]:
    """Per-step metric rows as a series of `MECHANISM` means over bins of ``every`` steps,
    each point at its bin's last step (steps 1..25 -> 25), as TRL's logging averages;
    a partial last bin is kept at its own last step."""
    bins: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        if isinstance(r.get("step"), int) and r["step"] > 0:
            bins.setdefault(-(-r["step"] // every) * every, []).append(r)
    return [{"step": min(end, max(r["step"] for r in part)), **_means(part)}
            for end, part in sorted(bins.items())]


def mechanism_at(series: list[dict[str, Any]], end_step: float
                 ) -> dict[str, dict[str, float]]:
    """`MECHANISM` means over the steps (0, end/4] ("early") and (3/4 end, end] ("late")
    of a run's series: with the same ``end_step`` for every run, each side is measured
    at the same step and sample positions."""
    return {"early": _means([r for r in series if 0 < r["step"] <= end_step / 4]),
            "late": _means([r for r in series if 0.75 * end_step < r["step"] <= end_step])}


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
    return {"early": _means(rows[:n]), "late": _means(rows[-n:])}


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
    base = base_arm(res)
    rows = [("exact", target)] + [("exact", t) for t in EXACT_TARGETS if t < target] + \
        [("reward", t) for t in REWARD_TARGETS]
    for key, thr in rows:
        lines.append(f"held-out {'greedy exact match' if key == 'exact' else 'reward'} >= "
                     f"{thr}: median [min-max] over seeds")
        hdr = (f"  {'arm':<10} {'reached':>7} {'time s':>22} {'samples':>26} {'steps':>20}"
               f" {'time/TRL':>9} {'samples/TRL':>11}")
        lines += [hdr, "  " + "-" * (len(hdr) - 2)]
        hits0 = arm_hits(list(res[base].values()), thr, key) if base else None
        for name, seeds in res.items():
            h = arm_hits(list(seeds.values()), thr, key)
            reached = sum(x != float("inf") for x in h["t"])
            rt = rs = "-"
            if hits0 and name != base and med(h["t"]) < float("inf") > med(hits0["t"]):
                rt = f"{med(h['t']) / med(hits0['t']):.2f}"
                rs = f"{med(h['samples']) / med(hits0['samples']):.2f}"
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
    (`benchmarks.curves`); an arm ``X`` is also paired with ``trl-X`` (the same ablation
    on TRL's side) where that arm ran."""
    lines = ["area under the held-out reward curve = its mean over the span; 95% t intervals "
             "over seeds (none with one seed); 'vs' pairs the seeds, p = exact sign-flip "
             "test (its floor is 2/2^seeds)"]
    base = base_arm(res)
    for x, span_x, unit in (("t", budget_s, "s"), ("samples", samples, "samples")):
        lines.append(f"  against {unit}, over [0, {span_x:g}]:")
        per_arm = {name: {seed: area(curve(r["evals"], x, "reward"), span_x)
                          for seed, r in seeds.items()} for name, seeds in res.items()}
        for name, by_seed in per_arm.items():
            m, lo, hi = mean_ci(list(by_seed.values()))
            row = f"    {name:<10} {m:.3f} [{lo:.3f}, {hi:.3f}] over {len(by_seed)} seeds"
            # against the base arm, and an ablation against its TRL twin (``trl-<name>``)
            for other in dict.fromkeys(o for o in (base, f"trl-{name}")
                                       if o and o != name and o in per_arm):
                common = sorted(set(by_seed) & set(per_arm[other]))
                if common:
                    a = [by_seed[s] for s in common]
                    b = [per_arm[other][s] for s in common]
                    d, dlo, dhi = paired_ci(a, b)
                    p = sign_flip_p([x - y for x, y in zip(a, b, strict=True)])
                    row += (f"   vs {other}: {d:+.3f} [{dlo:+.3f}, {dhi:+.3f}] p={p:.3g} "
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


def common_end_step(res: Results) -> int:
    """The last step every run with a stored series reached (0 if none has one)."""
    ends = [r["series"][-1]["step"] for seeds in res.values() for r in seeds.values()
            if r.get("series")]
    return min(ends) if ends else 0


def mechanism_table(res: Results) -> list[str]:
    """The `MECHANISM` metrics of each run, early and late: at the same steps for every
    run with a stored series (`mechanism_at` up to `common_end_step`), else (older
    results) over each run's own first / last quarter."""
    names = [short for _, short in MECHANISM]
    end = common_end_step(res)
    where = (f"steps (0, {end / 4:g}] and ({0.75 * end:g}, {end}], the same for every run "
             "(the last step all runs reached; samples = 64 x steps on both sides)"
             if end else "each run's first / last quarter of logged steps")
    lines = [f"mechanism: each run's metrics averaged over {where} (H_adv = entropy "
             "nats/token over completions with non-zero advantage, the same tokens on both "
             "sides; H = each side's own entropy figure; clip = PPO clip fraction, IS_out = "
             "tokens the IS correction truncates, solved / stuck = share of groups all "
             "passing / all equal below the pass mark, |g| grad norm, dlogp = "
             "|trained - behaviour| nats/token, stale = versions, IS_min / IS_max = each "
             "step's smallest / largest raw IS ratio, mass = the sampler's top-k "
             "probability mass where score centering ran); steps/s, samples/s",
             f"  {'arm':<10} {'seed':>4} {'phase':<6}" + "".join(f"{n:>8}" for n in names)]
    for name, seeds in res.items():
        for seed, r in seeds.items():
            mech = (mechanism_at(r["series"], end) if end and r.get("series")
                    else r.get("mech") or {})
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
