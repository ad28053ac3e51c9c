"""`trainer.fp32_lm_head`: under bf16 autocast the LM head runs in float32, so the
trainer's logprobs, which the importance ratio compares with the sampler's, are not
rounded to bf16 (the rounding grows with the logits' size: ~0.06 at |logit| = 30)."""

from __future__ import annotations

import pytest
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


def test_the_fp32_head_runs_in_tf32_on_cuda_only_amid_a_low_precision_model(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What `trainer.setup` sets on a CUDA device: TF32 for float32 matmuls (the float32
    head is the only one under bf16 autocast), through the API whose value both of
    torch 2.13's readers can read back; nothing on the CPU, for a float32 model, or
    without the float32 head."""
    from trainer import setup

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert setup.head_matmul_precision(cuda, torch.bfloat16, True) == "high"
    assert setup.head_matmul_precision(cuda, torch.float16, True) == "high"
    assert setup.head_matmul_precision(cuda, torch.float32, True) is None
    assert setup.head_matmul_precision(cuda, torch.bfloat16, False) is None
    assert setup.head_matmul_precision(cpu, torch.bfloat16, True) is None
    calls: list[str] = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", calls.append)
    setup.set_head_matmul_precision(cpu, torch.bfloat16, True)
    assert calls == []
    setup.set_head_matmul_precision(cuda, torch.bfloat16, True)
    assert calls == ["high"]


def test_the_older_tf32_api_leaves_both_readers_working() -> None:
    """Why `head_matmul_precision` goes through ``set_float32_matmul_precision``: after it
    both torch 2.13 readers agree (the CUDA flag is a process setting, readable on a CPU
    build); after setting only ``backends.cuda.matmul.fp32_precision`` the older reader,
    which inductor uses, raises."""
    import subprocess
    import sys

    def run(code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", f"import torch; {code}"],
                              capture_output=True, text=True, timeout=120)

    ok = run("torch.set_float32_matmul_precision('high'); print("
             "torch.backends.cuda.matmul.fp32_precision, torch.get_float32_matmul_precision())")
    assert ok.returncode == 0 and ok.stdout.split() == ["tf32", "high"], ok.stderr
    mixed = run("torch.backends.cuda.matmul.fp32_precision = 'tf32'; "
                "torch.get_float32_matmul_precision()")
    assert mixed.returncode != 0 and "legacy and new APIs" in mixed.stderr
