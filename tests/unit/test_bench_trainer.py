"""Smoke tests of the trainer benchmarks at their smallest settings (``--quick``; the GPU
benchmark with ``--cpu --tiny``): each runs to the end and prints finite ratios against
its own baseline. Their values are what the full runs are for, not these tests."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator

import pytest
import torch

from benchmarks import gpu_trainer, packing, trainer_memory

RATIO = re.compile(r"= (\S+?)x\b")


@pytest.fixture(autouse=True)
def _keep_threads() -> Iterator[None]:
    """The benchmarks set torch's thread count; other tests expect theirs back."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _ratios(main: Callable[[list[str]], int], argv: list[str],
            capsys: pytest.CaptureFixture[str]) -> tuple[list[float], str]:
    assert main(argv) == 0
    out = capsys.readouterr().out
    ratios = [float(x) for x in RATIO.findall(out)]
    assert ratios, out
    assert all(math.isfinite(r) for r in ratios), out
    return ratios, out


def test_trainer_memory_quick_prints_finite_peak_ratios(
        capsys: pytest.CaptureFixture[str]) -> None:
    ratios, out = _ratios(trainer_memory.main, ["--quick"], capsys)
    assert "before/padded peak memory" in out and "before/packed peak memory" in out
    assert len(ratios) == 4  # peak memory and step time, for padded and packed


def test_packing_quick_prints_finite_gains(capsys: pytest.CaptureFixture[str]) -> None:
    _, out = _ratios(packing.main, ["--quick"], capsys)
    assert "packing ratio (padded forwarded / real tokens)" in out
    assert re.search(r"packed/padded tokens/s = \S+x .*gain / packing ratio = \d", out)


def test_packing_quick_multi_turn_times_the_trie(capsys: pytest.CaptureFixture[str]) -> None:
    _, out = _ratios(packing.main, ["--quick", "--multi-turn"], capsys)
    assert "episodes" in out and re.search(r"trie/padded tokens/s = \S+x", out)


def test_gpu_trainer_runs_on_cpu_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    _, out = _ratios(gpu_trainer.main, ["--cpu", "--tiny", "--quick"], capsys)
    assert "packed/padded tokens/s" in out and "publish (file transport" in out


def test_gpu_trainer_without_cuda_exits_with_a_message(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_trainer.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err
