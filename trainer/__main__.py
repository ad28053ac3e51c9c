"""``torchrun --nproc_per_node N -m trainer RUN.toml [--set k=v ...] [--name trainer-0]``:
a trainer job of N data-parallel ranks (`trainer.distributed`); the same as
``sluice train`` with one rank."""

from __future__ import annotations

import sys

from pipeline.ops.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
