"""The entropy bonus and adaptive entropy control (`pipeline.rl.entropy_control`), as TRL
1.16's GRPOTrainer defines them (`entropy_coef`, `use_adaptive_entropy`):

- the controller follows TRL's rule step by step (apply the coefficient only when the
  previous step's entropy was at or below the target; then move it by delta, clipped);
- the bonus's gradient is exactly -c times the gradient of the step's mean token entropy,
  computed by brute force on full logits, whatever the micro-batch split;
- with the bonus enabled every row is forwarded, zero-advantage rows included.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from benchmarks.synthetic import scored_groups
from pipeline.config import ConfigError, load_config
from pipeline.model import init_tiny_model, load_model
from pipeline.rl.entropy_control import EntropyControl
from pipeline.rl.logprobs import entropy_from_logits
from pipeline.rl.losses import LossConfig
from trainer.batch import Batch, build_batch
from trainer.step import StepSettings, gradient_rows, optimize, token_logps

torch.set_num_threads(1)
T = 0.9


def test_adaptive_control_follows_trls_rule_step_by_step() -> None:
    c = EntropyControl(coef=0.01, adaptive=True, target=0.2, delta=0.005, coef_max=0.02)
    applied = []
    for h in (0.5, 0.1, 0.1, 0.1, 0.1, 0.3, 0.15):
        applied.append(c.applied())
        c.update(h)
    # step 1: no entropy measured yet (TRL's _last_world_entropy = inf): nothing applied;
    # 0.5 > target -> coef 0.005; 0.1 -> 0.010 (applied from the next step), 0.015,
    # 0.020, capped at 0.020; 0.3 -> 0.015 and not applied next; 0.15 -> 0.020
    assert applied == pytest.approx([0.0, 0.0, 0.01, 0.015, 0.02, 0.02, 0.0])
    assert c.coef == pytest.approx(0.02) and c.last_entropy == 0.15
    c.update(math.nan)  # a step with no trained token changes nothing
    assert c.coef == pytest.approx(0.02) and c.last_entropy == 0.15
    low = EntropyControl(coef=0.003, adaptive=True, coef_min=0.001)
    low.update(0.9)
    assert low.coef == pytest.approx(0.001)  # clipped at the minimum


def test_static_bonus_and_when_the_bonus_is_enabled() -> None:
    static = EntropyControl(coef=0.01)
    static.update(0.0)
    assert static.applied() == 0.01 and static.enabled
    assert not EntropyControl().enabled
    assert EntropyControl(adaptive=True).enabled  # adaptive from 0 may grow a bonus
    cfg = load_config(None, ["trainer.adaptive_entropy=true", "trainer.entropy_coef=0.02"])
    assert EntropyControl.of(cfg.trainer).applied() == 0.0  # no entropy measured yet
    with pytest.raises(ConfigError, match="entropy_coef_min"):
        load_config(None, ["trainer.entropy_coef_min=0.5", "trainer.entropy_coef_max=0.1"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("ent") / "tiny", seed=3)


@pytest.fixture(scope="module")
def batch() -> Batch:
    groups = scored_groups(3, 4, vocab_size=76, prompt_tokens=(2, 9),
                           completion_tokens=(1, 12), seed=5)
    b = build_batch(groups, pad_id=0)
    b.advantages[:4] = 0.0  # a zero-variance group: its rows carry entropy, no policy term
    return b


def _grads(model_dir: Path, batch: Batch, coef: float, every_row: bool,
           micro_batch_tokens: int = 0) -> dict[str, torch.Tensor]:
    model, _ = load_model(model_dir)
    model.train()
    st = StepSettings(loss=LossConfig(loss_type="dapo", max_completion_length=12),
                      temperature=T, micro_batch_tokens=micro_batch_tokens, chunk_tokens=5)
    optimize(model, torch.optim.SGD(model.parameters(), lr=0.0), batch, st,
             entropy_coef=coef, every_row=every_row)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("micro_batch_tokens", [0, 24])
def test_the_bonus_gradient_is_minus_c_times_the_mean_entropy_gradient(
        model_dir: Path, batch: Batch, micro_batch_tokens: int) -> None:
    coef = 0.3
    with_bonus = _grads(model_dir, batch, coef, True, micro_batch_tokens)
    without = _grads(model_dir, batch, 0.0, True, micro_batch_tokens)
    model, _ = load_model(model_dir)
    model.train()
    _, logits = token_logps(model, batch, T)
    m = batch.mask
    mean_entropy = (entropy_from_logits(logits / T) * m).sum() / m.sum()
    (-coef * mean_entropy).backward()
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        torch.testing.assert_close(with_bonus[name] - without[name], p.grad, atol=1e-6,
                                   rtol=1e-4, msg=name)


def test_with_the_bonus_every_row_is_forwarded(batch: Batch) -> None:
    loss = LossConfig(loss_type="dapo", max_completion_length=12)
    assert len(gradient_rows(batch, loss)) == batch.num_rows - 4
    assert len(gradient_rows(batch, loss, every_row=True)) == batch.num_rows
