"""Micro-batches, packing and memory-lean logprobs give the maths of one padded full batch.

- accumulated gradients over micro-batches equal one full-batch backward (1e-5), for every
  loss_type, with the KL term on, and with packed layouts;
- packed and prefix-shared logprobs equal the padded forward's (1e-5), which equals the
  plain full-logits path (`token_logps`);
- the micro-batch split keeps every row once, in order, under the budget.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from benchmarks.synthetic import scored_groups
from pipeline.model import init_tiny_model, load_model
from pipeline.rl.losses import LossConfig
from trainer.batch import Batch, build_batch
from trainer.packing import layout_cost, make_layout
from trainer.step import (
    StepSettings,
    compute_loss,
    lean_logps,
    micro_batches,
    optimize,
    token_logps,
)

torch.set_num_threads(1)
LAYOUTS = ("padded", "packed", "shared", "trie")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("mb") / "tiny", seed=3)


@pytest.fixture(scope="module")
def batch() -> Batch:
    groups = scored_groups(3, 4, vocab_size=76, prompt_tokens=(2, 9),
                           completion_tokens=(1, 12), seed=5)
    b = build_batch(groups, pad_id=0)
    b.mask[2, 0] = 0  # a context token (mask 0) inside a completion
    return b


def _settings(loss_type: str = "dapo", beta: float = 0.0, **kw: object) -> StepSettings:
    return StepSettings(loss=LossConfig(loss_type=loss_type, beta=beta,  # type: ignore[arg-type]
                                        max_completion_length=12),
                        temperature=0.9, **kw)  # type: ignore[arg-type]


def _fresh(model_dir: Path) -> torch.nn.Module:
    model, _ = load_model(model_dir)
    model.train()
    return model


def _grads_after_one_step(model_dir: Path, batch: Batch, st: StepSettings,
                          ref: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    model = _fresh(model_dir)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the gradient is what we read
    optimize(model, opt, batch, st, ref)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_lean_logps_equal_the_full_logits_path_in_every_layout(model_dir: Path,
                                                               batch: Batch) -> None:
    model = _fresh(model_dir)
    with torch.no_grad():
        want, _ = token_logps(model, batch, 0.9)
        for layout in LAYOUTS:
            got, ent, _ = lean_logps(model, batch, _settings(layout=layout, chunk_tokens=7),
                                  with_entropy=True)
            m = batch.mask > 0
            torch.testing.assert_close(got[m], want[m], atol=1e-5, rtol=0, msg=layout)
            assert (got[~m] == 0).all()
            assert ent is not None and (ent[m] > 0).all()


def test_packed_layouts_forward_fewer_tokens(batch: Batch) -> None:
    padded, packed, shared, trie = (layout_cost(batch, k) for k in LAYOUTS)
    real = int(batch.seq_lens.sum())
    assert shared < packed <= padded and packed >= real and trie <= packed
    for kind in LAYOUTS:
        lay = make_layout(batch, kind, pad_id=0)  # type: ignore[arg-type]
        assert lay.input_ids.numel() == layout_cost(batch, kind)  # type: ignore[arg-type]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_accumulated_gradients_equal_one_full_batch_backward(
        model_dir: Path, batch: Batch, loss_type: str, layout: str) -> None:
    full = _grads_after_one_step(model_dir, batch, _settings(loss_type))
    st = _settings(loss_type, micro_batch_tokens=40, layout=layout)
    assert len(micro_batches(batch, st)) >= 3
    split = _grads_after_one_step(model_dir, batch, st)
    assert full.keys() == split.keys()
    for name, g in full.items():
        torch.testing.assert_close(split[name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_kl_term_accumulates_like_the_full_batch(model_dir: Path, batch: Batch) -> None:
    ref = _fresh(model_dir)
    with torch.no_grad():  # a reference that differs from the policy: KL is not zero
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    full = _grads_after_one_step(model_dir, batch, _settings(beta=0.3), ref)
    split = _grads_after_one_step(model_dir, batch,
                                  _settings(beta=0.3, micro_batch_tokens=40, layout="shared"),
                                  ref)
    for name, g in full.items():
        torch.testing.assert_close(split[name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_a_wrong_normaliser_would_be_caught(model_dir: Path, batch: Batch) -> None:
    """Guards the equality above: per-micro-batch normalisers give other gradients."""
    full = _grads_after_one_step(model_dir, batch, _settings("grpo"))
    model = _fresh(model_dir)
    st = _settings("grpo", micro_batch_tokens=40)
    for mb in micro_batches(batch, st):
        compute_loss(model, mb, st)[0].backward()  # each micro-batch normalised by itself
    diff = max(float((p.grad - full[n]).abs().max()) for n, p in model.named_parameters())
    assert diff > 1e-4


def test_micro_batches_keep_every_row_once_in_order_under_the_budget(batch: Batch) -> None:
    for layout in LAYOUTS:
        st = _settings(micro_batch_tokens=40, layout=layout)
        mbs = micro_batches(batch, st)
        rows = [tuple(mb.input_ids[i, :int(mb.seq_lens[i])].tolist())
                for mb in mbs for i in range(mb.num_rows)]
        want = [tuple(batch.input_ids[i, :int(batch.seq_lens[i])].tolist())
                for i in range(batch.num_rows)]
        assert rows == want and len(mbs) >= 3
        longest = int(batch.seq_lens.max())
        for mb in mbs:  # over budget only when one unit alone is
            assert layout_cost(mb, layout) <= max(40, longest * mb.num_rows)  # type: ignore
        assert sum(mb.num_tokens for mb in mbs) == batch.num_tokens


def test_non_finite_loss_skips_the_step(model_dir: Path, batch: Batch) -> None:
    model = _fresh(model_dir)
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    bad = copy.deepcopy(batch)
    bad.advantages[0] = float("inf")
    metrics = optimize(model, opt, bad, _settings())
    assert metrics["skipped"] == 1.0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert optimize(model, opt, batch, _settings())["skipped"] == 0.0
    assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_gradient_checkpointing_recomputes_without_changing_gradients(
        model_dir: Path, batch: Batch, tmp_path: Path) -> None:
    from pipeline.config import load_config
    from trainer import setup

    grads = {}
    for on in (False, True):
        cfg = load_config(None, [f"model.path={model_dir}", f"run.output_dir={tmp_path}",
                                 f"trainer.gradient_checkpointing={str(on).lower()}",
                                 "trainer.packing=true", "generation.temperature=0.9"])
        s = setup.build(cfg)
        assert s.model.is_activation_checkpointing == on
        optimize(s.fwd, torch.optim.SGD(s.model.parameters(), lr=0.0), batch, s.settings)
        grads[on] = {n: p.grad for n, p in s.model.named_parameters()}
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_zero_advantage_rows_are_not_forwarded_but_counted(model_dir: Path, batch: Batch,
                                                           loss_type: str) -> None:
    """At beta 0 rows at advantage 0 (a zero-variance group trained as TRL does) are
    skipped by `optimize`, and the gradient equals the full batch's (their tokens and
    rows still in the normaliser); an all-zero step still steps AdamW with zero grads."""
    b = copy.deepcopy(batch)
    b.advantages[4:8] = 0.0  # the second group is flat
    st = _settings(loss_type)
    got = _grads_after_one_step(model_dir, b, st)
    model = _fresh(model_dir)  # reference: every row forwarded, normaliser of the batch
    loss, _ = compute_loss(model, b, st)
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(got[n], p.grad, atol=1e-6, rtol=1e-5, msg=n)
    # the normaliser counted the skipped rows: dropping them changes the gradient
    alone = _grads_after_one_step(model_dir, b.rows([0, 1, 2, 3, 8, 9, 10, 11]), st)
    assert any(not torch.allclose(alone[n], got[n], atol=1e-7) for n in got)

    flat = copy.deepcopy(batch)
    flat.advantages.zero_()
    model = _fresh(model_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    out = optimize(model, opt, flat, st)
    assert out["grad_norm"] == 0.0 and out["skipped"] == 0.0
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert opt.state[next(model.parameters())]["step"] == 1  # AdamW stepped (as TRL's)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # m = 0
