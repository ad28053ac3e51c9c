"""``python -m tests.fault.checker RUN_DIR [--config RUN.toml] [--drained]``: the history
checker of the fault tests; the same check as ``sluice audit`` (`pipeline.bus.audit`)."""

from __future__ import annotations

import sys

from sluice.cli import main

if __name__ == "__main__":
    sys.exit(main(["audit", *sys.argv[1:]]))
