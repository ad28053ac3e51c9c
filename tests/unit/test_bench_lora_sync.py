"""Pure parts of benchmarks/lora_sync.py (the benchmark itself needs vLLM servers)."""

from __future__ import annotations

import pytest

from benchmarks.lora_sync import format_report, pair_ratios, parse_args, spread


def test_arguments_default_to_both_models_and_refuse_unknown_ones() -> None:
    a = parse_args([])
    assert a.models == ["tiny", "smollm2"] and a.repeats == 3 and a.max_loras == 2
    assert parse_args(["--models", "smollm2, tiny"]).models == ["smollm2", "tiny"]
    for bad in (["--models", "gpt2"], ["--models", ","], ["--repeats", "0"],
                ["--max-loras", "1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_ratios_are_per_interleaved_pair_against_the_merged_run_beside_it() -> None:
    r = pair_ratios([100.0, 50.0, 80.0], [25.0, 25.0, 20.0])
    assert r == {"median": 0.25, "min": 0.25, "max": 0.5, "n": 3}
    with pytest.raises(ValueError, match="one adapter run per merged run"):
        pair_ratios([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="no throughput"):
        pair_ratios([0.0], [1.0])
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}


def test_the_report_has_one_row_per_model_and_arm_with_the_baseline_marked() -> None:
    arm = {"median": 10.0, "min": 9.0, "max": 11.0}
    results = {"models": {"tiny": {
        "tokens_per_s": {"merged": arm, "adapter": {"median": 5.0, "min": 4.0, "max": 6.0}},
        "ratio": {"median": 0.5, "min": 0.4, "max": 0.6, "n": 2},
        "publish": {"merged": {"bytes": 1_000_000, "publish_s": 0.5},
                    "adapter": {"bytes": 20_000, "publish_s": 0.01}}}}}
    lines = format_report(results).splitlines()
    assert len(lines) == 3
    assert "1.00 (baseline)" in lines[1] and "1,000,000" in lines[1]
    assert "0.50 [0.40-0.60]" in lines[2] and "20,000" in lines[2]
