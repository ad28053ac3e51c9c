"""LoRA adapters on a real vLLM server: per-version names, output switches, rotation.

The adapters are written by sluice's own `lora` weight store (what the trainer
publishes), so this also checks that vLLM's ``/v1/load_lora_adapter`` reads them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import torch

from pipeline.config import LoraConfig
from pipeline.model import apply_lora, load_model
from pipeline.vllm_auth import auth_headers, vllm_api_key
from pipeline.weights import LoraTransport
from tests.helpers import wait_for_async
from tests.vllm.conftest import VLLMServer
from workers.engines import SamplingParams
from workers.engines.vllm import VLLMEngine

PROMPTS = [[10, 11, 12, 13, 66], [20, 21, 22, 66]]


def publish_adapters(srv: VLLMServer, root: Path, versions: list[int]) -> list[tuple[Any, Path]]:
    """One random (large) adapter per version on model_a, published like the trainer
    does; returns (peft model, directory) per version."""
    store = LoraTransport(root, keep=100, base_model=srv.model_dir)
    out = []
    for v in versions:
        base, _ = load_model(srv.model_dir)
        model = apply_lora(base, LoraConfig(rank=8), seed=v)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, 0.5, generator=torch.Generator().manual_seed(v * 1000 +
                                                                              len(name)))
        msg = store.write(model, version=v, step=v)
        out.append((model, store.store.verify(msg)))
    return out


def peft_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n,
                             do_sample=False, eos_token_id=1, pad_token_id=0)
    return out[0, len(prompt):].tolist()


async def served(url: str) -> list[str]:
    async with aiohttp.ClientSession(headers=auth_headers(vllm_api_key())) as s, \
            s.get(url + "/v1/models") as r:
        return [m["id"] for m in (await r.json())["data"]]


def test_lora_versions_switch_outputs_and_old_adapters_are_unloaded(
        vllm_server: VLLMServer, tmp_path: Path) -> None:
    adapters = publish_adapters(vllm_server, tmp_path / "weights", [1, 2, 3])
    params = SamplingParams(max_new_tokens=10, greedy=True)

    async def go() -> dict[str, Any]:
        e = VLLMEngine([vllm_server.url], vllm_server.model, seed=0, lora_prefix="t",
                       keep_adapters=2)
        await e.start()
        res: dict[str, Any] = {}
        try:
            res["base"] = await e.generate(PROMPTS, 1, params)
            for model_and_dir, v in zip(adapters, (1, 2, 3), strict=True):
                assert await e.load_weights(model_and_dir[1], v, "lora")
                res[v] = await e.generate(PROMPTS, 1, params)
                res[f"served{v}"] = await served(vllm_server.url)
            assert not await e.load_weights(adapters[0][1], 2, "lora")  # not newer

            async def unloads_done() -> bool:
                return not e.servers[0].unloading

            # the unload of v1 runs in the background: wait until none is in flight
            await wait_for_async(unloads_done, 60,
                                 lambda: f"the unloads {e.servers[0].unloading} to end")
            res["served_end"] = await served(vllm_server.url)
            res["unloaded"] = list(e.servers[0].unloaded)
        finally:
            await e.close()
        return res

    res = asyncio.run(go())
    for i, prompt in enumerate(PROMPTS):
        outs = {v: res[v][i][0].token_ids.tolist() for v in (1, 2, 3)}
        assert outs[1] != res["base"][i][0].token_ids.tolist() or outs[2] != outs[1]
        for v, (model, _) in zip((1, 2, 3), adapters, strict=True):
            assert outs[v] == peft_greedy(model, prompt, 10), (v, prompt)
            assert (res[v][i][0].versions == v).all()
    assert "t-v1" in res["served1"] and "t-v2" in res["served2"]
    # keep_adapters = 2 (max_staleness 1 + 1): loading v3 unloads v1
    assert res["unloaded"] == ["t-v1"]
    assert "t-v1" not in res["served_end"]
    assert {"t-v2", "t-v3"} <= set(res["served_end"])
