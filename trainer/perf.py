"""Model FLOPs of a training step and model FLOPs utilisation (MFU), as TRL's
``perf/mfu_*`` report it.

FLOPs are *model* FLOPs: what the step's samples need, whatever the layout does (prefix
sharing computes a group's prompt once, so it can lift MFU above the hardware's real
utilisation; padding and recomputation are not counted). Per sample of n tokens (prompt
+ completion), one forward costs

    2 * N * n  +  4 * L * d_attn * n**2

where N counts the weights of every matrix multiply (``nn.Linear`` modules, the LM head
included even when tied to the embeddings, the embedding lookup excluded), L is the
number of layers and d_attn = heads * head_dim (QKᵀ and the attention-weighted values,
2 * n**2 * d_attn each, causal masking not discounted: PaLM's convention, appendix B). A
backward costs two forwards. A step of ``passes`` optimizer passes over the forwarded
rows costs 3 forwards per pass, plus one forward for the old logprobs when passes > 1
and one of the reference model when beta > 0.

MFU = FLOPs / (seconds * peak), reported in two time bases: ``fwd_bwd`` (the optimize
call: forwards, backwards, optimizer step) and ``wall_clock`` (the whole step, the wait
for rollouts included). Peak: ``trainer.peak_tflops`` when set, else the table below for
the CUDA device at the training precision (dense, no sparsity), else none (the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipeline.rl.logprobs import split_lm

# Dense peak TFLOP/s by training precision, from the vendors' data sheets (SXM parts).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bfloat16": 989.4, "float16": 989.4, "float32": 66.9},
    "H100": {"bfloat16": 989.4, "float16": 989.4, "float32": 66.9},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5},
    "L40S": {"bfloat16": 362.05, "float16": 362.05, "float32": 91.6},
    "L4": {"bfloat16": 121.0, "float16": 121.0, "float32": 30.3},
}
"""Keys match the device name CUDA reports (``torch.cuda.get_device_name``); the first
key contained in it wins, so "H200" precedes "H100" (no name holds both)."""


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs of a forward depend on."""

    matmul_params: int  # N: weights of every nn.Linear, the LM head included
    layers: int  # L
    attention_width: int  # d_attn = heads * head_dim

    @classmethod
    def of(cls, model: nn.Module) -> ModelShape:
        """Counted from the modules the forward runs, the decoder body and the LM head
        (`pipeline.rl.logprobs.split_lm`: a vision-language model's tower never runs on
        text; a LoRA model's adapters and base weights both count: the forward runs
        both), and the HF config's layer and head sizes."""
        seen: set[int] = set()
        params = 0
        body, head = split_lm(model)
        for module in (*body.modules(), head):
            # a tied LM head shares the embedding's weight: counted once, as the head
            if isinstance(module, nn.Linear) and id(module.weight) not in seen:
                seen.add(id(module.weight))
                params += module.weight.numel()
        config = getattr(model, "config", None)
        text = getattr(config, "get_text_config", lambda: config)()
        layers = int(getattr(text, "num_hidden_layers", 0) or 0)
        heads = int(getattr(text, "num_attention_heads", 0) or 0)
        head_dim = getattr(text, "head_dim", None) or (
            int(getattr(text, "hidden_size", 0) or 0) // max(heads, 1))
        return cls(params, layers, heads * int(head_dim))

    def forward_flops(self, seq_lens: torch.Tensor) -> float:
        """FLOPs of one forward over samples of ``seq_lens`` tokens (module docstring)."""
        n = seq_lens.double()
        return float(2 * self.matmul_params * n.sum()
                     + 4 * self.layers * self.attention_width * (n * n).sum())


def step_flops(shape: ModelShape, seq_lens: torch.Tensor, passes: int = 1,
               reference: bool = False) -> float:
    """Model FLOPs of a step over the forwarded samples (module docstring)."""
    forwards = 3 * passes + (1 if passes > 1 else 0) + (1 if reference else 0)
    return forwards * shape.forward_flops(seq_lens)


def device_peak_flops(device: torch.device, dtype: str, configured_tflops: float | None
                      ) -> float | None:
    """Peak FLOP/s at ``dtype``: the configured figure, the table's for a known CUDA
    device, or None (unknown: no MFU is reported rather than a guess)."""
    if configured_tflops is not None:
        return configured_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks.get(dtype, 0.0) * 1e12 or None
    return None


def mfu_metrics(flops: float, fwd_bwd_s: float, wall_s: float, peak: float | None
                ) -> dict[str, float]:
    """``perf/mfu_fwd_bwd`` and ``perf/mfu_wall_clock`` (fractions of the peak); empty
    without a peak."""
    if peak is None:
        return {}
    return {"perf/mfu_fwd_bwd": flops / (max(fwd_bwd_s, 1e-9) * peak),
            "perf/mfu_wall_clock": flops / (max(wall_s, 1e-9) * peak)}
