"""``python -m benchmarks.gpu_check``: the check (`benchmarks.gpu_check.runner`)."""

from __future__ import annotations

from benchmarks.gpu_check.runner import main

if __name__ == "__main__":
    raise SystemExit(main())
