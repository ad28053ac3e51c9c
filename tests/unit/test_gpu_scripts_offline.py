"""The GPU scripts probe the flash kernel that ``deploy/setup.sh --gpu`` caches, and they
really run offline: huggingface_hub reads ``HF_HUB_OFFLINE`` once, at its first import
(transformers imports it), so a script that sets it later leaves the network on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pipeline.attention import DeviceProps, kernels_to_cache

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["benchmarks.gpu_check.stages", "benchmarks.gpu_trainer"])
def test_importing_a_gpu_script_turns_the_hub_offline_before_transformers(module: str) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    code = (f"import {module}\n"
            "from huggingface_hub import constants\n"
            "print(constants.HF_HUB_OFFLINE)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "True"


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (9, 0), (10, 0), (12, 0)])
def test_the_scripts_flash_kernel_is_cached_on_every_nvidia_gpu(capability: tuple[int, int]
                                                                ) -> None:
    from benchmarks import gpu_trainer
    from benchmarks.gpu_check import common

    cached = kernels_to_cache(DeviceProps("cuda", capability))
    assert gpu_trainer.FLASH in cached and common.FLASH_KERNEL in cached


def test_the_trainer_benchmark_fails_on_a_non_finite_step(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """gpu_check's trainer stage judges gpu_trainer by its exit code: a NaN loss, an
    infinite gradient or a step the trainer skipped must make it exit 1, not print
    tokens/s of steps that trained nothing."""
    from benchmarks import gpu_trainer

    assert gpu_trainer.bad_steps([{"loss": 0.1, "grad_norm": 1.0, "skipped": 0.0}]) == 0
    assert gpu_trainer.bad_steps([{"loss": float("nan"), "grad_norm": 1.0},
                                  {"loss": 0.1, "grad_norm": float("inf")},
                                  {"loss": 0.1, "grad_norm": 1.0, "skipped": 1.0}]) == 3
    real = gpu_trainer.optimize
    calls = {"n": 0}

    def one_nan(*a: Any, **k: Any) -> dict[str, float]:
        calls["n"] += 1
        out = real(*a, **k)
        return {**out, "loss": float("nan")} if calls["n"] == 3 else out

    monkeypatch.setattr(gpu_trainer, "optimize", one_nan)
    assert gpu_trainer.main(["--cpu", "--tiny", "--quick"]) == 1
    assert "non-finite" in capsys.readouterr().out
