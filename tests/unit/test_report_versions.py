"""The summary names the versions its held-out figures are of and whether the last one
is the run's final version (`sluice.report.evaluated_versions`)."""

from __future__ import annotations

from typing import Any

from sluice.report import evaluated_versions


def _s(first: int | None, last: int | None, final: int | None) -> dict[str, Any]:
    return {"eval_version_before": first, "eval_version_after": last, "final_version": final,
            "final_version_evaluated": final is not None and (last if last is not None
                                                              else first) == final}


def test_the_final_version_is_marked_or_said_to_be_missing() -> None:
    assert evaluated_versions(_s(0, 70, 70)) == "  (v0 -> v70, the final version)"
    assert evaluated_versions(_s(0, 56, 70)) == \
        "  (v0 -> v56; the final version, v70, was not evaluated)"
    assert evaluated_versions(_s(0, None, 0)) == "  (v0 -> v0, the final version)"
    assert evaluated_versions(_s(0, None, 3)) == \
        "  (v0 -> v0; the final version, v3, was not evaluated)"
    assert evaluated_versions(_s(None, None, 3)) == ""
