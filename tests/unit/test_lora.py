"""LoRA runs: adapter publishing, adapter-only training, the disabled-adapter reference,
the in-process engine's adapter swaps, the evaluator, and checkpoint resume."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import DynamicCache

from pipeline.bus.schema import ScoredGroup
from pipeline.config import Config, load_config
from pipeline.model import adapter_state, init_tiny_model, load_model, load_policy
from pipeline.rl.losses import LossConfig
from pipeline.weights import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    MANIFEST,
    FileTransport,
    LoraTransport,
    WeightError,
    sha256_file,
    table_sha256,
)
from tests.helpers import check_pause_keep_swap, make_group
from trainer.batch import Batch, build_batch
from trainer.checkpoint import Checkpointer, TrainerState
from trainer.step import StepSettings, compute_loss, optimize, reference_logps, token_logps
from trainer.trainer import Trainer
from workers.engines import Completion, SamplingParams
from workers.engines.transformers import TransformersEngine, WeightMismatchError
from workers.evaluator import Evaluator

torch.set_num_threads(1)

PROMPTS = [[5, 6, 7], [12], [20, 21, 22, 23, 24, 67, 8, 9, 10, 11, 66]]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=0)


def _cfg(base_dir: Path, tmp_path: Path, *extra: str) -> Config:
    return load_config(None, [
        f"model.path={base_dir}", f"run.output_dir={tmp_path / 'out'}", "run.seed=0",
        "model.lora.rank=4", "model.lora.alpha=8", "trainer.lr=0.01", *extra])


def _perturb(model: torch.nn.Module, seed: int, std: float = 0.3) -> None:
    """Random adapter weights (lora_B is zero at init, so a fresh adapter is a no-op)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def _groups() -> list[ScoredGroup]:
    out = []
    for i in range(2):
        g = make_group(f"0:{i}", answer=("123", "45")[i], texts=("123", "12", "45", "9"))
        rewards = np.array([1.0, 0.5, 0.25, 0.0], dtype=np.float32)
        adv = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-4)
        out.append(ScoredGroup(group=g.for_training(),
                               rewards=rewards, reward_parts={"copy": rewards},
                               advantages=adv.astype(np.float32), scorer="t", t_scored=0.0))
    return out


def _batch() -> Batch:
    return build_batch(_groups(), pad_id=0)


def _settings(beta: float = 0.0) -> StepSettings:
    return StepSettings(loss=LossConfig(beta=beta, max_completion_length=8), temperature=1.0)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    batch = _batch()
    with torch.no_grad():
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits


def _adapter_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


# ------------------------------------------------------------------ model + store


def test_load_policy_wraps_deterministically_and_starts_equal_to_the_base(
        base_dir: Path, tmp_path: Path) -> None:
    cfg = _cfg(base_dir, tmp_path)
    a, _ = load_policy(cfg)
    b, _ = load_policy(cfg)
    base, _ = load_model(base_dir)
    assert isinstance(a, PeftModel) and not a.training
    assert all(("lora_" in n) == p.requires_grad for n, p in a.named_parameters())
    sa, sb = adapter_state(a), adapter_state(b)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    torch.testing.assert_close(_logits(a), _logits(base), rtol=0, atol=0)  # lora_B = 0
    full = load_config(None, [f"model.path={base_dir}"])
    assert not isinstance(load_policy(full)[0], PeftModel)


def test_publish_lora_writes_a_peft_directory_that_reloads_to_the_same_logits(
        base_dir: Path, tmp_path: Path) -> None:
    cfg = _cfg(base_dir, tmp_path)
    tr = Trainer(cfg)
    for _ in range(3):
        tr.train_step(_groups())
    tr.model.eval()
    lora = LoraTransport(tmp_path / "w", base_model=base_dir)
    msg = lora.write(tr.model, version=2, step=5)
    d = lora.store.dir_for(2)
    assert (msg.version, msg.step, msg.format) == (2, 5, "lora")
    assert msg.uri == d.as_uri() and lora.store.verify(msg) == d
    assert sorted(p.name for p in d.iterdir()) == sorted([ADAPTER_FILE, ADAPTER_CONFIG, MANIFEST])
    files = {n: sha256_file(d / n) for n in (ADAPTER_FILE, ADAPTER_CONFIG)}
    assert json.loads((d / MANIFEST).read_text())["files"] == files
    assert msg.sha256 == table_sha256(files)
    assert msg.nbytes == sum((d / n).stat().st_size for n in files)
    conf = json.loads((d / ADAPTER_CONFIG).read_text())
    assert conf["base_model_name_or_path"] == str(base_dir.resolve())
    assert (conf["r"], conf["lora_alpha"], conf["peft_type"]) == (4, 8, "LORA")
    assert conf["inference_mode"] is True
    keys = set(load_file(str(d / ADAPTER_FILE)))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert not any(".default." in k for k in keys) and all("lora_" in k for k in keys)

    reloaded = PeftModel.from_pretrained(load_model(base_dir)[0], str(d))
    torch.testing.assert_close(_logits(reloaded), _logits(tr.model), rtol=0, atol=0)
    assert not torch.equal(_logits(reloaded), _logits(load_model(base_dir)[0]))


def test_tampered_adapter_is_refused(base_dir: Path, tmp_path: Path) -> None:
    model, _ = load_policy(_cfg(base_dir, tmp_path))
    lora = LoraTransport(tmp_path / "w")
    msg = lora.write(model, version=1, step=1)
    # announced as full weights, the directory has none: refused, not misread
    with pytest.raises(WeightError, match=r"the manifest is for v1 \(lora\)"):
        lora.store.verify(dataclasses.replace(msg, format="safetensors"))
    f = lora.store.dir_for(1) / ADAPTER_FILE
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(WeightError, match="sha256"):
        lora.store.verify(msg)


# ------------------------------------------------------------------ training


def test_lora_training_changes_only_the_adapter_and_lowers_the_loss(
        base_dir: Path, tmp_path: Path) -> None:
    tr = Trainer(_cfg(base_dir, tmp_path))
    opt_params = [p for g in tr.optimizer.param_groups for p in g["params"]]
    named = dict(tr.model.named_parameters())
    assert {id(p) for p in opt_params} == {id(p) for n, p in named.items() if "lora_" in n}
    assert tr.ref_model is None
    base_before = {n: p.detach().clone() for n, p in named.items() if "lora_" not in n}
    lora_before = _adapter_params(tr.model)
    batch, st = _batch(), _settings()
    with torch.no_grad():
        old, _ = token_logps(tr.model, batch, st.temperature)  # the batch's fixed "old"
    before = float(compute_loss(tr.model, batch, st, old_logps=old)[0].detach())
    for _ in range(4):
        tr.train_step(_groups())
    after = float(compute_loss(tr.model, batch, st, old_logps=old)[0].detach())
    assert after < before - 1e-3
    assert all(torch.equal(p, base_before[n]) for n, p in tr.model.named_parameters()
               if "lora_" not in n)
    assert any(not torch.equal(p, lora_before[n]) for n, p in _adapter_params(tr.model).items())


def test_kl_reference_is_the_base_with_the_adapter_disabled(
        base_dir: Path, tmp_path: Path) -> None:
    model, _ = load_policy(_cfg(base_dir, tmp_path))
    _perturb(model, seed=1)
    base, _ = load_model(base_dir)
    batch = _batch()
    ref = reference_logps(model, batch, 1.0)
    assert ref is not None
    with torch.no_grad():
        want, _ = token_logps(base, batch, 1.0)
        policy, _ = token_logps(model, batch, 1.0)
    torch.testing.assert_close(ref, want, rtol=0, atol=0)
    assert not torch.allclose(policy, want, atol=1e-3)  # the adapter is back on afterwards
    assert reference_logps(base, batch, 1.0) is None  # a plain model has no implicit ref

    # optimize() takes the KL against it: a non-zero kl, no second model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    metrics = optimize(model, opt, batch, _settings(beta=0.1))
    assert metrics["kl"] > 0 and np.isfinite(metrics["loss"])
    tr = Trainer(_cfg(base_dir, tmp_path, "trainer.beta=0.1"))
    assert tr.ref_model is None and np.isfinite(tr.train_step(_groups())["kl"])


def test_checkpoint_round_trip_restores_adapter_and_optimizer(
        base_dir: Path, tmp_path: Path) -> None:
    cfg = _cfg(base_dir, tmp_path)

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        m, _ = load_policy(cfg)
        m.train()
        return m, torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.01)

    model, opt = fresh()
    batch, st = _batch(), _settings()
    for _ in range(2):
        optimize(model, opt, batch, st)
    ck = Checkpointer(tmp_path / "ck")
    path = ck.save(model, opt, TrainerState(step=2, version=1, trained_ids=["0:1"]))
    assert (path / ADAPTER_FILE).is_file() and not (path / "model.safetensors").exists()

    model2, opt2 = fresh()
    state = ck.load_latest(model2, opt2)
    assert state == TrainerState(step=2, version=1, trained_ids=["0:1"])
    a, b = adapter_state(model), adapter_state(model2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    for s1, s2 in zip(opt.state.values(), opt2.state.values(), strict=True):
        assert all(torch.equal(s1[k], s2[k]) for k in s1)
    # resumed training continues exactly as the uninterrupted run would
    optimize(model, opt, batch, st)
    optimize(model2, opt2, batch, st)
    a, b = adapter_state(model), adapter_state(model2)
    assert all(torch.equal(a[k], b[k]) for k in a)

    plain, _ = load_model(base_dir)
    with pytest.raises(ValueError, match="LoRA run"):
        ck.load_latest(plain, torch.optim.AdamW(plain.parameters()))


# ------------------------------------------------------------------ engine + evaluator


def _published(base_dir: Path, tmp_path: Path, seed: int = 1,
               version: int = 1) -> tuple[torch.nn.Module, LoraTransport, Path]:
    """A peft model with random adapter weights, published as ``version``."""
    src, _ = load_policy(_cfg(base_dir, tmp_path))
    _perturb(src, seed)
    lora = LoraTransport(tmp_path / "w")
    msg = lora.write(src, version=version, step=version)
    return src, lora, lora.store.verify(msg)


def test_engine_loads_a_lora_version_and_decodes_like_the_adapter(
        base_dir: Path, tmp_path: Path) -> None:
    cfg = _cfg(base_dir, tmp_path)
    src, _, path = _published(base_dir, tmp_path)
    model, tok = load_policy(cfg)
    eng = TransformersEngine(model, tok)
    want = asyncio.run(TransformersEngine(src, tok).greedy(PROMPTS, 12))
    before = asyncio.run(eng.greedy(PROMPTS, 12))
    assert [c.token_ids.tolist() for c in before] != [c.token_ids.tolist() for c in want]

    assert asyncio.run(eng.load_weights(path, 1, "lora"))
    assert eng.version == 1
    assert not asyncio.run(eng.load_weights(path, 1, "lora"))  # not newer: ignored
    assert not asyncio.run(eng.load_weights(path, 0, "lora"))
    got = asyncio.run(eng.greedy(PROMPTS, 12))
    for g, w in zip(got, want, strict=True):
        assert g.token_ids.tolist() == w.token_ids.tolist() and (g.versions == 1).all()
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-6)


def test_engine_swaps_a_lora_version_mid_generation(base_dir: Path, tmp_path: Path) -> None:
    src, _, path = _published(base_dir, tmp_path)
    model, tok = load_policy(_cfg(base_dir, tmp_path))
    eng = TransformersEngine(model, tok, seed=1)
    max_new = 16

    async def watcher() -> None:
        for _ in range(4):
            await asyncio.sleep(0)
        assert await eng.load_weights(path, 1, "lora")

    async def main() -> list[list[Completion]]:
        res, _ = await asyncio.gather(eng.generate(PROMPTS, 2, SamplingParams(max_new)),
                                      watcher())
        return res

    out = asyncio.run(main())
    assert eng.version == 1

    def old(x: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        with src.disable_adapter():  # a fresh adapter = the base
            return src(x, cache=cache).logits

    check_pause_keep_swap(PROMPTS, out, src.config, old,
                          lambda x, cache: src(x, cache=cache).logits)


def test_engine_refuses_mismatched_weights(base_dir: Path, tmp_path: Path) -> None:
    _, _, path = _published(base_dir, tmp_path)
    plain, tok = load_model(base_dir)
    with pytest.raises(ValueError, match="peft"):
        asyncio.run(TransformersEngine(plain, tok).load_weights(path, 1, "lora"))
    other, _ = load_policy(_cfg(base_dir, tmp_path, "model.lora.rank=2"))
    eng = TransformersEngine(other, tok)
    with pytest.raises(WeightMismatchError, match="shape"):
        asyncio.run(eng.load_weights(path, 1, "lora"))
    narrow, _ = load_policy(_cfg(base_dir, tmp_path, 'model.lora.target_modules=["q_proj"]'))
    with pytest.raises(WeightMismatchError, match="does not match"):
        asyncio.run(TransformersEngine(narrow, tok).load_weights(path, 1, "lora"))
    full = FileTransport(tmp_path / "full").write(plain.state_dict(), version=1, step=1)
    with pytest.raises(WeightMismatchError, match="full weights"):
        asyncio.run(eng.load_weights(Path(full.uri.removeprefix("file://")), 1))
    assert eng.version == 0 and eng._pending is None


def test_evaluator_follows_lora_announcements(base_dir: Path, tmp_path: Path) -> None:
    cfg = _cfg(base_dir, tmp_path, "task.heldout=4")
    src, _ = load_policy(cfg)
    _perturb(src, seed=1)
    lora = LoraTransport(cfg.output_path / "weights")  # the evaluator's store
    msg = lora.write(src, version=3, step=3)
    ev = Evaluator(cfg, every_s=0.0)
    assert asyncio.run(ev.load(msg)) and ev.engine.version == 3
    a, b = adapter_state(ev.engine.model), adapter_state(src)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not asyncio.run(ev.load(dataclasses.replace(msg, version=4, sha256="0" * 64)))
    assert ev.engine.version == 3
