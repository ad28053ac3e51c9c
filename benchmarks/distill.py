"""On-policy distillation to the teacher's level: a fresh student that never sees a reward
reaches its teacher's held-out exact match on `copy`.

    .venv/bin/python benchmarks/distill.py [--out runs/distill-bench] [--margin 0.05]

The teacher is the tiny model fine-tuned here on copy pairs (`sft_copy_teacher`:
supervised, 300 AdamW steps, ~15-40 s on 2 cores); its held-out greedy exact match is the
baseline, measured in the same run. The student is a fresh tiny model of another seed,
trained by `sluice up` with `scoring.rewards = []` (its only signal is the teacher's
logprob of each token it samples) until its held-out exact match is within ``--margin``
of the teacher's. Prints the teacher's and the student's exact match and their ratio, the
time and step at which the student got there, and the per-token reverse KL the scorer
logged, first 400 groups against the last 400.

CI runs the same setup to a lower bar (tests/e2e/test_distill.py: exact match 0.5 from
0, the KL at most a third of its start); this script is the full acceptance, 2-4 minutes
on a 2-core machine and up to ~8 on the slowest one seen.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from pipeline.config import Config, load_config
from pipeline.model import init_tiny_model, load_model
from workers.engines.transformers import TransformersEngine
from workers.evaluator import evaluate
from workers.tasks.catalog import make_task, task_from_config
from workers.tasks.prompts import render_prompt
from workers.tasks.rewards import load_reward

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """
[run]
name = "distill"
seed = 0

[model]
init = "tiny-char-qwen2"

[task]
name = "copy"
heldout = 256

[generation]
num_generations = 8
max_new_tokens = 8
temperature = 1.0      # the teacher is compared untempered (docs/distillation.md)
batch_groups = 8

[scoring]
rewards = []           # pure distillation: the teacher is the only signal
teacher_coef = 1.0

[eval]
rewards = [{ fn = "workers.tasks.rewards:exact_match" }]   # pass@1 = held-out exact match

[trainer]
groups_per_step = 8
max_staleness = 1
lr = 2e-4              # 2e-3 and above stalled at a KL of ~6 (uniform digits); 6e-4 was
                       # slower to exact match 0.5 (0.13 at step 493, 2e-4: 0.33 at 520)
loss_type = "dapo"
beta = 0.0
max_steps = 5000

[up]
scorers = 1            # each scorer holds its own copy of the teacher
generators = 1
plot = false
"""
"""The student's run; `student_args` adds the teacher, the target and the folders."""


def sft_copy_teacher(out: Path, *, steps: int = 300, lr: float = 2e-3, batch: int = 64,
                     seed: int = 1) -> Path:
    """The tiny model (init ``seed``) trained by plain supervised fine-tuning on copy
    pairs ``"48213="`` -> ``"48213<eos>"`` (loss on the answer tokens), AdamW with 20
    warm-up steps and a linear decay; saved at ``out`` with its tokenizer. Uses one
    torch thread (as fast as more on 2 shared cores), restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        init_tiny_model(out, seed=seed)
        model, tok = load_model(out)
        task = make_task("copy", seed=0, num_prompts=20000)
        rng = np.random.default_rng(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        model.train()
        for step in range(steps):
            rows = []
            for i in rng.integers(0, len(task), batch):
                p = task.prompt(int(i))
                rows.append((render_prompt(tok, p["text"]),
                             [*tok(p["answer"], add_special_tokens=False).input_ids,
                              tok.eos_token_id]))
            width = max(len(p) + len(c) for p, c in rows)
            ids = torch.zeros((batch, width), dtype=torch.long)
            att = torch.zeros_like(ids)
            labels = torch.full_like(ids, -100)
            for r, (p, c) in enumerate(rows):
                ids[r, :len(p) + len(c)] = torch.tensor(p + c)
                att[r, :len(p) + len(c)] = 1
                labels[r, len(p):len(p) + len(c)] = torch.tensor(c)
            loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
            for g in opt.param_groups:
                g["lr"] = lr * min(1.0, (step + 1) / 20) * (1 - step / steps)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        model.eval()
        model.save_pretrained(out)
    finally:
        torch.set_num_threads(threads)
    return out


def heldout_exact_match(model_dir: Path, cfg: Config) -> float:
    """The evaluator's pass@1 of ``model_dir`` on the run's held-out prompts: greedy,
    ``generation.max_new_tokens``, scored by ``eval.rewards`` (`workers.evaluator`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tok = load_model(model_dir)
        prompts = task_from_config(cfg, tok).heldout(cfg.task.heldout)
        rewards = [load_reward(r.fn, r.weight) for r in cfg.eval_rewards]
        res = asyncio.run(evaluate(TransformersEngine(model, tok), tok, prompts,
                                   cfg.generation.max_new_tokens, rewards))
    finally:
        torch.set_num_threads(threads)
    return float(res["pass@1"])


def student_args(config: Path, out: Path, student: Path, teacher: Path, target: float,
                 max_time_s: float) -> list[str]:
    """``sluice up`` of the student: stops at the first held-out evaluation at
    ``pass@1 >= target`` (evaluated every 5 s), or after ``max_time_s``."""
    sets = [f"run.output_dir={out}", f"model.path={student}", f"scoring.teacher={teacher}",
            f"up.stop_at=pass@1>={target:.3f}", f"run.max_time_s={max_time_s}"]
    return [sys.executable, "-m", "sluice.cli", "up", str(config),
            *[a for s in sets for a in ("--set", s)], "--eval-every", "5"]


def reverse_kl(out: Path, window: int = 400) -> tuple[float, float]:
    """The per-token reverse KL the scorer logged per group (ledger ``kl``), in time
    order: the mean of the first ``window`` groups and of the last ``window``."""
    rows = sorted((json.loads(x) for f in (out / "ledger").glob("scorer-*.jsonl")
                   for x in f.read_text().splitlines()), key=lambda r: r["t"])
    kl = [(r["kl"], r["kl_n"]) for r in rows if r["ev"] == "scored"]

    def mean(part: list[tuple[float, int]]) -> float:
        return sum(k * n for k, n in part) / sum(n for _, n in part)

    return mean(kl[:window]), mean(kl[-window:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "distill-bench")
    p.add_argument("--margin", type=float, default=0.05,
                   help="how close to the teacher's exact match the student must come")
    p.add_argument("--max-time-s", type=float, default=1200.0)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    config = a.out / "distill.toml"
    config.write_text(CONFIG)
    teacher = sft_copy_teacher(a.out / "teacher")
    teacher_em = heldout_exact_match(teacher, load_config(config, [f"scoring.teacher={teacher}"]))
    print(f"teacher (300 SFT steps): held-out exact match {teacher_em:.3f}", flush=True)
    target = teacher_em - a.margin
    run = a.out / "run"
    args = student_args(config, run, a.out / "student", teacher, target, a.max_time_s)
    with open(a.out / "up.log", "w") as log:
        rc = subprocess.run([*args, "--fresh"], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT).returncode
    if rc != 0:
        print(f"sluice up exited {rc}; see {a.out / 'up.log'}")
        return 1
    s = json.loads((run / "summary.json").read_text())
    first, last = reverse_kl(run)
    em = s["value_at_target"] if s["value_at_target"] is not None else s["eval_pass@1_after"]
    print(f"student: {s['reason']}; held-out exact match {s['eval_pass@1_before']:.3f} -> "
          f"{em:.3f} at step {s['step_at_target']} ({s['time_to_target_s']} s); the final "
          f"version (step {s['steps']}): {s['eval_pass@1_after']:.3f}")
    print(f"student / teacher exact match: {em / teacher_em:.3f}")
    print(f"reverse KL, first 400 groups -> last 400: {first:.2f} -> {last:.2f} nats/token")
    return 0 if s["reason"].startswith("stop_at") else 1


if __name__ == "__main__":
    sys.exit(main())
