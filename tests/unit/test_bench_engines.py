"""Pure helpers of benchmarks/engines.py (the benchmark itself needs a vLLM server)."""

from __future__ import annotations

import numpy as np

from benchmarks.engines import first_error, pause_stats, spans_versions, summarize
from workers.engines.base import Completion


def _c(versions: list[int]) -> Completion:
    n = len(versions)
    return Completion(token_ids=np.zeros(n, np.int32), logprobs=np.zeros(n, np.float32),
                      versions=np.asarray(versions, np.int32), finish_reason="length")


def test_summarize_counts_tokens_and_rates() -> None:
    groups = [[_c([0, 0]), _c([0])], [_c([0, 0, 0])]]
    m = summarize(groups, wall_s=2.0, cpu_s=3.0)
    assert (m["groups"], m["completions"], m["tokens"]) == (2, 3, 6)
    assert m["tokens_per_s"] == 3.0 and m["groups_per_s"] == 1.0 and m["tokens_per_cpu_s"] == 2.0


def test_pause_stats_and_spanning_versions() -> None:
    assert pause_stats([0.01, 0.03, 0.02]) == {"n": 3, "median_ms": 20.0, "max_ms": 30.0}
    assert pause_stats([]) == {"n": 0}
    assert spans_versions([[_c([0, 0, 1]), _c([1, 1])], [_c([2])]]) == 1


def test_first_error_takes_the_root_cause_from_error_lines_only() -> None:
    log = ("(APIServer pid=1) WARNING x `OSError: [Errno 24] Too many open files`.\n"
           "(Worker pid=2) ERROR 11-30 [m.py:1] Traceback (most recent call last):\n"
           "(Worker pid=2) ERROR 11-30 [m.py:1] RuntimeError: CPU Generator does not use offset\n"
           "(APIServer pid=1) ERROR 11-30 [a.py:9] vllm.EngineDeadError: EngineCore died\n")
    assert first_error(log) == "RuntimeError: CPU Generator does not use offset"
    assert first_error("all fine\n") == "no error line in the log"
