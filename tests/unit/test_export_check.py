"""benchmarks/export_check.py's pure parts: the version `sluice export` reports, a
generated row cut as the engines report completions, and which of the run's own
evaluations the check is compared against."""

from __future__ import annotations

import pytest

from benchmarks.export_check import eval_row, exported_version, greedy_answer


def test_the_exported_version_is_read_from_the_summary() -> None:
    assert exported_version("exported v70, step 70: full weights, 3 files, 1 bytes -> /x\n"
                            "  config.json  1 bytes") == 70
    assert exported_version("skipping published v9: bad sha\nexported checkpoint "
                            "step-00000050 (version 49), step 50: full weights") == 49
    with pytest.raises(ValueError, match="no 'exported"):
        exported_version("nothing here")


def test_a_row_is_cut_after_its_first_eos_which_is_kept() -> None:
    assert greedy_answer([5, 6, 2, 2, 2], eos_id=2) == ([5, 6, 2], "stop")
    assert greedy_answer([2, 7], eos_id=2) == ([2], "stop")
    assert greedy_answer([5, 6, 7], eos_id=2) == ([5, 6, 7], "length")


def test_the_run_evaluation_is_the_versions_own_else_the_newest() -> None:
    rows = [{"version": 0, "ts": 1.0, "pass@1": 0.0}, {"version": 56, "ts": 3.0, "pass@1": 0.5},
            {"version": 17, "ts": 2.0, "pass@1": 0.4}, {"version": 17, "ts": 4.0, "pass@1": 0.6}]
    assert eval_row(rows, 17) == (rows[3], True)  # a re-evaluation: its last row
    assert eval_row(rows, 70) == (rows[1], False)  # not evaluated: the newest version
    assert eval_row([], 70) == (None, False)
