"""On-policy distillation end to end: `sluice up` with a teacher and no reward functions.

The issue's acceptance test: a student distilled from a teacher that knows `copy` closes
its per-token KL and reaches the teacher's held-out exact match. The teacher is the tiny
model fine-tuned here on copy pairs (supervised, 300 Adam steps, ~15-30 s on 2 cores);
the student is a fresh tiny model (`sluice up` builds it, another seed) that never sees a
reward: its only signal is the teacher's logprob of each token it samples. Measured: 197 s
in all on a nearly idle 2-core machine (teacher 18 s, exact match 0.988; the student at
0.953 after 169 s, step 1843; KL 4.7 -> 0.2), 380 s with the machine loaded (load ~4),
453 s on a 2-core machine whose torch ran 2.2x slower (2026-12-02). The run's time cap
(840 s) and the test's timeout leave room for a machine slower still: it waits for the
student to reach the target, not for a time that happens to suffice.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config import Config, load_config
from pipeline.model import init_tiny_model, load_model
from tests.helpers import run_up, up_args
from workers.engines.transformers import TransformersEngine
from workers.evaluator import evaluate
from workers.tasks.catalog import make_task, task_from_config
from workers.tasks.prompts import render_prompt
from workers.tasks.rewards import load_reward

pytestmark = pytest.mark.e2e

MARGIN = 0.05
"""How close to the teacher's held-out exact match the student must come. Greedy exact
match over 256 held-out prompts has a binomial standard error of ~0.014 at 0.95, but the
student's figure moves between evaluations by more than that while it trains (0.73 to
0.97 within 40 steps when measured at lr 2e-4), so the test asks for the first
evaluation within 0.05 (~3.5 standard errors) of the teacher's, not for equality."""

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
lr = 2e-4              # 2e-3 and above stalled at a KL of ~6 (uniform digits)
loss_type = "dapo"
beta = 0.0

[up]
scorers = 1            # each scorer holds its own copy of the teacher
generators = 1
plot = false
"""


def sft_copy_teacher(out: Path, *, steps: int = 300, lr: float = 2e-3, batch: int = 64,
                     seed: int = 1) -> Path:
    """The tiny model (init ``seed``) trained by plain supervised fine-tuning on copy
    pairs ``"48213="`` -> ``"48213<eos>"`` (loss on the answer tokens), AdamW with 20
    warm-up steps and a linear decay; saved at ``out`` with its tokenizer."""
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
    return out


def heldout_exact_match(model_dir: Path, cfg: Config) -> float:
    """The evaluator's pass@1 of ``model_dir`` on the run's held-out prompts: greedy,
    ``generation.max_new_tokens``, scored by ``eval.rewards`` (`workers.evaluator`)."""
    model, tok = load_model(model_dir)
    prompts = task_from_config(cfg, tok).heldout(cfg.task.heldout)
    rewards = [load_reward(r.fn, r.weight) for r in cfg.eval_rewards]
    res = asyncio.run(evaluate(TransformersEngine(model, tok), tok, prompts,
                               cfg.generation.max_new_tokens, rewards))
    return res["pass@1"]


@pytest.mark.timeout(1200)
def test_a_distilled_student_closes_its_kl_and_reaches_the_teachers_exact_match(
        tmp_path: Path) -> None:
    config = tmp_path / "distill.toml"
    config.write_text(CONFIG)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as fast as more on 2 shared cores, and leaves one free
    try:
        teacher = sft_copy_teacher(tmp_path / "teacher")
        cfg = load_config(config, [f"scoring.teacher={teacher}"])
        teacher_em = heldout_exact_match(teacher, cfg)
    finally:
        torch.set_num_threads(threads)
    assert teacher_em >= 0.95, teacher_em  # it knows copy (0.973-0.996 when measured)

    target = f"{teacher_em - MARGIN:.3f}"
    out = tmp_path / "run"
    args = up_args(config, out, tmp_path / "student", "distill", f"scoring.teacher={teacher}",
                   "trainer.lr=2e-4", "trainer.max_steps=5000",
                   f"up.stop_at=pass@1>={target}", "run.max_time_s=840")
    proc, summary = run_up(args, out, tmp_path, 960)
    assert summary["reason"] == f"stop_at pass@1>={target} reached", summary
    assert summary["eval_reward_before"] == 0.0, summary  # the fresh student cannot copy
    assert summary["conservation"]["balanced"], summary
    assert "ledger audit" in proc.stderr and "OK" in proc.stderr, proc.stderr[-2000:]

    # the per-token reverse KL the scorer logged per group (ledger `kl`), in time order:
    # the first 400 groups' mean against the last 400's (5.4 -> 0.2 when measured)
    rows = sorted((json.loads(x) for f in (out / "ledger").glob("scorer-*.jsonl")
                   for x in f.read_text().splitlines()), key=lambda r: r["t"])
    kl = [(r["kl"], r["kl_n"]) for r in rows if r["ev"] == "scored"]
    first, last = kl[:400], kl[-400:]

    def mean(part: list[tuple[float, int]]) -> float:
        return sum(k * n for k, n in part) / sum(n for _, n in part)

    print(f"teacher exact match {teacher_em:.3f}; student reached {target} after "
          f"{summary['time_to_target_s']:.0f} s (step {summary['step_at_target']}); reverse "
          f"KL {mean(first):.2f} -> {mean(last):.2f} nats/token")  # shown with -s
    assert mean(first) > 3.0 and mean(last) < mean(first) / 5, (mean(first), mean(last))
    log = (out / "logs" / "scorer-0.log").read_text()
    assert "teacher reverse KL" in log and f"teacher {teacher}" in log, log[-2000:]
