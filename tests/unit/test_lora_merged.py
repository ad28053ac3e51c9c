"""LoRA runs with ``model.lora.sync = "merged"``: the trainer trains an adapter, every
version is the base with it merged in, published and loaded as ordinary full weights
(no ``--enable-lora`` on the servers, a plain model in the in-process engine and the
evaluator, a plain folder from `sluice export`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from pipeline.config import Config, load_config
from pipeline.model import init_tiny_model, load_model, load_policy, merged_state
from pipeline.weights import FileTransport, LoraTransport, MergedLoraTransport, make_transport
from sluice.export import export_run
from sluice.vllm_launch import max_lora_rank
from sluice.vllm_placement import vllm_specs
from tests.unit.test_export import LORA, X, load_export, logits, lora_trained, write_run_json
from workers.engines.transformers import TransformersEngine
from workers.engines.vllm import VLLMEngine

torch.set_num_threads(1)


def _cfg(model_dir: Path, tmp_path: Path, sync: str, *extra: str) -> Config:
    return load_config(None, [
        f"model.path={model_dir}", f"run.output_dir={tmp_path / 'run'}", "run.seed=0",
        f"model.lora.rank={LORA['rank']}", f"model.lora.alpha={LORA['alpha']}",
        f"model.lora.target_modules={LORA['target_modules']!r}".replace("'", '"'),
        f'model.lora.sync="{sync}"', *extra])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_merged_state_is_the_adapted_model_as_plain_weights_and_leaves_the_base_alone(
        tmp_path: Path, tied: bool) -> None:
    model_dir = init_tiny_model(tmp_path / "base", seed=0, tie_word_embeddings=tied)
    peft_model = lora_trained(model_dir, seed=1)
    before = {k: v.clone() for k, v in peft_model.state_dict().items()}

    state = merged_state(peft_model)

    plain = load_model(model_dir)[0].eval()
    assert set(state) == set(plain.state_dict())  # the plain model's keys, no lora_*
    plain.load_state_dict(state, strict=True)
    torch.testing.assert_close(logits(plain), logits(peft_model), rtol=0, atol=2e-5)
    assert not torch.allclose(logits(plain), logits(load_model(model_dir)[0]), atol=1e-3)
    after = peft_model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing merged in place
    untouched = "model.layers.0.self_attn.k_proj.weight"  # not a target module
    own = peft_model.get_base_model().state_dict()[untouched]
    assert state[untouched].data_ptr() == own.data_ptr()  # untouched tensors: no copy


def test_a_merged_version_is_full_weights_every_reader_loads_as_a_plain_model(
        tmp_path: Path) -> None:
    model_dir = init_tiny_model(tmp_path / "base", seed=0)
    cfg = _cfg(model_dir, tmp_path, "merged")
    assert cfg.model.lora is not None and cfg.model.serving_lora is None
    transport = make_transport(cfg)
    assert isinstance(transport, MergedLoraTransport) and isinstance(transport, FileTransport)
    trained = lora_trained(model_dir, seed=2)
    msg = transport.write(trained, version=1, step=7)
    assert (msg.version, msg.step, msg.format) == (1, 7, "safetensors")
    with pytest.raises(TypeError, match="peft"):
        transport.write(load_model(model_dir)[0], version=2, step=8)

    assert isinstance(load_policy(cfg, trained=True)[0], PeftModel)  # the trainer's
    served, tok = load_policy(cfg)  # a generator's or the evaluator's: plain
    assert not isinstance(served, PeftModel)
    engine = TransformersEngine(served, tok)
    assert asyncio.run(engine.load_weights(transport.fetch(msg), 1, msg.format))
    prompts = [X[0, :4].tolist(), X[0, 4:].tolist()]
    got = asyncio.run(engine.greedy(prompts, 8))
    want = asyncio.run(TransformersEngine(trained, tok).greedy(prompts, 8))
    assert [g.token_ids.tolist() for g in got] == [w.token_ids.tolist() for w in want]

    # vLLM: servers start without --enable-lora and the engine loads full weights
    (spec, *_) = vllm_specs(_cfg(model_dir, tmp_path, "merged", 'generation.engine="vllm"',
                                   "generation.vllm.launch=1"))
    assert spec.lora_rank == 0 and "--enable-lora" not in spec.command(8000)
    (spec, *_) = vllm_specs(_cfg(model_dir, tmp_path, "adapter", 'generation.engine="vllm"',
                                   "generation.vllm.launch=1"))
    cmd = spec.command(8000)
    assert spec.lora_rank == LORA["rank"] and "--enable-lora" in cmd
    assert cmd[cmd.index("--max-lora-rank") + 1] == "8"  # rank 4: vLLM takes 1, 8, 16, ...
    urls = 'generation.vllm.urls=["http://127.0.0.1:9"]'  # never contacted here
    assert VLLMEngine.from_config(_cfg(model_dir, tmp_path, "merged", urls)).lora_prefix == ""
    adapter_cfg = _cfg(model_dir, tmp_path, "adapter", urls)
    assert VLLMEngine.from_config(adapter_cfg).lora_prefix != ""
    assert isinstance(make_transport(adapter_cfg), LoraTransport)


def test_export_of_a_merged_run_is_a_plain_folder_with_the_trained_logits(
        tmp_path: Path) -> None:
    model_dir = init_tiny_model(tmp_path / "base", seed=0)
    cfg = _cfg(model_dir, tmp_path, "merged")
    write_run_json(cfg, model_dir)
    trained = lora_trained(model_dir, seed=3)
    make_transport(cfg).write(trained, version=1, step=10)
    for merge_flag, out in ((False, tmp_path / "a"), (True, tmp_path / "b")):
        done = export_run(cfg.output_path, out, merge_lora=merge_flag, log=lambda s: None)
        assert done.what == "merged LoRA" and done.source.version == 1
        torch.testing.assert_close(logits(load_export(out)), logits(trained),
                                   rtol=0, atol=2e-5)


def test_max_lora_rank_is_rounded_up_to_a_value_vllm_accepts() -> None:
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 16, 17, 64, 200, 256)] == \
        [1, 8, 8, 16, 16, 32, 64, 256, 256]
    with pytest.raises(ValueError, match="512"):
        max_lora_rank(513)
