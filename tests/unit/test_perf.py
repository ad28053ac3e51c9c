"""Model FLOPs, MFU and the forwarded-layout figures (trainer/perf.py,
trainer.packing.layout_stats) against hand counts on tiny cases."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.batch import Batch
from trainer.packing import layout_stats
from trainer.perf import ModelShape, device_peak_flops, mfu_metrics, step_flops


def tiny_llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


def test_model_shape_is_the_hand_count() -> None:
    """Per layer q 16x16, k and v 16x8 (2 KV heads of 4), o 16x16, gate/up/down 16x32:
    2,304; two layers 4,608; the LM head 100x16 (tied: counted once, the embedding
    lookup not at all) 1,600. d_attn = 4 heads x 4."""
    shape = ModelShape.of(tiny_llama())
    assert shape == ModelShape(matmul_params=6208, layers=2, attention_width=16)


def test_step_flops_is_the_hand_count() -> None:
    """Samples of 3 and 5 tokens: forward 2*6208*8 + 4*2*16*(9+25) = 103,680; a pass is
    three forwards; a second pass adds three more and one for the old logprobs; a KL
    reference one more."""
    shape = ModelShape(6208, 2, 16)
    seq = torch.tensor([3, 5])
    assert shape.forward_flops(seq) == 103_680
    assert step_flops(shape, seq) == 3 * 103_680
    assert step_flops(shape, seq, passes=2, reference=True) == 8 * 103_680


def test_mfu_needs_a_known_peak() -> None:
    cpu = torch.device("cpu")
    assert device_peak_flops(cpu, "float32", None) is None
    assert mfu_metrics(1e12, 1.0, 2.0, None) == {}
    peak = device_peak_flops(cpu, "float32", 2.0)  # configured: 2 TFLOP/s
    assert peak == 2e12
    assert mfu_metrics(1e12, 1.0, 2.0, peak) == pytest.approx(
        {"perf/mfu_fwd_bwd": 0.5, "perf/mfu_wall_clock": 0.25})


def _batch(rows: list[tuple[int, int, int]]) -> Batch:
    """Rows of (tokens, prompt tokens, group); only the shape fields matter."""
    width = max(n for n, _, _ in rows)
    attn = torch.tensor([[1] * n + [0] * (width - n) for n, _, _ in rows])
    t = max(n - p for n, p, _ in rows)
    zeros = torch.zeros(len(rows), t)
    return Batch(input_ids=torch.zeros_like(attn), attention_mask=attn,
                 completion_start=torch.tensor([p for _, p, _ in rows]),
                 completion_ids=zeros.long(), behaviour_logps=zeros, mask=zeros + 1,
                 advantages=torch.ones(len(rows)), versions=zeros.long(),
                 group=torch.tensor([g for _, _, g in rows]))


@pytest.mark.parametrize(("kind", "rows", "forwarded", "real"), [
    ("padded", 3, 18, 15),   # three rows of 6 columns; 5 + 6 + 4 tokens
    ("packed", 3, 18, 15),   # units 6, 5, 4 in rows of 6: none fit together
    ("shared", 2, 16, 12),   # group 0 as one unit 3 + 2 + 3 = 8, group 1's 4 beside
    ("trie", 1, 6, 6),       # all-zero ids: 4, 5, 6 tokens nest, one chain of 6
])
def test_layout_stats_are_the_hand_count(kind: str, rows: int, forwarded: int,
                                         real: int) -> None:
    b = _batch([(5, 3, 0), (6, 3, 0), (4, 2, 1)])
    s = layout_stats([b], kind)  # type: ignore[arg-type]
    assert s["batch/rows"] == rows and s["batch/forwarded_tokens_per_step"] == forwarded
    assert s["batch/row_tokens_mean"] == pytest.approx(real / rows)
    assert s["batch/samples_per_row"] == pytest.approx(3 / rows)
    assert s["batch/row_fill_frac"] == pytest.approx(real / forwarded)
    assert s["sample/forwarded_tokens_mean"] == pytest.approx(real / 3)
