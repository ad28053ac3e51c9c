"""`benchmarks/gpu_check.py --cpu`: the one-shot GPU check's CPU run (what CI can run of
it): every stage passes and the JSON report says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import gpu_check


def test_the_gpu_check_passes_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    assert gpu_check.main(["--cpu", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    stages = report["stages"]
    assert list(stages) == [name for name, _ in gpu_check.STAGES]
    assert all(s["ok"] for s in stages.values()), stages
    assert stages["control_plane"]["backend"] == "gloo"
    assert stages["layouts"]["float32/eager/shared"] <= gpu_check.FP32_TOL
    assert stages["layouts"]["float32/sdpa/trie"] <= gpu_check.FP32_TOL
    assert stages["fsdp"]["resumed_step"] == 2


def test_a_failing_stage_fails_the_check(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(device: object) -> dict[str, object]:
        raise AssertionError("logits differ")

    monkeypatch.setattr(gpu_check, "STAGES", [("publish_reload", broken)])
    out = tmp_path / "report.json"
    assert gpu_check.main(["--cpu", "--out", str(out)]) == 1
    row = json.loads(out.read_text())["stages"]["publish_reload"]
    assert row["ok"] is False and "logits differ" in row["error"]
