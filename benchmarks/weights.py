"""Full versions vs deltas: bytes per version, publish and apply time, on the CPU.

    .venv/bin/python -m benchmarks.weights [--versions 5] [--lr 1e-6] [--threads 2]
    .venv/bin/python -m benchmarks.weights --tiny          # a smoke test (seconds)

Model: a random-init ``Qwen2ForCausalLM`` with Qwen2.5-0.5B's config written out by hand
(`benchmarks.gpu_trainer.qwen25_05b`, no download; 494 M parameters, tied embeddings),
float32 master weights. Each version is one ``torch.optim.AdamW`` step (lr ``--lr``,
no weight decay) on synthetic gradients (standard normal: Adam normalises them, so every
element moves by about lr, as in the first steps of a real run), then published in bf16
(the serving dtype) twice, into two stores on local disk: by a `file` transport of full
versions (the baseline) and by one with deltas (``full_every`` > ``--versions``: version
1 full, every later one a delta against the previous).

Per version and arm: bytes written (the version's files), publish seconds
(``transport.write``: cast, diff and state hash for deltas, serialise, hash, write), and
apply seconds: from the announcement to a verified full directory an engine can load
(full: `WeightStore.verify`, every file hashed; delta: verify the delta's files, read the
version held, apply, hash the state, write the rebuilt directory). Loading that
directory into an engine costs the same in both arms and is not timed. The summary
divides the delta arm by the full arm measured in the same run (versions 2+).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gpu_trainer import qwen25_05b, tiny
from pipeline.weights import FileTransport


def build(tiny_model: bool) -> torch.nn.Module:
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(tiny() if tiny_model else qwen25_05b()).float()


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.empty_like(p)
        p.grad.normal_(generator=g)
    opt.step()


def run(a: argparse.Namespace) -> list[dict[str, float]]:
    model = build(a.tiny)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="sluice-bench-weights-") as d:
        root = Path(d)
        full = FileTransport(root / "full", dtype=torch.bfloat16, keep=2)
        delta = FileTransport(root / "delta", dtype=torch.bfloat16, keep=2,
                              full_every=a.versions + 1)
        full_rx = FileTransport(root / "full", keep=2, cache_dir=root / "rx-full")
        delta_rx = FileTransport(root / "delta", keep=2, cache_dir=root / "rx-delta")
        for v in range(1, a.versions + 1):
            step(model, opt, v)
            row: dict[str, float] = {"version": v}
            for arm, pub, rx in (("full", full, full_rx), ("delta", delta, delta_rx)):
                t0 = time.perf_counter()
                msg = pub.write(model, version=v, step=v)
                t1 = time.perf_counter()
                asyncio.run(rx.receive(msg))
                t2 = time.perf_counter()
                row.update({f"{arm}_bytes": msg.nbytes, f"{arm}_publish_s": t1 - t0,
                            f"{arm}_apply_s": t2 - t1})
                if arm == "delta":
                    row["delta_is_delta"] = float(msg.format == "delta")
                    row["changed"] = pub.deltas.changed if msg.format == "delta" else 1.0
            rows.append(row)
            print(f"v{v}: full {row['full_bytes'] / 2**20:9.1f} MiB  publish "
                  f"{row['full_publish_s']:6.2f} s  apply {row['full_apply_s']:6.2f} s | "
                  f"{'delta' if row['delta_is_delta'] else 'full '} "
                  f"{row['delta_bytes'] / 2**20:9.1f} MiB  publish {row['delta_publish_s']:6.2f} s"
                  f"  apply {row['delta_apply_s']:6.2f} s  changed {100 * row['changed']:.2f}%",
                  flush=True)
        delta_rx.rebuilder.close()
    return rows


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    """Medians over the delta versions, and the delta arm's ratios to the full arm."""
    deltas = [r for r in rows if r["delta_is_delta"]]
    if not deltas:
        return {}
    med = {k: statistics.median(r[k] for r in deltas)
           for k in ("full_bytes", "delta_bytes", "full_publish_s", "delta_publish_s",
                     "full_apply_s", "delta_apply_s", "changed")}
    return {**med, "bytes_ratio": med["delta_bytes"] / med["full_bytes"],
            "publish_ratio": med["delta_publish_s"] / med["full_publish_s"],
            "apply_ratio": med["delta_apply_s"] / med["full_apply_s"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks.weights", description=__doc__.split("\n")[0])
    ap.add_argument("--versions", type=int, default=5, help="versions published (>= 2)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="a tiny Qwen2 (smoke test)")
    a = ap.parse_args(argv)
    if a.versions < 2:
        ap.error("--versions must be at least 2 (version 1 is full in both arms)")
    torch.set_num_threads(a.threads)
    model_name = "tiny Qwen2" if a.tiny else "Qwen2.5-0.5B-shaped (random init)"
    print(f"{model_name}, AdamW lr {a.lr:g} on synthetic gradients, published in bf16, "
          f"{a.versions} versions, {a.threads} threads", flush=True)
    s = summary(run(a))
    print(f"median over {a.versions - 1} delta versions: full {s['full_bytes'] / 2**20:.1f} "
          f"MiB vs delta {s['delta_bytes'] / 2**20:.1f} MiB ({100 * s['changed']:.2f}% of "
          f"elements changed)")
    print(f"delta / full: bytes {s['bytes_ratio']:.4f}  publish {s['publish_ratio']:.2f}  "
          f"apply {s['apply_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
