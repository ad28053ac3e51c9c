"""A/B test of two loss settings on one archive: identical data, step for step.

Each arm replays the archived run (`sluice replay`, `trainer/replay.py`: the original
trainer's step composition and order, no generation) with the run's config plus the arm's
``--set`` overrides, then the held-out reward and pass@1 of its final weights are measured
with the evaluator's code (`benchmarks/heldout.py`). The first arm is the reference: each
arm's figures are also given as a ratio to it, measured in the same run.

    .venv/bin/python benchmarks/ab_replay.py runs/copy --config examples/copy.toml \\
        --arm dapo trainer.loss_type=dapo --arm grpo trainer.loss_type=grpo --steps 1000

Note what an A/B on an archive is: the samples were drawn by the original run's policy,
so the arms differ in how they learn from the same off-policy data (their importance
ratios and clipping see the same behaviour logprobs), not in what they would have sampled.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.heldout import heldout, newest_checkpoint  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from trainer.replay import replay  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="the run directory (or archive) to replay")
    ap.add_argument("--config", required=True, help="the run's config TOML")
    ap.add_argument("--arm", nargs="+", action="append", required=True,
                    metavar=("NAME", "KEY=VALUE"),
                    help="an arm: its name, then --set overrides (repeat: 2 arms or more)")
    ap.add_argument("--steps", type=int, default=None, help="replay only the first N steps")
    ap.add_argument("--heldout", type=int, default=256, help="held-out prompts")
    ap.add_argument("--out", default="runs/ab_replay")
    a = ap.parse_args()
    out = Path(a.out).resolve()
    rows = []
    for name, *sets in a.arm:
        cfg = load_config(a.config, sets)
        t0 = time.time()
        res = replay(cfg, a.source, out=str(out / name), max_steps=a.steps,
                     say=lambda s, n=name: print(f"[{n}] {s}", flush=True))
        seconds = time.time() - t0
        figures = heldout(cfg, newest_checkpoint(out / name), a.heldout)
        rows.append({"arm": name, "sets": sets, "steps": res.steps, "replay_s": round(seconds, 1),
                     "reward": figures["reward"], "pass@1": figures["pass@1"]})
        print(f"[{name}] {res.steps} steps in {seconds:.0f} s: held-out reward "
              f"{figures['reward']:.3f}, pass@1 {figures['pass@1']:.3f}", flush=True)
    ref = rows[0]
    print(f"\nA/B on {a.source} ({rows[0]['steps']} steps of identical data, "
          f"{a.heldout} held-out prompts, greedy):")
    print(f"{'arm':<10} {'overrides':<40} {'reward':>8} {'x ref':>7} {'pass@1':>8} {'x ref':>7}")
    for r in rows:
        def ratio(k: str, r: dict = r) -> str:
            return f"{r[k] / ref[k]:.3f}" if ref[k] else "-"

        print(f"{r['arm']:<10} {' '.join(r['sets']) or '(the run)':<40} {r['reward']:>8.3f} "
              f"{ratio('reward'):>7} {r['pass@1']:>8.3f} {ratio('pass@1'):>7}")
    (out / "report.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
