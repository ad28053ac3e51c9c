"""The GPU check's stages on one device: the control plane, logprob layouts, the trainer
benchmark judged against floors, and publish -> reload.

Each ``stage_*`` takes the `StageContext` and returns the figures for its report row, or
raises (the row then says why). Each runs in a process of its own (`benchmarks.gpu_check`
runs it under a timeout), so none bounds its own waits.

The trainer benchmark's floors, judged on CUDA only (``--cpu`` runs the tiny smoke test,
whose figures mean nothing). NOT YET CALIBRATED ON A GPU: no GPU has run this check, so
each value is an estimate from the model's shape and the card's datasheet, stated with
its reasoning; the first GPU run's report is what they should be re-set from.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import io
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.gpu_check.common import (
    BF16_TOL,
    FLASH_KERNEL,
    FP32_TOL,
    StageContext,
    one_batch,
    one_rank_group,
    tiny_config,
    tiny_model,
)
from pipeline.weights import FileTransport, read_full
from trainer.batch import Batch
from trainer.distributed import compute_thread
from trainer.logprobs import CompletionLogprobs
from trainer.packing import LayoutKind, make_layout

MFU_FLOOR = 0.20
"""Padded arm (the trainer's default layout), MFU = 6 x 494M params x tokens/s over the
card's dense bf16 peak (`PEAK_TFLOPS`). Why 0.20: a 0.5B model with a 152k-token
vocabulary, checkpoint recompute uncounted, pads uncounted: well below what large models
reach (~0.4), and a step at under a fifth of the card's peak means something is off (a
float32 body, a host sync per micro-batch, no fused attention)."""

TOKENS_PER_S_FLOOR = 50_000.0
"""Padded arm, real tokens (prompt + completion) per second: `MFU_FLOOR` in tokens on the
slowest card the floors are meant for, an H100 PCIe (756 TFLOP/s dense bf16):
0.20 x 756e12 / (6 x 494e6) = 51k, rounded down."""

PEAK_MEMORY_GIB_CEILING = 24.0
"""Any arm's ``max_memory_allocated``. Estimate ~11 GiB: 494M params x 16 bytes (float32
weights, gradients, AdamW's two moments) = 7.4 GiB, plus the bf16 activations of a
16k-token micro-batch under checkpointing and 256-token float32 logit chunks. Twice that
still catches a step that keeps full logits (16k x 152k x 4 bytes = 9.3 GiB a copy) or
runs without checkpointing (~18 GiB of activations)."""

PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0}
"""Dense bf16 peaks (datasheets) by a name fragment; other cards: 989 (H100 SXM, H200)."""


def peak_tflops(device_name: str) -> float:
    return next((v for k, v in PEAK_TFLOPS.items() if k in device_name), 989.0)


# ------------------------------------------------------------------ control plane


def stage_control_plane(ctx: StageContext) -> dict[str, Any]:
    """A one-rank group on `backend_for` the device: an all-reduce of a CPU tensor (the
    control plane's kind, on gloo) and, on CUDA, of a CUDA tensor (NCCL), in the compute
    thread bound to the device."""
    device = ctx.device
    pool = compute_thread(device)
    try:
        with one_rank_group(device) as backend:
            def collectives() -> dict[str, Any]:
                cpu = torch.tensor([1.0, 2.0], dtype=torch.float64)
                dist.all_reduce(cpu)
                out: dict[str, Any] = {"backend": backend, "cpu_all_reduce": cpu.tolist()}
                if device.type == "cuda":
                    gpu = torch.ones(4, device=device)
                    dist.all_reduce(gpu)
                    out["cuda_all_reduce"] = gpu.tolist()
                    out["current_device"] = torch.cuda.current_device()
                    out["device_name"] = torch.cuda.get_device_name(device)
                return out

            return pool.submit(collectives).result()
    finally:
        pool.shutdown(wait=True)


# ------------------------------------------------------------------ layouts


def layout_logps(model: torch.nn.Module, batch: Batch, kind: LayoutKind) -> torch.Tensor:
    fwd = CompletionLogprobs(model, temperature=1.0)
    with torch.no_grad():
        logps = fwd(make_layout(batch, kind, pad_id=0), batch)[0]
    return logps.float().cpu()


def max_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask > 0
    return float((a[m] - b[m]).abs().max())


def flash_attention(device: torch.device) -> tuple[str, str]:
    """(the varlen flash implementation that loads offline here, '') or ('', why not)."""
    if device.type != "cuda":
        return "", "needs CUDA"
    if importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2", ""
    if importlib.util.find_spec("kernels") is None:
        return "", "neither flash_attn nor the kernels library is installed"
    try:
        probe = tiny_model(device, torch.bfloat16)
        probe.set_attn_implementation(FLASH_KERNEL)
    except Exception as e:  # any failure to load means "skip", with the reason
        return "", f"{FLASH_KERNEL} did not load offline ({type(e).__name__}: {e})"
    return FLASH_KERNEL, ""


def stage_layouts(ctx: StageContext) -> dict[str, Any]:
    """Completion logprobs of one batch in the padded, packed, prefix-shared and trie
    layouts, SDPA and eager, float32 and bfloat16 (and packed through the varlen flash
    kernel when it loads offline), against the padded float32 SDPA forward."""
    device = ctx.device
    batch = one_batch(tiny_config().vocab_size)
    out: dict[str, Any] = {"fp32_tol": FP32_TOL, "bf16_tol": BF16_TOL}
    base = layout_logps(tiny_model(device), batch, "padded")
    bad = []
    for dtype, tol in ((torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)):
        for attn in ("sdpa", "eager"):
            model = tiny_model(device, dtype, attn)
            for kind in ("padded", "packed", "shared", "trie"):
                d = max_diff(layout_logps(model, batch, kind), base, batch.mask)
                name = f"{str(dtype).removeprefix('torch.')}/{attn}/{kind}"
                out[name] = d
                if not d <= tol:
                    bad.append(f"{name}: {d:.3g} > {tol:g}")
    flash, why = flash_attention(device)
    if flash:
        model = tiny_model(device, torch.bfloat16, flash)
        for kind in ("padded", "packed"):
            d = max_diff(layout_logps(model, batch, kind), base, batch.mask)
            out[f"bfloat16/{flash}/{kind}"] = d
            if not d <= BF16_TOL:
                bad.append(f"{flash}/{kind}: {d:.3g} > {BF16_TOL:g}")
    else:
        out["flash"] = f"skipped: {why}"
    if bad:
        raise AssertionError("logprobs differ from the padded fp32 forward: " + "; ".join(bad))
    return out


# ------------------------------------------------------------------ trainer benchmark


def stage_trainer_bench(ctx: StageContext) -> dict[str, Any]:
    """`benchmarks.gpu_trainer` at Qwen2.5-0.5B's shape (``--cpu``: its tiny smoke test):
    it exits 1 on a non-finite loss or gradient or a skipped step; its figures (a JSON
    file) are judged against the floors above on CUDA."""
    from benchmarks import gpu_trainer

    name = torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu"
    with tempfile.TemporaryDirectory(prefix="sluice-gpu-check-bench-") as tmp:
        figures_path = Path(tmp) / "figures.json"
        args = (["--peak-tflops", f"{peak_tflops(name):g}"] if ctx.cuda
                else ["--cpu", "--tiny", "--quick"]) + ["--json-out", str(figures_path)]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = gpu_trainer.main(args)
        text = buf.getvalue()
        if code != 0:
            raise AssertionError(f"gpu_trainer exited {code} (a non-finite or skipped "
                                 f"step fails it):\n{text}")
        figures = json.loads(figures_path.read_text())
    out: dict[str, Any] = {"output": text.splitlines(), "figures": figures}
    if not ctx.cuda:
        out["floors"] = "not judged on the CPU: the floors are for an H100/H200 in bf16"
        return out
    out["floors"], failed = judge_floors(figures)
    if failed:
        raise AssertionError("below the floors (not yet calibrated on a GPU): "
                             + "; ".join(failed))
    return out


def judge_floors(figures: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(each floor with the figure it judged, the failures) for gpu_trainer's figures."""
    padded = figures["arms"]["padded"]
    peak_gib = max(arm["peak_gib"] for arm in figures["arms"].values())
    checks = [("mfu", padded["mfu"], MFU_FLOOR, ">="),
              ("tokens_per_s", padded["tokens_per_s"], TOKENS_PER_S_FLOOR, ">="),
              ("peak_gib", peak_gib, PEAK_MEMORY_GIB_CEILING, "<=")]
    floors, failed = {}, []
    for name, value, bound, op in checks:
        ok = value >= bound if op == ">=" else value <= bound
        floors[name] = {"value": value, "bound": f"{op} {bound:g}", "ok": ok}
        if not ok:
            failed.append(f"{name} {value:.4g} (want {op} {bound:g})")
    return floors, failed


# ------------------------------------------------------------------ publish -> reload


def stage_publish_reload(ctx: StageContext) -> dict[str, Any]:
    """The trainer's float32 weights of a tied model published in the serving dtype
    (`FileTransport`, bfloat16 on CUDA), verified, loaded into a fresh model: logits
    identical to the trainer's model cast to that dtype, ``lm_head.weight`` published
    as its own tensor."""
    device = ctx.device
    serving = torch.bfloat16 if ctx.cuda else torch.float32
    trainer_model = tiny_model(device, tied=True)  # float32 masters
    with tempfile.TemporaryDirectory(prefix="sluice-gpu-check-publish-") as tmp:
        transport = FileTransport(Path(tmp), dtype=serving)
        t0 = time.perf_counter()
        msg = transport.write(trainer_model, version=1, step=1)
        publish_s = time.perf_counter() - t0
        state = read_full(asyncio.run(transport.receive(msg)))
    if "lm_head.weight" not in state:
        raise AssertionError("the tied lm_head.weight was not published as its own tensor")
    engine = tiny_model(device, serving, tied=True)
    engine.load_state_dict(state)
    ids = torch.randint(4, tiny_config().vocab_size, (2, 32), device=device)
    with torch.no_grad():
        want = trainer_model.to(serving)(ids).logits
        got = engine(ids).logits
    if not torch.equal(want, got):
        raise AssertionError(f"reloaded logits differ: max {float((want - got).abs().max())}")
    return {"dtype": str(serving), "publish_s": round(publish_s, 4), "bytes": msg.nbytes}
