"""`python -m benchmarks.gpu_check --cpu`: the one-shot GPU check's CPU version, what CI
can run of it. Each stage runs in a process of its own under a timeout: a hung stage is
killed with everything it started, reported ``StageHung``, and the check goes on."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.gpu_check import procs, runner, stages

ROOT = Path(__file__).resolve().parents[2]
HANG_TIMEOUT_S = 5


def test_a_hung_stage_is_killed_reported_and_the_check_goes_on(tmp_path: Path) -> None:
    """The real command with one stage hung (its process blocks forever, ignoring
    SIGTERM, with a helper in its group and one in a session of its own, as a spawned
    rank and a vLLM server would be): the check kills it after its timeout, names it
    ``StageHung`` in the report, runs the next stage, exits 1, and leaves no process of
    the stage alive."""
    out = tmp_path / "report.json"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--cpu", "--out", str(out),
         "--only", "publish_reload", "control_plane", "--hang-stage", "control_plane",
         "--stage-timeout-s", f"control_plane={HANG_TIMEOUT_S}"],
        cwd=ROOT, text=True, capture_output=True, timeout=600)
    elapsed_s = time.monotonic() - t0
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    stages_run = json.loads(out.read_text())["stages"]
    assert list(stages_run) == ["control_plane", "publish_reload"]  # the check's order
    hung, other = stages_run["control_plane"], stages_run["publish_reload"]
    assert not hung["ok"] and hung["error"].startswith("StageHung: stage 'control_plane'")
    assert f"{HANG_TIMEOUT_S} s timeout" in hung["error"]
    assert HANG_TIMEOUT_S <= hung["seconds"] < HANG_TIMEOUT_S + procs.REAP_WAIT_S
    assert other["ok"] and other["exit_code"] == 0 and other["bytes"] > 0
    assert elapsed_s < hung["seconds"] + other["seconds"] + 60  # nothing waited on the hang
    # the stage's own group and the session it registered: both killed, nothing left
    assert len(hung["process_groups"]) == 2
    assert [procs.live_group_members(g) for g in hung["process_groups"]] == [[], []]


def test_a_stage_that_fails_or_dies_fails_the_check(tmp_path: Path) -> None:
    """A stage's row is its own when it wrote one; a stage that died without one, or
    wrote ok and exited non-zero, fails with the reason and its log's tail."""
    def run(code: str) -> dict[str, object]:
        row_out = tmp_path / "row.json"
        return procs.run_stage_process("s", [sys.executable, "-c", code, str(row_out)],
                                       row_out, tmp_path / "s.log", 60, {}, tmp_path)

    write = "import json, sys; open(sys.argv[1], 'w').write(json.dumps({row}))"
    failed = run(write.format(row="{'ok': False, 'error': 'logits differ'}")
                 + "; sys.exit(1)")
    assert failed["ok"] is False and failed["error"] == "logits differ"
    died = run("import sys; print('out of memory'); sys.exit(3)")
    assert died["ok"] is False and "exited 3 without a report row" in str(died["error"])
    assert died["log_tail"] == ["out of memory"]
    lied = run(write.format(row="{'ok': True}") + "; sys.exit(2)")
    assert lied["ok"] is False and "exited 2" in str(lied["error"])


def test_every_cpu_stage_passes_and_the_gpu_only_ones_say_why_not() -> None:
    """Each stage's code on the CPU, in this process (the command runs each in its own:
    the test above): every one passes, the GPU-only stages are skipped with the reason,
    and the trainer benchmark's floors are not judged on the CPU."""
    ctx = runner.make_context(cpu=True)
    rows = {s.name: runner.run_stage_here(s.name, ctx) for s in runner.STAGES if not s.vllm}
    assert all(r["ok"] for r in rows.values()), rows
    assert rows["control_plane"]["backend"] == "gloo"
    assert rows["layouts"]["float32/eager/shared"] <= stages.FP32_TOL
    assert rows["layouts"]["float32/sdpa/trie"] <= stages.FP32_TOL
    assert "not judged on the CPU" in rows["trainer_bench"]["floors"]
    assert rows["fsdp"]["resumed_step"] == 2 and rows["fsdp"]["tied_embeddings"]
    assert rows["fsdp"]["autocast"] is False and rows["fsdp"]["world_size"] == 1
    assert rows["checkpoint"]["adamw_state_saved_on_cpu"]
    cpu = argparse.Namespace(cpu=True, vllm_on_cpu=False)
    for stage in (s for s in runner.STAGES if s.vllm):
        assert "not run on --cpu" in runner.skip_reason(stage, cpu, gpus=0)


def test_the_trainer_benchmark_is_judged_against_its_floors() -> None:
    def figures(mfu: float, tokens_per_s: float, peak_gib: float) -> dict[str, object]:
        arm = {"mfu": mfu, "tokens_per_s": tokens_per_s, "peak_gib": peak_gib}
        return {"arms": {"padded": arm, "packed": {**arm, "peak_gib": 1.0}}}

    _, failed = stages.judge_floors(figures(0.3, 80_000, 12.0))
    assert failed == []
    _, failed = stages.judge_floors(figures(0.1, 30_000, 40.0))
    assert [f.split()[0] for f in failed] == ["mfu", "tokens_per_s", "peak_gib"]
    assert stages.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert stages.peak_tflops("NVIDIA H200") == 989.0


@pytest.mark.parametrize("spec, want", [(["7"], 7.0), (["fsdp=9"], 9.0),
                                        (["3", "fsdp=9"], 9.0)])
def test_stage_timeouts(spec: list[str], want: float) -> None:
    assert runner.timeouts(spec)["fsdp"] == want
