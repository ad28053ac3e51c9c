"""`trainer.fp32_lm_head`: under bf16 autocast the LM head runs in float32, so the
trainer's logprobs, which the importance ratio compares with the sampler's, are not
rounded to bf16 (the rounding grows with the logits' size: ~0.06 at |logit| = 30)."""

from __future__ import annotations

import torch

from benchmarks.gpu_check.common import one_batch, tiny_config, tiny_model
from pipeline.rl.logprobs import head_logprobs
from trainer.logprobs import CompletionLogprobs
from trainer.packing import make_layout


def _logps(fwd: CompletionLogprobs, autocast: bool) -> torch.Tensor:
    batch = one_batch(tiny_config().vocab_size)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        lp = fwd(make_layout(batch, "padded", 0), batch)[0]
    return lp[batch.mask > 0]


def test_the_fp32_head_removes_the_bf16_rounding_of_logprobs() -> None:
    """The same bf16 hidden states (what the body gives under autocast) through the head
    of each kind, against the head computed in float64: the float32 head is exact to
    float32, the bf16 head is off by its rounding."""
    model = tiny_model(torch.device("cpu"))
    head = model.lm_head
    with torch.no_grad():
        head.weight.mul_(40.0)  # large logits, as a trained model has: rounding shows
    torch.manual_seed(1)
    h = torch.randn(64, tiny_config().hidden_size).to(torch.bfloat16)
    ids = torch.randint(0, tiny_config().vocab_size, (64,))
    exact = torch.log_softmax(h.double() @ head.weight.double().T, -1)[torch.arange(64), ids]
    errors = {}
    for fp32_head in (True, False):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            lp, _ = head_logprobs(head, h, ids, None, 1.0, fp32_head, False)
        errors[fp32_head] = float((lp.double() - exact).abs().max())
    assert errors[True] < 1e-4 < 0.01 < errors[False], errors


def test_without_autocast_both_heads_agree_exactly() -> None:
    model = tiny_model(torch.device("cpu"))
    a = _logps(CompletionLogprobs(model, 1.0, fp32_head=True), autocast=False)
    b = _logps(CompletionLogprobs(model, 1.0, fp32_head=False), autocast=False)
    assert torch.equal(a, b)
