"""Exported folders served by a real vLLM server (the session's; no second server).

The session server serves model_a; the test runs are made on model_a itself, so an
exported folder has the server's architecture. The server loads each folder by path
through the same routes as sluice's weight swaps: ``collective_rpc reload_weights``
(full weights, also the merged LoRA) and ``/v1/load_lora_adapter`` (the adapter
folder). Its greedy output must then be exactly what transformers (or peft, for the
adapter) greedy-decodes from the exported folder, and differ from the base's.
What this does not cover: a server started cold on an exported folder (its tokenizer
and config are read only at start), and tied embeddings, which the session's untied
model cannot take (see test_tied.py for why a reload keeps a stale lm_head there).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from pipeline.model import load_model
from sluice.export import export_run
from tests.unit.test_export import make_run
from tests.vllm.conftest import VLLMServer
from workers.engines import SamplingParams
from workers.engines.vllm import VLLMEngine

PROMPTS = [[10, 11, 12, 13, 66], [20, 21, 22, 66], [30, 31, 66]]
MAX_NEW = 12


@torch.no_grad()
def hf_greedy(model: Any) -> list[list[int]]:
    model.eval()
    outs = []
    for prompt in PROMPTS:
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=MAX_NEW,
                             do_sample=False, eos_token_id=1, pad_token_id=0)
        outs.append(out[0, len(prompt):].tolist())
    return outs


def served_greedy(srv: VLLMServer, path: Path, fmt: str = "safetensors") -> list[list[int]]:
    """Load ``path`` into the session server as sluice's engine does, greedy-decode,
    and leave model_a's weights (no adapter) behind."""
    lora = fmt == "lora"

    async def go() -> list[list[int]]:
        e = VLLMEngine([srv.url], srv.model, seed=0, lora_prefix="export" if lora else "",
                       keep_adapters=1 if lora else 0)
        await e.start()
        try:
            assert await e.load_weights(path, 1, fmt)
            groups = await e.generate(PROMPTS, 1, SamplingParams(MAX_NEW, greedy=True))
            return [g[0].token_ids.tolist() for g in groups]
        finally:
            if lora:
                await e._call(e.servers[0], "POST", "/v1/unload_lora_adapter",
                              {"lora_name": "export-v1"})
            else:
                await e.load_weights(srv.model_dir, 10_000)  # leave model_a's weights
            await e.close()

    return asyncio.run(go())


def from_folder(out: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(out, local_files_only=True,
                                                dtype=torch.float32)


def test_exported_full_weights_are_served_as_transformers_decodes_them(
        vllm_server: VLLMServer, tmp_path: Path) -> None:
    cfg, _, _ = make_run(tmp_path, base=vllm_server.model_dir, versions=1)
    export_run(cfg.output_path, tmp_path / "out")
    want = hf_greedy(from_folder(tmp_path / "out"))
    assert want != hf_greedy(load_model(vllm_server.model_dir)[0])  # not the base's output
    assert served_greedy(vllm_server, tmp_path / "out") == want


def test_exported_lora_adapter_and_merge_are_served_as_peft_decodes_them(
        vllm_server: VLLMServer, tmp_path: Path) -> None:
    from peft import AutoPeftModelForCausalLM

    cfg, _, published = make_run(tmp_path, base=vllm_server.model_dir, lora=True,
                                 versions=1)
    base = hf_greedy(load_model(vllm_server.model_dir)[0])
    export_run(cfg.output_path, tmp_path / "adapter")
    want = hf_greedy(AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter",
                                                              local_files_only=True))
    assert want == hf_greedy(published[1]) and want != base
    assert served_greedy(vllm_server, tmp_path / "adapter", "lora") == want

    export_run(cfg.output_path, tmp_path / "merged", merge_lora=True)
    merged = hf_greedy(from_folder(tmp_path / "merged"))
    assert merged == want
    assert served_greedy(vllm_server, tmp_path / "merged") == merged
