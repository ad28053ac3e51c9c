"""The evaluator's scoring on a real vLLM server equals it in-process, for a swapped-in
version (the server is left at model_a's weights, as tests/vllm/test_contract.py does)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pipeline.config import load_config
from pipeline.model import load_model
from tests.vllm.conftest import VLLMServer
from workers.engines.transformers import TransformersEngine
from workers.evaluator import eval_vllm_engine, evaluate
from workers.tasks.catalog import make_task
from workers.tasks.rewards import load_reward

REWARDS = [load_reward("workers.tasks.rewards:copy_reward"),
           load_reward("workers.tasks.rewards:exact_match", 0.0)]


def test_eval_on_vllm_equals_eval_in_process_for_a_new_version(
        vllm_server: VLLMServer) -> None:
    cfg = load_config(None, [f"model.path={vllm_server.model_dir}", "eval.engine=vllm",
                             f"eval.vllm_urls=[\"{vllm_server.url}\"]"])
    prompts = make_task("copy", seed=0, num_prompts=64).heldout(48)
    other, tok = load_model(vllm_server.other_model_dir)

    async def on_vllm() -> dict[str, float]:
        engine = eval_vllm_engine(cfg)
        await engine.start()
        try:
            assert await engine.load_weights(vllm_server.other_model_dir, 7)
            return await evaluate(engine, tok, prompts, 8, REWARDS)
        finally:
            await engine.load_weights(vllm_server.model_dir, 10_000)  # leave model_a
            await engine.close()

    got = asyncio.run(on_vllm())
    want = asyncio.run(evaluate(TransformersEngine(other, tok, seed=0), tok, prompts, 8,
                                REWARDS))
    assert got == want
    assert 0.0 < got["reward"] < 1.0  # a real score, not an empty or saturated one


def test_a_server_serving_the_model_under_its_hub_id_is_accepted(
        vllm_server: VLLMServer, tmp_path: Path) -> None:
    """`vllm serve org/name` serves the hub id; sluice's model is the pinned snapshot
    folder (the same files elsewhere). The engine accepts the server by the alias
    (run.json's source) and sends requests under the server's name; without the alias it
    refuses the server."""
    import shutil

    from workers.engines.base import SamplingParams
    from workers.engines.vllm import VLLMEngine

    snapshot = shutil.copytree(vllm_server.model_dir, tmp_path / "snapshots" / "abc")

    async def generate(aliases: tuple[str, ...]) -> int:
        engine = VLLMEngine([vllm_server.url], str(snapshot), seed=0, model_aliases=aliases)
        try:
            await asyncio.wait_for(engine.start(), 120)
            out = await asyncio.wait_for(
                engine.generate([[10, 11, 66]], 2, SamplingParams(max_new_tokens=3)), 120)
            return sum(len(c) for g in out for c in g)
        finally:
            await engine.close()

    assert asyncio.run(generate((vllm_server.model,))) > 0
    import pytest

    from workers.engines.base import EngineError

    with pytest.raises(EngineError, match=r"serves .* not '.*snapshots/abc'"):
        asyncio.run(generate(()))
