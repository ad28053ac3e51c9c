"""The trainer step on one GPU at Qwen2.5-0.5B's shape: tokens/s, MFU, peak memory, publish.

    .venv/bin/python -m benchmarks.gpu_trainer [--groups 8] [--generations 8] [--steps 3]
        [--micro-batch-tokens 16384] [--peak-tflops 989] [--pure-bf16] [--json-out FILE]
    .venv/bin/python -m benchmarks.gpu_trainer --cpu --tiny [--quick]   # CPU smoke test

NOT YET RUN ON A GPU: written and smoke-tested on CPU (``--cpu --tiny``) only.

Model: a random-init ``Qwen2ForCausalLM`` with Qwen2.5-0.5B's config written out by hand
(no download): hidden 896, 24 layers, 14 heads, 2 KV heads, MLP 4864, vocab 151,936, tied
embeddings, rope theta 1e6; SDPA attention; gradient checkpointing on. Precision as the
trainer's default (`trainer.setup`, ``fp32_master``): float32 parameters and AdamW state,
bf16 autocast (``StepSettings.compute_dtype``); ``--pure-bf16``: bf16 parameters, no
autocast. Batches: ``--groups`` x ``--generations`` synthetic samples
(`benchmarks.synthetic`), prompts of 128 tokens, completions drawn from 64-1024 tokens.

Arms, each `trainer.step.optimize` with ``micro_batch_tokens`` and one layout:
``padded`` (packing off), ``packed`` (packing on, no prefix sharing), ``shared``
(packing + ``trainer.prefix_sharing``, a tree mask over each group),
``padded/bf16-head`` (padded with the LM head under bf16 autocast instead of float32,
`trainer.fp32_lm_head` off: the float32 head's cost is padded / this) and,
only when the ``kernels`` package can load ``kernels-community/flash-attn2`` from the
local cache (offline), ``packed+fa`` (packed rows as varlen flash attention); otherwise
it says why it is skipped. One model and optimizer serve all arms in turn (weights drift;
timing does not depend on them): per arm a warm-up step, then ``--steps`` timed steps on
the same batches, CUDA synchronised around each.

Reported per arm: tokens/s (real tokens, prompt + completion of every sample / seconds);
MFU = 6 x params x tokens/s / ``--peak-tflops`` (H200 dense bf16: 989), with params = all
parameters (tied embedding counted once); ``MFU_lean`` counts what the lean step really
multiplies: 6 x (non-embedding params x real tokens + LM head params x trained tokens);
neither counts attention or checkpoint recompute; peak memory = ``max_memory_allocated``
over the timed steps (weights, gradients and AdamW state included); then the ratios
packed/padded and shared/padded, and the time to publish the full state dict through the
``file`` transport in the serving dtype, bf16 (`FileTransport.write`: GPU->CPU copy,
safetensors, sha256, files) into a temp dir. On CPU, peak memory is not measured and MFU
means nothing. ``--json-out FILE`` writes the same figures as JSON (per arm
``tokens_per_s``, ``mfu``, ``mfu_lean``, ``peak_gib``, ``step_s``, ``bad_steps``): what
`benchmarks.gpu_check` judges against its floors. Exit 1 when any step had a non-finite
loss or gradient or was skipped for it (the figures of such a run measure nothing).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# huggingface_hub reads HF_HUB_OFFLINE once, when it is first imported (transformers
# imports it below): set here, before that, so "the cache only, never the network" holds.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from benchmarks.synthetic import scored_groups
from pipeline.attention import FLASH_ATTN2
from pipeline.rl.losses import LossConfig
from pipeline.runtime import set_threads
from pipeline.weights import FileTransport
from trainer.batch import Batch, build_batch
from trainer.packing import LayoutKind
from trainer.step import StepSettings, optimize

FLASH = FLASH_ATTN2  # the kernel deploy/setup.sh --gpu caches on every NVIDIA GPU
Arm = tuple[str, LayoutKind, str]  # (name, layout, attention)


def qwen25_05b(vocab: int = 151936) -> Qwen2Config:
    return Qwen2Config(vocab_size=vocab, hidden_size=896, intermediate_size=4864,
                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, attn_implementation="sdpa")


def tiny() -> Qwen2Config:
    return Qwen2Config(vocab_size=1024, hidden_size=64, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=4096, rope_theta=1e6,
                       tie_word_embeddings=True, attn_implementation="sdpa")


def build_model(cfg: Qwen2Config, device: torch.device, pure_bf16: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    with device:
        model = Qwen2ForCausalLM(cfg)
    model.to(torch.bfloat16 if pure_bf16 else torch.float32)
    model.train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def flash_status(model: torch.nn.Module, device: torch.device) -> str:
    """'' when ``FLASH`` can be set on the model (offline); else why it is skipped."""
    if device.type != "cuda":
        return "flash-attn skipped: needs CUDA"
    if importlib.util.find_spec("kernels") is None:
        return "flash-attn skipped: the `kernels` package is not installed"
    try:
        model.set_attn_implementation(FLASH)  # type: ignore[operator]
    except Exception as e:  # any failure to load means "skip"
        return f"flash-attn skipped: {FLASH} did not load offline ({type(e).__name__}: {e})"
    finally:
        model.set_attn_implementation("sdpa")  # type: ignore[operator]
    return ""


def make_batches(a: argparse.Namespace, vocab: int) -> list[Batch]:
    return [build_batch(scored_groups(a.groups, a.generations, vocab_size=vocab,
                                      prompt_tokens=(a.prompt, a.prompt),
                                      completion_tokens=a.completion_tokens, seed=s),
                        pad_id=0) for s in range(a.steps + 1)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_arm(model: torch.nn.Module, opt: torch.optim.Optimizer, arm: Arm,
            batches: list[Batch], st: StepSettings, device: torch.device) -> dict[str, float]:
    name, layout, attn = arm
    model.set_attn_implementation(attn)  # type: ignore[operator]
    st = StepSettings(**{**vars(st), "layout": layout,
                         "fp32_head": not name.endswith("bf16-head")})
    steps = [optimize(model, opt, batches[0], st)]  # warm-up (allocates AdamW state)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = 0.0
    for b in batches[1:]:
        t0 = time.perf_counter()
        steps.append(optimize(model, opt, b, st))
        sync(device)
        seconds += time.perf_counter() - t0
    timed = batches[1:]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
    return {"tokens": float(sum(int(b.seq_lens.sum()) for b in timed)),
            "trained": float(sum(b.num_tokens for b in timed)), "seconds": seconds,
            "peak_gb": peak, "bad_steps": float(bad_steps(steps))}


def bad_steps(steps: list[dict[str, float]]) -> int:
    """Steps whose loss or gradient norm was not finite, or that the trainer skipped for
    it: a benchmark that times such steps measures nothing, so the run fails."""
    return sum(not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]))
               or m.get("skipped", 0.0) > 0 for m in steps)


def publish_seconds(model: torch.nn.Module) -> tuple[float, int]:
    """Publishing the float32 master weights in the serving dtype (bf16), as a run with
    ``model.dtype = "bfloat16"`` does."""
    with tempfile.TemporaryDirectory(prefix="sluice-bench-publish-") as d:
        transport = FileTransport(Path(d), dtype=torch.bfloat16)
        t0 = time.perf_counter()
        msg = transport.write(model, version=1, step=1)
        return time.perf_counter() - t0, msg.nbytes


def figures(a: argparse.Namespace, model: torch.nn.Module, rows: dict[str, dict[str, float]],
            device: torch.device) -> dict[str, Any]:
    """Per arm: tokens/s, MFU, MFU_lean, peak GiB (0 on the CPU: not measured), seconds
    per step and the count of bad steps; what `--json-out` writes and `report` prints."""
    n_all = model.num_parameters()
    n_head = model.get_output_embeddings().weight.numel()  # type: ignore[operator]
    n_body = n_all - n_head  # tied: the embedding is the head, counted once
    peak_flops = a.peak_tflops * 1e12
    arms = {}
    for name, r in rows.items():
        tps = r["tokens"] / r["seconds"]
        lean = 6 * (n_body * r["tokens"] + n_head * r["trained"]) / r["seconds"]
        arms[name] = {"tokens_per_s": tps, "mfu": 6 * n_all * tps / peak_flops,
                      "mfu_lean": lean / peak_flops, "peak_gib": r["peak_gb"],
                      "step_s": r["seconds"] / a.steps, "bad_steps": int(r["bad_steps"])}
    return {"device": str(device), "params": n_all, "peak_tflops": a.peak_tflops,
            "steps": a.steps, "micro_batch_tokens": a.micro_batch_tokens, "arms": arms}


def report(figs: dict[str, Any], device: torch.device) -> None:
    print(f"{'arm':<11}{'tokens/s':>11}{'MFU':>8}{'MFU_lean':>10}{'peak_GB':>9}{'step_s':>8}")
    arms = figs["arms"]
    for name, f in arms.items():
        peak = f"{f['peak_gib']:.1f}" if device.type == "cuda" else "-"
        print(f"{name:<11}{f['tokens_per_s']:>11.0f}{f['mfu']:>8.1%}{f['mfu_lean']:>10.1%}"
              f"{peak:>9}{f['step_s']:>8.2f}")
    pad = arms["padded"]["tokens_per_s"]
    for name, f in arms.items():
        if name != "padded":
            print(f"{name}/padded tokens/s = {f['tokens_per_s'] / pad:.2f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--completion-tokens", type=lambda s: tuple(map(int, s.split("-"))),
                   default=(64, 1024), help="inclusive range, e.g. 64-1024")
    p.add_argument("--steps", type=int, default=3, help="timed steps per arm")
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="dense bf16 peak of the GPU (H200/H100 SXM: 989)")
    p.add_argument("--pure-bf16", action="store_true", help="bf16 parameters, no autocast")
    p.add_argument("--cpu", action="store_true", help="run on CPU (smoke test)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, hidden-64 model")
    p.add_argument("--quick", action="store_true", help="1 group of 4 short samples, 1 step")
    p.add_argument("--json-out", default="", help="also write the figures to this JSON file")
    a = p.parse_args(argv)
    if a.quick:
        a.groups, a.generations, a.steps, a.prompt = 1, 4, 1, 8
        a.completion_tokens, a.micro_batch_tokens = (4, 48), 96
    if not a.cpu and not torch.cuda.is_available():
        print("gpu_trainer: no CUDA device found. This benchmark needs a GPU; "
              "`--cpu --tiny` runs its CPU smoke test.", file=sys.stderr)
        return 2
    device = torch.device("cpu" if a.cpu else "cuda")
    if a.cpu:
        set_threads(2)
    cfg = tiny() if a.tiny else qwen25_05b()
    model = build_model(cfg, device, a.pure_bf16)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-6)
    st = StepSettings(loss=LossConfig(loss_type="dapo"), temperature=1.0,
                      micro_batch_tokens=a.micro_batch_tokens, chunk_tokens=a.chunk_tokens,
                      compute_dtype=None if a.pure_bf16 else torch.bfloat16)
    arms: list[Arm] = [("padded", "padded", "sdpa"), ("packed", "packed", "sdpa"),
                       ("shared", "shared", "sdpa"), ("padded/bf16-head", "padded", "sdpa")]
    skipped = flash_status(model, device)
    if not skipped:
        arms.append(("packed+fa", "packed", FLASH))
    batches = make_batches(a, cfg.vocab_size)
    t0 = time.perf_counter()
    rows = {arm[0]: run_arm(model, opt, arm, batches, st, device) for arm in arms}
    train_s = time.perf_counter() - t0
    pub_s, pub_bytes = publish_seconds(model)
    prec = "bf16 parameters" if a.pure_bf16 else "fp32 master + bf16 autocast"
    print(f"{'tiny' if a.tiny else 'Qwen2.5-0.5B-shaped'} model, {model.num_parameters() / 1e6:.1f}"
          f"M params, {prec}, gradient checkpointing, on {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}); "
          f"{a.steps} timed steps of {a.groups} x {a.generations} samples, prompt {a.prompt}, "
          f"completions {a.completion_tokens[0]}-{a.completion_tokens[1]}; micro_batch_tokens "
          f"{a.micro_batch_tokens}; MFU vs {a.peak_tflops:g} TFLOP/s\n")
    figs = figures(a, model, rows, device)
    figs.update(publish_s=pub_s, publish_gib=pub_bytes / 2**30, train_s=train_s,
                flash=skipped or "ran", ok=not any(f["bad_steps"] for f in figs["arms"].values()))
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(figs, indent=1))
    report(figs, device)
    if skipped:
        print(skipped)
    print(f"publish (file transport, full state dict): {pub_s:.2f} s for "
          f"{pub_bytes / 2**30:.2f} GiB; training arms took {train_s:.1f} s")
    bad = {name: f["bad_steps"] for name, f in figs["arms"].items() if f["bad_steps"]}
    if bad:
        print(f"gpu_trainer: FAILED: steps with a non-finite loss or gradient: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
