"""The one-shot GPU check: what a first GPU run of sluice's trainer would hit, in minutes.

    .venv/bin/python -m benchmarks.gpu_check [--out gpu_check.json]   # on one CUDA GPU
    .venv/bin/python -m benchmarks.gpu_check --cpu                    # the CPU run CI makes

Stages, in order; each is recorded (ok, seconds, figures, error) in one JSON report,
rewritten after every stage, and the command exits 1 if any failed (2: no CUDA device
without ``--cpu``). Work on the compute thread has a timeout (`on_compute_thread`): a stage
whose collective never returns fails ``StageHung``, no later stage runs, and the check
exits without joining the stuck thread (a hung NCCL call cannot be cancelled).

1. ``control_plane``: a one-rank process group on `trainer.distributed.backend_for` the
   device (``cpu:gloo,cuda:nccl`` on CUDA), one all-reduce of a CPU tensor (the control
   plane's kind, on gloo) and, on CUDA, one of a CUDA tensor (on NCCL), in the compute
   thread bound to the device.
2. ``layouts``: completion logprobs of one batch in the padded, packed, prefix-shared and
   trie layouts (`trainer.packing`) with SDPA and eager attention, equal to the padded SDPA
   forward: float32 to 1e-4, bfloat16 to ``BF16_TOL``; with a varlen flash kernel when
   one loads offline (``kernels-community/flash-attn2`` or ``flash_attention_2``), the
   packed layout through it, in bfloat16, to ``BF16_TOL`` (otherwise: why skipped).
3. ``trainer_bench``: `benchmarks.gpu_trainer` (tokens/s, MFU, peak memory, publish
   time) at Qwen2.5-0.5B's shape (``--cpu``: its tiny smoke test), and a finite loss.
4. ``fsdp``: FSDP2 (`trainer.distributed.shard_model`) on a one-rank job of that backend:
   two optimizer steps with finite loss, a checkpoint saved through the job's path
   (`trainer.checkpoint`, gathering the shards), loaded into a fresh sharded model and
   optimizer: parameters equal, and a third step from each gives equal parameters.
5. ``publish_reload``: the trainer's float32 weights published in the serving dtype
   (`pipeline.weights.FileTransport`, bfloat16 on CUDA), verified, loaded into a fresh
   model: logits identical to the trainer's model cast to that dtype.

It installs nothing and reads no network: what it needs is the trainer's environment
(``deploy/setup.sh``; ``--gpu`` for the flash kernel, fetched into the local cache then).
Budget: under 8 minutes on one H200 (the trainer benchmark takes most of it).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path
from typing import Any

# huggingface_hub reads HF_HUB_OFFLINE once, when it is first imported (transformers
# imports it below): set here, before that, so "the cache only, never the network" holds.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from benchmarks.synthetic import scored_groups
from pipeline.attention import FLASH_ATTN2
from pipeline.ports import free_port
from pipeline.rl.losses import LossConfig
from pipeline.weights import FileTransport, read_full
from trainer.batch import Batch, build_batch
from trainer.checkpoint import Checkpointer, TrainerState
from trainer.distributed import Ranks, backend_for, compute_thread, shard_model
from trainer.logprobs import CompletionLogprobs
from trainer.packing import LayoutKind, make_layout
from trainer.step import StepSettings, optimize

BF16_TOL = 0.05  # nats: bf16 logprobs of other kernels / layouts (seen: 0.004 on the CPU)
FP32_TOL = 1e-4
FLASH_KERNEL = FLASH_ATTN2  # the kernel deploy/setup.sh --gpu caches on every NVIDIA GPU


class _OneRankJob(Ranks):
    """A job of one rank that still takes the multi-rank paths (FSDP2's full-state
    gathers, the checkpoint's broadcasts): what a GPU job runs, at world size 1."""

    @property
    def distributed(self) -> bool:
        return True


def tiny_config(vocab: int = 512) -> Qwen2Config:
    return Qwen2Config(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=2048, rope_theta=1e6,
                       tie_word_embeddings=False, attn_implementation="sdpa")


def tiny_model(device: torch.device, dtype: torch.dtype = torch.float32,
               attn: str = "sdpa") -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = tiny_config()
    cfg._attn_implementation = attn
    with device:
        model = Qwen2ForCausalLM(cfg)
    return model.to(dtype).eval()


def one_batch(vocab: int, seed: int = 0) -> Batch:
    groups = scored_groups(3, 4, vocab_size=vocab, prompt_tokens=(5, 24),
                           completion_tokens=(3, 40), seed=seed)
    return build_batch(groups, pad_id=0)


@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[str]:
    """A one-rank default process group on `backend_for` ``device`` (a TCP store on a free
    loopback port); destroyed on exit."""
    backend = backend_for(device)
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        yield backend
    finally:
        dist.destroy_process_group()


class StageHung(TimeoutError):
    """A stage's work did not return in time (an NCCL collective that never completes):
    its thread cannot be stopped, so the check reports it and exits without joining it."""


def on_compute_thread(pool: ThreadPoolExecutor, fn: Callable[[], Any], timeout_s: float) -> Any:
    """``fn()`` on the rank's compute thread, `StageHung` after ``timeout_s``."""
    try:
        return pool.submit(fn).result(timeout_s)
    except FuturesTimeout:
        raise StageHung(f"no result in {timeout_s:g} s: the thread is stuck (a hung "
                        "collective?) and is left behind") from None


def release(pool: ThreadPoolExecutor) -> None:
    """Shut the pool down without waiting: a stuck thread must not hang the check."""
    pool.shutdown(wait=False, cancel_futures=True)


def write_report(report: dict[str, Any], out: Path) -> None:
    """The report as it stands, replaced atomically: after every stage, so a check that
    dies or is killed later still leaves what it found."""
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, out)


# ------------------------------------------------------------------ stages


def stage_control_plane(device: torch.device) -> dict[str, Any]:
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
                return out

            return on_compute_thread(pool, collectives, 120)
    finally:
        release(pool)


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
    import importlib.util

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


def stage_layouts(device: torch.device) -> dict[str, Any]:
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


def stage_trainer_bench(device: torch.device) -> dict[str, Any]:
    from benchmarks import gpu_trainer

    args = ["--cpu", "--tiny", "--quick"] if device.type == "cpu" else []
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = gpu_trainer.main(args)
    text = buf.getvalue()
    if code != 0:
        raise AssertionError(f"gpu_trainer exited {code}:\n{text}")
    return {"output": text.splitlines()}


def _settings(device: torch.device) -> StepSettings:
    return StepSettings(loss=LossConfig(loss_type="dapo"), temperature=1.0,
                        compute_dtype=torch.bfloat16 if device.type == "cuda" else None)


def stage_fsdp(device: torch.device) -> dict[str, Any]:
    pool = compute_thread(device)
    try:
        with one_rank_group(device), tempfile.TemporaryDirectory() as tmp:
            return on_compute_thread(pool, lambda: _fsdp_round_trip(device, Path(tmp)), 900)
    finally:
        release(pool)


def _sharded(device: torch.device) -> tuple[CompletionLogprobs, torch.optim.Optimizer]:
    fwd = CompletionLogprobs(tiny_model(device).train(), temperature=1.0)
    shard_model(fwd, device, torch.bfloat16 if device.type == "cuda" else None)
    return fwd, torch.optim.AdamW(fwd.parameters(), lr=1e-3)


def _fsdp_round_trip(device: torch.device, tmp: Path) -> dict[str, Any]:
    ranks, st = _OneRankJob(rank=0, world=1), _settings(device)
    vocab = tiny_config().vocab_size
    fwd, opt = _sharded(device)
    losses = [optimize(fwd, opt, one_batch(vocab, seed=s), st, None)["loss"] for s in (1, 2)]
    if not all(math.isfinite(x) for x in losses):
        raise AssertionError(f"non-finite loss in FSDP2 steps: {losses}")
    ckpt = Checkpointer(tmp, keep=1)
    ckpt.save(fwd, opt, TrainerState(step=2, version=2), None, ranks)
    fwd2, opt2 = _sharded(device)
    state = ckpt.load_latest(fwd2, opt2, None, ranks)
    if state is None or state.step != 2:
        raise AssertionError(f"checkpoint not resumed: {state}")
    same = _params_equal(fwd, fwd2)
    third = one_batch(vocab, seed=3)
    optimize(fwd, opt, third, st, None)
    optimize(fwd2, opt2, third, st, None)
    after = _params_equal(fwd, fwd2)
    if not (same and after):
        raise AssertionError(f"resumed parameters differ (after load: {same}, after a "
                             f"step from each: {after})")
    return {"losses": losses, "resumed_step": state.step}


def _params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    def full(m: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
                for k, v in m.state_dict().items()}

    fa, fb = full(a), full(b)
    return fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)


def stage_publish_reload(device: torch.device) -> dict[str, Any]:
    serving = torch.bfloat16 if device.type == "cuda" else torch.float32
    trainer_model = tiny_model(device)  # float32 masters
    with tempfile.TemporaryDirectory() as tmp:
        transport = FileTransport(Path(tmp), dtype=serving)
        t0 = time.perf_counter()
        msg = transport.write(trainer_model, version=1, step=1)
        publish_s = time.perf_counter() - t0
        import asyncio

        state = read_full(asyncio.run(transport.receive(msg)))
    engine = tiny_model(device, serving)
    engine.load_state_dict(state)
    ids = torch.randint(4, tiny_config().vocab_size, (2, 32), device=device)
    with torch.no_grad():
        want = trainer_model.to(serving)(ids).logits
        got = engine(ids).logits
    if not torch.equal(want, got):
        raise AssertionError(f"reloaded logits differ: max {float((want - got).abs().max())}")
    return {"dtype": str(serving), "publish_s": round(publish_s, 4), "bytes": msg.nbytes}


STAGES: list[tuple[str, Callable[[torch.device], dict[str, Any]]]] = [
    ("control_plane", stage_control_plane), ("layouts", stage_layouts),
    ("trainer_bench", stage_trainer_bench), ("fsdp", stage_fsdp),
    ("publish_reload", stage_publish_reload)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU (what CI runs)")
    p.add_argument("--out", default="gpu_check.json", help="the JSON report")
    p.add_argument("--only", nargs="*", default=None, help="run only these stages")
    a = p.parse_args(argv)
    if not a.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; `--cpu` runs the CPU version", file=sys.stderr)
        return 2
    device = torch.device("cpu" if a.cpu else "cuda", None if a.cpu else 0)
    if a.cpu:
        torch.set_num_threads(2)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if not a.cpu else "cpu",
                              "torch": torch.__version__, "stages": {}}
    for name, fn in STAGES:
        if a.only and name not in a.only:
            continue
        t0 = time.perf_counter()
        try:
            row = {"ok": True, **fn(device)}
        except Exception as e:
            row = {"ok": False, "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc().splitlines()[-12:]}
        row["seconds"] = round(time.perf_counter() - t0, 2)
        report["stages"][name] = row
        write_report(report, Path(a.out))
        print(f"[gpu_check] {name}: {'ok' if row['ok'] else 'FAILED ' + row['error']} "
              f"({row['seconds']} s)", flush=True)
        if "StageHung" in row.get("error", ""):
            break  # the device may be wedged: the later stages would hang too
    ok = all(r["ok"] for r in report["stages"].values())
    print(f"[gpu_check] {'all stages passed' if ok else 'FAILED'}; report in {a.out}",
          flush=True)
    if any("StageHung" in r.get("error", "") for r in report["stages"].values()):
        sys.stderr.flush()
        os._exit(1)  # interpreter exit would join the stuck thread and hang
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
