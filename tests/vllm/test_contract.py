"""The engine contract, checked on both engines with the same assertions.

The transformers engine runs in-process; the vLLM engine against the session's real
server. Each case builds the engine on the tiny model ``model_a`` (version 0) and may
swap to ``model_b``; the vLLM case swaps back before it ends, so the shared server is
left at ``model_a``'s weights.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.model import load_model
from tests.vllm.conftest import VLLMServer
from workers.engines import Engine, SamplingParams
from workers.engines.transformers import TransformersEngine
from workers.engines.vllm import VLLMEngine

PROMPTS = [[10, 11, 12, 13, 66], [20, 21, 22, 66], [30, 66]]
EOS = 1
ENGINES = ["transformers", "vllm"]


@asynccontextmanager
async def make_engine(kind: str, srv: VLLMServer) -> AsyncIterator[Engine]:
    engine: Engine
    if kind == "vllm":
        engine = VLLMEngine([srv.url], srv.model, seed=0)
    else:
        model, tok = load_model(srv.model_dir)
        engine = TransformersEngine(model, tok, seed=0)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.load_weights(srv.model_dir, 10_000)  # leave model_a's weights
        await engine.close()


def run(kind: str, srv: VLLMServer, body: Callable[[Engine], Awaitable[Any]]) -> Any:
    async def go() -> Any:
        async with make_engine(kind, srv) as e:
            return await body(e)

    return asyncio.run(go())


def hf_greedy(model_dir: Any, prompt: list[int], n: int) -> list[int]:
    model, _ = load_model(model_dir)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=EOS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ENGINES)
def test_shapes_types_and_finish_reasons(kind: str, vllm_server: VLLMServer) -> None:
    groups = run(kind, vllm_server, lambda e: e.generate(
        PROMPTS, 5, SamplingParams(max_new_tokens=9, temperature=1.0)))
    assert [len(g) for g in groups] == [5, 5, 5]
    for g in groups:
        for c in g:
            n = len(c)
            assert 1 <= n <= 9
            assert c.token_ids.dtype == np.int32 and c.logprobs.dtype == np.float32
            assert c.versions.dtype == np.int32
            assert len(c.logprobs) == len(c.versions) == n
            assert np.isfinite(c.logprobs).all() and (c.logprobs <= 0).all()
            assert (c.versions == 0).all()
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == EOS and EOS not in c.token_ids[:-1].tolist()
            else:
                assert c.finish_reason == "length" and n == 9 and EOS not in c.token_ids


@pytest.mark.parametrize("kind", ENGINES)
def test_greedy_equals_transformers_greedy(kind: str, vllm_server: VLLMServer) -> None:
    out = run(kind, vllm_server, lambda e: e.generate(
        PROMPTS, 1, SamplingParams(max_new_tokens=12, greedy=True)))
    for prompt, (c,) in zip(PROMPTS, out, strict=True):
        assert c.token_ids.tolist() == hf_greedy(vllm_server.model_dir, prompt, 12)


@pytest.mark.parametrize("kind", ENGINES)
def test_load_weights_switches_model_and_ignores_old_versions(
        kind: str, vllm_server: VLLMServer) -> None:
    async def body(e: Engine) -> tuple[bool, bool, int, list[Any]]:
        first = await e.load_weights(vllm_server.other_model_dir, 3)
        again = await e.load_weights(vllm_server.model_dir, 3)  # not newer: ignored
        older = await e.load_weights(vllm_server.model_dir, 2)  # older: ignored
        out = await e.generate(PROMPTS, 1, SamplingParams(max_new_tokens=12, greedy=True))
        return first, again or older, e.version, out

    first, stale_applied, version, out = run(kind, vllm_server, body)
    assert first and not stale_applied and version == 3
    for prompt, (c,) in zip(PROMPTS, out, strict=True):
        assert c.token_ids.tolist() == hf_greedy(vllm_server.other_model_dir, prompt, 12)
        assert (c.versions == 3).all()


@pytest.mark.parametrize("kind", ENGINES)
def test_sampled_logprobs_are_the_processed_distribution(
        kind: str, vllm_server: VLLMServer) -> None:
    """Temperature 0.7, top-k 20: each token's logprob is log softmax(logits / 0.7)
    renormalised over the top 20 (tolerance 1e-4, fp32 both sides)."""
    params = SamplingParams(max_new_tokens=10, temperature=0.7, top_k=20)
    groups = run(kind, vllm_server, lambda e: e.generate(PROMPTS, 3, params))
    model, _ = load_model(vllm_server.model_dir)
    for prompt, g in zip(PROMPTS, groups, strict=True):
        for c in g:
            x = torch.tensor([prompt + c.token_ids.tolist()])
            with torch.no_grad():
                logits = model(x).logits[0, len(prompt) - 1:-1].float() / 0.7
            kth = torch.topk(logits, 20, dim=-1).values[:, -1:]
            logp = torch.log_softmax(logits.masked_fill(logits < kth, float("-inf")), -1)
            ref = logp.gather(-1, torch.tensor(c.token_ids, dtype=torch.long)[:, None])[:, 0]
            torch.testing.assert_close(torch.from_numpy(c.logprobs), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ENGINES)
def test_health_reports_healthy(kind: str, vllm_server: VLLMServer) -> None:
    h = run(kind, vllm_server, lambda e: asyncio.sleep(0, e.health()))
    assert h["healthy"] is True


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize(("top_k", "k"), [(0, 5), (3, 4)])
def test_top_logprobs_are_the_processed_distributions_best(
        kind: str, top_k: int, k: int, vllm_server: VLLMServer) -> None:
    """`top_logprobs` = k: every token reports the k best ids of the distribution it was
    drawn from (temperature 0.7, top-k when set) with their logprobs, best first; the
    tokens top-k removed are absent (-1), and the candidate sets are the finite ones."""
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_k=top_k, top_logprobs=k)
    groups = run(kind, vllm_server, lambda e: e.generate(PROMPTS, 2, params))
    model, _ = load_model(vllm_server.model_dir)
    for prompt, g in zip(PROMPTS, groups, strict=True):
        for c in g:
            assert c.top_ids is not None and c.top_logprobs is not None
            assert c.top_ids.shape == c.top_logprobs.shape == (len(c), k)
            x = torch.tensor([prompt + c.token_ids.tolist()])
            with torch.no_grad():
                logits = model(x).logits[0, len(prompt) - 1:-1].float() / 0.7
            if top_k:
                kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            ref = torch.topk(torch.log_softmax(logits, -1), k, dim=-1)
            finite = torch.isfinite(ref.values).numpy()
            assert ((c.top_ids >= 0) == finite).all()
            np.testing.assert_array_equal(c.top_ids[finite], ref.indices.numpy()[finite])
            np.testing.assert_allclose(c.top_logprobs[finite], ref.values.numpy()[finite],
                                       atol=1e-4)
            if top_k:
                assert c.candidate_counts is not None and c.candidate_ids is not None
                assert (c.candidate_counts == top_k).all()
                assert sorted(c.candidate_ids[:top_k].tolist()) == sorted(
                    c.top_ids[0, :top_k].tolist())
