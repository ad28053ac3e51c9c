"""On-policy distillation end to end: `sluice up` with a teacher and no reward functions.

A student distilled from a teacher that knows `copy` learns to copy: the teacher is the
tiny model fine-tuned here on copy pairs (`benchmarks.distill.sft_copy_teacher`:
supervised, 300 AdamW steps); the student is a fresh tiny model (`sluice up` builds it,
another seed) that never sees a reward: its only signal is the teacher's logprob of each
token it samples. The run stops at the first held-out evaluation with exact match 0.5
(the fresh student: 0), and the per-token reverse KL must have fallen to a third of its
start. That the student goes on to the teacher's own exact match is
`benchmarks/distill.py` (full acceptance, 2-3x as long; docs/distillation.md).

Measured: 0.5 was passed at step ~900 of the 1,770 that reaching the teacher's 0.94 took
(KL 4.7 -> 1.0 nats/token by then, 0.17 at the teacher's level); the whole test ~60 s on
a fast 2-core machine, ~3.5 min expected on the slowest seen (3.3x slower). The run's time
cap and the test's timeout leave room for slower still: it waits for the condition.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.distill import (
    CONFIG,
    heldout_exact_match,
    reverse_kl,
    sft_copy_teacher,
    student_args,
)
from pipeline.config import load_config
from tests.helpers import run_up

pytestmark = pytest.mark.e2e

TARGET = 0.5
"""The student's held-out exact match at which the run stops: from 0, half of the 256
held-out prompts copied exactly, greedy, by a model that only ever saw the teacher's
logprobs."""


@pytest.mark.timeout(900)
def test_a_distilled_student_learns_to_copy_from_the_teacher_alone(tmp_path: Path) -> None:
    config = tmp_path / "distill.toml"
    config.write_text(CONFIG)
    teacher = sft_copy_teacher(tmp_path / "teacher")
    teacher_em = heldout_exact_match(teacher, load_config(config,
                                                          [f"scoring.teacher={teacher}"]))
    assert teacher_em >= 0.95, teacher_em  # it knows copy (0.973-0.996 when measured)

    out = tmp_path / "run"
    args = student_args(config, out, tmp_path / "student", teacher, TARGET, max_time_s=720)
    proc, summary = run_up(args, out, tmp_path, 840)
    assert summary["reason"].startswith("stop_at pass@1>="), summary
    assert summary["value_at_target"] >= TARGET, summary
    # The run ends in order past the version that met the target and evaluates the final
    # one too; the toy student's exact match swings by tenths between nearby versions
    # (0.37 measured 40 versions on), so only that it was evaluated is asserted.
    assert summary["final_version_evaluated"], summary
    assert summary["eval_reward_before"] == 0.0, summary  # the fresh student cannot copy
    assert summary["conservation"]["balanced"], summary
    assert "ledger audit" in proc.stderr and "OK" in proc.stderr, proc.stderr[-2000:]

    first, last = reverse_kl(out)  # 4.7 -> ~1.0 nats/token when measured
    print(f"teacher exact match {teacher_em:.3f}; student reached {TARGET} after "
          f"{summary['time_to_target_s']:.0f} s (step {summary['step_at_target']}), final "
          f"version {summary['eval_pass@1_after']:.3f}; reverse "
          f"KL {first:.2f} -> {last:.2f} nats/token")  # shown with -s
    assert first > 3.0 and last < first / 3, (first, last)
    log = (out / "logs" / "scorer-0.log").read_text()
    assert "teacher reverse KL" in log and f"teacher {teacher}" in log, log[-2000:]
