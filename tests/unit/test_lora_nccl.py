"""NCCL weight sync of a LoRA run with ``model.lora.sync = "merged"``: what the trainer's
transport hands vLLM's NCCL broadcast and the servers' ``/update_weights`` is the merged
full weights (base + peft delta) the file store also gets, tensor for tensor.

No GPU here, so no NCCL: the run's own transport (`make_transport`) publishes to fake
servers (tests/unit/test_vllm_nccl.py's aiohttp apps) with the join and the broadcast
replaced by a recorder of the (name, tensor) pairs vLLM's packed producer would send.
Everything before that call (the merge, the cast, the names, update_info) is the code a
GPU run executes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.config import ConfigError, load_config
from pipeline.model import init_tiny_model, load_model, merged_state
from pipeline.weights import MergedLoraTransport, make_transport
from pipeline.weights.nccl import NCCLWeightSync, update_info
from pipeline.weights.nccl_transport import NCCLTransport
from tests.unit.test_export import LORA, lora_trained
from tests.unit.test_vllm_nccl import Rendezvous, fake_servers

torch.set_num_threads(1)


def _overrides(model_dir: Path, tmp_path: Path, sync: str, urls: list[str]) -> list[str]:
    return [f"model.path={model_dir}", f"run.output_dir={tmp_path / 'run'}",
            'model.dtype="bfloat16"', f"model.lora.rank={LORA['rank']}",
            f"model.lora.alpha={LORA['alpha']}",
            f"model.lora.target_modules={LORA['target_modules']!r}".replace("'", '"'),
            f'model.lora.sync="{sync}"', 'generation.engine="vllm"',
            f"generation.vllm.urls={urls!r}".replace("'", '"'),
            'generation.vllm.weight_transfer="nccl"']


def test_a_merged_lora_run_pushes_the_merged_full_weights_the_store_also_holds(
        tmp_path: Path) -> None:
    model_dir = init_tiny_model(tmp_path / "base", seed=0, tie_word_embeddings=True)
    trained = lora_trained(model_dir, seed=4)  # B random: the merge changes the weights
    plain = load_model(model_dir)[0].state_dict()
    want = {k: v.to(torch.bfloat16) for k, v in merged_state(trained).items()}

    async def main() -> tuple[Any, list[Any], Any, dict[str, torch.Tensor]]:
        rdv = Rendezvous()
        async with fake_servers(1, rdv) as (urls, log):
            cfg = load_config(None, _overrides(model_dir, tmp_path, "merged", urls))
            transport = make_transport(cfg)
            assert isinstance(transport, NCCLTransport)
            assert isinstance(transport.fallback, MergedLoraTransport)
            assert transport.sync.servers == urls  # the run's sync, its join faked below
            transport.sync = NCCLWeightSync(  # the broadcast consumes what it is given
                urls, "10.0.0.1", 29500, workers_per_server=1, join=rdv.trainer,
                broadcast=lambda items: rdv.trainer(list(items)))
            await transport.start()
            msg = await transport.publish(trained, version=3, step=30)
            stored = transport.fallback.load(msg)
            await transport.close()
        return msg, log, transport, {"pairs": rdv.calls[-1], "stored": stored}

    msg, log, transport, got = asyncio.run(main())
    pairs: list[tuple[str, torch.Tensor]] = got["pairs"]
    assert transport.fallbacks == 0 and msg.format == "safetensors" and msg.version == 3
    # names: the plain model's (no lora_*, no base_layer), lm_head as its own tensor
    assert [n for n, _ in pairs] == list(plain) and "lm_head.weight" in plain
    assert all(t.dtype == torch.bfloat16 and t.shape == plain[n].shape for n, t in pairs)
    for name, t in pairs:  # values: the merge, cast to the serving dtype
        assert torch.equal(t, want[name]), name
        assert torch.equal(t, got["stored"][name]), name  # the push is what the store holds
    changed = [n for n, t in pairs if not torch.equal(t, plain[n].to(torch.bfloat16))]
    assert changed and all(any(m in n for m in LORA["target_modules"]) for n in changed)
    updates = [body for _, path, _, body in log if path == "/update_weights"]
    assert updates == [{"update_info": update_info(pairs)}]


def test_nccl_with_adapter_sync_is_refused_naming_the_key_and_the_fix(tmp_path: Path) -> None:
    args = _overrides(tmp_path / "m", tmp_path, "adapter", ["http://127.0.0.1:9"])
    with pytest.raises(ConfigError, match=r'generation\.vllm\.weight_transfer: nccl carries '
                       r'full weights.*model\.lora\.sync = "merged"'):
        load_config(None, args)
    merged = load_config(None, _overrides(tmp_path / "m", tmp_path, "merged",
                                          ["http://127.0.0.1:9"]))
    assert merged.generation.vllm.weight_transfer == "nccl"
    assert merged.model.serving_lora is None
