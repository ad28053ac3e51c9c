"""A vision-language model trained on text only (`pipeline.vlm`, docs/vlm.md).

The tiny Qwen2.5-VL of `pipeline.model.init_tiny_model` (recipe ``tiny-char-qwen2_5_vl``):
its vision tower and merger are frozen by TRL's rule (everything but the text model and
``lm_head``), absent from the optimizer, from checkpoints' optimizer state and from every
version a transport writes or pushes (file, delta, NCCL: the names a push would send);
the in-process engine keeps the tower it loaded bit for bit over several versions, even
when the trainer's own copy of the tower is changed behind its back; packed and shared
layouts give the padded logprobs under M-RoPE (and would not with 2D positions); a
prompt carrying an image is refused when the task is built.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from benchmarks.synthetic import scored_groups
from pipeline.config import ConfigError, load_config
from pipeline.model import VOCAB_SIZE, build_char_tokenizer, init_tiny_model, load_model
from pipeline.vlm import VISION_TOKENS, check_model, frozen_keys
from pipeline.weights import FileTransport, read_full
from pipeline.weights.nccl import update_info
from pipeline.weights.nccl_transport import NCCLTransport
from pipeline.weights.shards import sharded_files
from trainer import setup
from trainer.batch import build_batch
from trainer.checkpoint import Checkpointer, TrainerState
from trainer.logprobs import CompletionLogprobs
from trainer.packing import make_layout
from trainer.step import optimize
from trainer.trainer import Trainer
from workers.engines.base import SamplingParams
from workers.engines.transformers import TransformersEngine, read_weights
from workers.tasks.data import JsonlTask, row_to_prompt

torch.set_num_threads(1)
TOWER = "model.visual."


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("vlm") / "tiny-vl", seed=3, hidden_size=64,
                           intermediate_size=128, recipe="tiny-char-qwen2_5_vl")


def _cfg(vlm_dir: Path, out: Path, *sets: str):
    return load_config(None, [f"model.path={vlm_dir}", f"run.output_dir={out}",
                              "trainer.device=cpu", "trainer.beta=0", "trainer.lr=1e-2",
                              *sets])


def _batch(seed: int = 7):
    groups = scored_groups(3, 4, vocab_size=VOCAB_SIZE, prompt_tokens=(2, 9),
                           completion_tokens=(1, 12), seed=seed)
    return build_batch(groups, pad_id=0)


def _published(s: setup.TrainSetup) -> dict[str, torch.Tensor]:
    """What `Trainer.weights` publishes for the trainer built by ``s`` (one process)."""
    trainer = SimpleNamespace(setup=s, model=s.model, ranks=s.ranks)
    trainer.local_weights = lambda: Trainer.local_weights(trainer)  # type: ignore[arg-type]
    return Trainer.weights(trainer)  # type: ignore[arg-type,return-value]


def _tower(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in state.items() if k.startswith(TOWER)}


def test_the_tiny_vlm_freezes_what_trl_freezes(vlm_dir: Path) -> None:
    model, tok = load_model(vlm_dir)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    keys = set(model.state_dict())
    frozen = frozen_keys(model)
    # TRL: everything but the text model (its config is the text config) and lm_head
    assert frozen == {k for k in keys if not k.startswith(("model.language_model.",
                                                            "lm_head."))}
    assert frozen == {k for k in keys if k.startswith(TOWER)}  # tower + merger, here
    assert any(".merger." in k for k in frozen) and any(".blocks.0." in k for k in frozen)
    # the char ids are the plain tiny model's; the vision tokens come after them
    chars = build_char_tokenizer()
    assert tok("a1 =b").input_ids == chars("a1 =b").input_ids
    assert tok.convert_tokens_to_ids(list(VISION_TOKENS)) == list(range(76, 80))
    assert model.config.image_token_id == 78 and len(tok) == model.config.text_config.vocab_size
    assert (vlm_dir / "preprocessor_config.json").is_file()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_shared_and_trie_logprobs_equal_padded_under_mrope(vlm_dir: Path, attn: str,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    model, _ = load_model(vlm_dir, attn_implementation=attn)
    batch = _batch()
    fwd = CompletionLogprobs(model, 0.9, chunk_tokens=7)
    with torch.no_grad():
        padded = fwd(make_layout(batch, "padded", 0), batch)[0]
        for kind in ("packed", "shared", "trie"):
            got = fwd(make_layout(batch, kind, 0), batch)[0]
            torch.testing.assert_close(got, padded, atol=1e-5, rtol=0)
        # the case model_positions exists for: Qwen2.5-VL expands [R, C] positions to
        # three axes only and then builds no per-sample mask for a packed row
        monkeypatch.setattr("trainer.logprobs.model_positions", lambda pos, config: pos)
        wrong = fwd(make_layout(batch, "packed", 0), batch)[0]
    assert (wrong - padded).abs().max() > 1e-3


def test_the_trainer_trains_only_the_text_model_and_publishes_no_tower(
        vlm_dir: Path, tmp_path: Path) -> None:
    cfg = _cfg(vlm_dir, tmp_path / "run")
    s = setup.build(cfg)
    state = s.model.state_dict()
    tower = set(_tower(state))
    assert s.frozen == tower
    optimized = {id(p) for g in s.optimizer.param_groups for p in g["params"]}
    named = dict(s.model.named_parameters())
    assert optimized == {id(p) for n, p in named.items() if n not in tower}
    before = _tower(state)
    text_before = state["model.language_model.layers.0.mlp.up_proj.weight"].clone()
    optimize(s.fwd, s.optimizer, _batch(), s.settings)
    after = s.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in tower)
    assert all(named[k].grad is None for k in named if k in tower)
    assert not torch.equal(text_before,
                           after["model.language_model.layers.0.mlp.up_proj.weight"])
    # checkpoints: optimizer state keyed by parameter name, none of the tower's
    path = Checkpointer(tmp_path / "ckpt").save(s.model, s.optimizer, TrainerState(step=1),
                                                s.scheduler)
    assert path is not None
    saved = torch.load(path / "optimizer.pt", weights_only=True)["optimizer"]["state"]
    assert saved and not any(k.startswith(TOWER) for k in saved)
    assert set(saved) == set(named) - tower
    # every version, full or delta, holds the trained tensors and nothing of the tower
    source = _published(s)
    assert set(source) == set(after) - tower
    transport = FileTransport(tmp_path / "weights", full_every=2,
                              cache_dir=tmp_path / "cache")
    for version in (1, 2, 3):
        msg = transport.write(source, version=version, step=version)
        written = read_full(transport.store.verify(msg)) if msg.format != "delta" else None
        if written is not None:
            assert set(written) == set(source)
        for f in transport.store.verify(msg).glob("*.safetensors"):
            with safe_open(str(f), "pt") as h:
                assert not any(TOWER in k for k in h.keys()), (f, version)
        assert set(transport.load(msg)) == set(source)


def test_an_nccl_push_sends_no_tower(vlm_dir: Path, tmp_path: Path) -> None:
    from tests.unit.test_vllm_nccl import Rendezvous, _sync, fake_servers

    cfg = _cfg(vlm_dir, tmp_path / "run")
    s = setup.build(cfg)
    source = _published(s)

    async def main() -> list[tuple[int, str, dict[str, str], object]]:
        rdv = Rendezvous()
        async with fake_servers(1, rdv) as (urls, log):
            sync = _sync(urls, rdv, workers_per_server=1)
            sync.group = "group"
            transport = NCCLTransport(sync, FileTransport(tmp_path / "weights"))
            await transport.publish(source, version=1, step=1)
            await transport.close()
        assert transport.fallbacks == 0
        pushed = [n for n, _ in rdv.calls[0]]
        assert pushed == list(source) and not any(n.startswith(TOWER) for n in pushed)
        return log

    log = asyncio.run(main())
    info = next(b["update_info"] for _, p, _, b in log if p == "/update_weights")
    assert info == update_info(list(source.items()))
    assert "model.language_model.embed_tokens.weight" in info["names"]
    assert not any(n.startswith(TOWER) for n in info["names"])


def test_the_in_process_engine_keeps_its_tower_bit_for_bit(vlm_dir: Path,
                                                          tmp_path: Path) -> None:
    """Three versions (full, delta, full) from a trainer whose own tower copy is changed
    on purpose before each: the engine's tower stays the loaded one; its text model
    takes every version."""
    cfg = _cfg(vlm_dir, tmp_path / "run")
    s = setup.build(cfg)
    engine_model, tok = load_model(vlm_dir)
    loaded = _tower(engine_model.state_dict())
    engine = TransformersEngine(engine_model, tok)
    transport = FileTransport(tmp_path / "weights", full_every=2,
                              cache_dir=tmp_path / "cache")
    params = SamplingParams(max_new_tokens=4, temperature=1.0)

    async def main() -> None:
        for version in (1, 2, 3):
            optimize(s.fwd, s.optimizer, _batch(seed=version), s.settings)
            with torch.no_grad():  # someone trains the trainer's tower: never published
                s.model.model.visual.merger.mlp[0].weight.add_(1.0)
            source = _published(s)
            msg = transport.write(source, version=version, step=version)
            assert await engine.load_weights(await transport.receive(msg), version)
            out = await engine.generate([[5, 6, 7]], 2, params)
            assert len(out[0]) == 2 and engine.version == version
            now = engine_model.state_dict()
            assert all(torch.equal(loaded[k], now[k]) for k in loaded)
            for k, v in source.items():
                assert torch.equal(now[k], v), k

    asyncio.run(main())
    # a version that does name tower tensors (another writer): they are left out
    full = {k: v + 1 for k, v in engine_model.state_dict().items()}
    folder = tmp_path / "foreign"
    folder.mkdir()
    for name, data in sharded_files(full, version=9, max_shard_bytes=1 << 30):
        (folder / name).write_bytes(data)
    state = read_weights(engine_model, folder, "safetensors", engine.frozen)
    assert not any(k.startswith(TOWER) for k in state) and state


def test_frozen_prefixes_freeze_more_and_name_a_parameter(vlm_dir: Path,
                                                          tmp_path: Path) -> None:
    cfg = _cfg(vlm_dir, tmp_path / "run",
               'model.frozen_prefixes=["model.language_model.embed_tokens"]')
    check_model(cfg)
    s = setup.build(cfg)
    assert "model.language_model.embed_tokens.weight" in s.frozen
    assert not s.model.model.language_model.embed_tokens.weight.requires_grad
    bad = _cfg(vlm_dir, tmp_path / "run", 'model.frozen_prefixes=["model.nothing"]')
    with pytest.raises(ConfigError, match=r"model\.frozen_prefixes: 'model\.nothing'"):
        check_model(bad)
    with pytest.raises(ConfigError, match=r"model\.frozen_prefixes"):
        setup.build(bad)
    with pytest.raises(ValueError, match=r"model\.frozen_prefixes"):
        _cfg(vlm_dir, tmp_path / "run", 'model.frozen_prefixes=["model.norm"]',
             "model.lora.rank=4")


def test_lora_on_a_vlm_is_refused_at_start(vlm_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.lora: LoRA on a vision-language model"):
        check_model(_cfg(vlm_dir, tmp_path / "run", "model.lora.rank=4"))


def test_a_prompt_with_an_image_is_refused_when_the_task_is_built(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"row 1: column 'image' holds an image.*text only"):
        row_to_prompt({"prompt": "what is this?", "image": "cat.png"}, "row 1")
    part = [{"role": "user", "content": [{"type": "image"},
                                         {"type": "text", "text": "what is this?"}]}]
    with pytest.raises(ValueError, match=r"\[0\]: a 'image' content part.*not supported"):
        row_to_prompt({"prompt": part}, "row 2")
    text_parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert row_to_prompt({"prompt": text_parts, "images": []}, "row 3")["text"] == text_parts
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps(
        {"prompt": [{"role": "user", "content": [{"type": "image_url",
                                                  "image_url": {"url": "x"}}]}]}) + "\n")
    with pytest.raises(ValueError, match=f"{data}:2.*'image_url' content part"):
        JsonlTask(data)


def test_export_of_a_version_takes_the_tower_from_the_base(vlm_dir: Path,
                                                            tmp_path: Path) -> None:
    from sluice.export import Base, load_full

    cfg = _cfg(vlm_dir, tmp_path / "run")
    s = setup.build(cfg)
    optimize(s.fwd, s.optimizer, _batch(), s.settings)
    source = _published(s)
    msg = FileTransport(tmp_path / "weights").write(source, version=1, step=1)
    published = read_full(tmp_path / "weights" / f"v{msg.version:08d}")
    model = load_full(Base(vlm_dir, str(vlm_dir), "float32", None), published)
    base, _ = load_model(vlm_dir)
    got, want = model.state_dict(), base.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in _tower(want))
    assert all(torch.equal(got[k], v) for k, v in published.items())


def test_model_flops_count_the_text_model_not_the_tower(vlm_dir: Path) -> None:
    from trainer.perf import ModelShape

    model, _ = load_model(vlm_dir)
    linears = {n: m.weight.numel() for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)}
    text = sum(v for n, v in linears.items() if n.startswith("model.language_model.")
               or n == "lm_head")
    shape = ModelShape.of(model)
    assert shape.matmul_params == text < sum(linears.values())
    assert (shape.layers, shape.attention_width) == (2, 64)


def test_init_model_builds_the_vlm_and_deployments_refuse_to(tmp_path: Path) -> None:
    from sluice.cli import main
    from sluice.deploy.plan import make_plan

    assert main(["init-model", str(tmp_path / "m"), "--recipe", "tiny-char-qwen2_5_vl"]) == 0
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    cfg = load_config(None, [f"model.path={tmp_path / 'n'}", "model.init=tiny-char-qwen2_5_vl",
                             f"run.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"model\.init: a deployment builds only"):
        make_plan(cfg, "compose")
