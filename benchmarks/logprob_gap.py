"""The sampler-trainer logprob gap on a real model: on the same sampled tokens, the
logprobs a vLLM server reports against the trainer's, per server dtype.

    .venv/bin/python benchmarks/logprob_gap.py --model DIR [--dtypes float32,bfloat16]
        [--prompts 16] [--n 4] [--max-new-tokens 48] [--out runs/logprob-gap]

``DIR`` is a model folder (SmolLM2-135M-Instruct: `sluice init-model DIR --from-gguf
FILE`, README "Your model"). Prompts are the `add` task's ("123+45="), rendered through
the model's chat template exactly as the generator renders them
(`workers.tasks.prompts.render_prompt`). For each server dtype one vLLM server (the flags
`sluice up` uses, `sluice.vllm_launch`) samples ``n`` completions per prompt at
temperature 1; its logprobs are those of the distribution it sampled from
(``processed_logprobs``). The trainer's logprobs of the same tokens come from the
trainer's own code (`pipeline.rl.logprobs`: decoder body, then the LM head in float32 on
the completion positions) on the model in float32.

Printed per dtype: tokens compared, mean / p50 / p99 / max |delta logprob|, and the
importance ratio exp(trainer - sampler) at p1 / p50 / p99 with the fraction of tokens
outside [0.8, 1.25] (where a PPO-style clip would act), and the mean |delta| as a ratio to
the float32 server's (the baseline, measured in the same run). The same figures go to
``OUT/logprob_gap.json``. This is what the importance-sampling correction exists for: with
a float32 server the two agree to rounding; a bfloat16 server is another policy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.model import load_model
from pipeline.rl.logprobs import chunked_head_logprobs, split_lm
from pipeline.vllm_auth import run_key
from sluice.vllm_launch import LocalServer, ServerSpec
from workers.engines.base import Completion, SamplingParams
from workers.engines.vllm import VLLMEngine
from workers.tasks.catalog import AddTask
from workers.tasks.prompts import render_prompt

ROOT = Path(__file__).resolve().parents[1]


def sample(model_dir: Path, dtype: str, prompts: list[list[int]], n: int,
           max_new_tokens: int, workdir: Path) -> tuple[list[list[Completion]], float]:
    """``n`` completions per prompt from a fresh vLLM server in ``dtype``; the seconds
    the sampling took (the server's start excluded)."""
    key = run_key(workdir / "auth")
    spec = ServerSpec(python=str(ROOT / ".venv-vllm" / "bin" / "python"),
                      model=str(model_dir), dtype=dtype, max_model_len=1024,
                      kv_cache_memory_bytes=512 * 2**20, api_key=key)
    server = LocalServer(spec, workdir / dtype)
    try:
        server.start().wait_ready(600)

        async def run() -> tuple[list[list[Completion]], float]:
            engine = VLLMEngine([server.url], str(model_dir), seed=0, api_key=key)
            await engine.start()
            try:
                t0 = time.perf_counter()
                out = await engine.generate(prompts, n, SamplingParams(max_new_tokens))
                return out, time.perf_counter() - t0
            finally:
                await engine.close()

        return asyncio.run(run())
    finally:
        server.stop()


@torch.no_grad()
def trainer_logprobs(model: torch.nn.Module, prompt: list[int],
                     completion: list[int]) -> np.ndarray:
    """The trainer's logprob of each completion token (float32 model, float32 head)."""
    body, head = split_lm(model)
    ids = torch.tensor([prompt + completion])
    hidden = body(input_ids=ids).last_hidden_state[0]
    start = len(prompt)
    positions = torch.arange(start - 1, start - 1 + len(completion))
    lp, _ = chunked_head_logprobs(head, hidden[positions], ids[0, start:],
                                  chunk_tokens=1024)
    return lp.numpy()


def gap_stats(deltas: np.ndarray) -> dict[str, float]:
    """Figures of ``deltas`` = trainer - sampler logprob per token."""
    a = np.abs(deltas)
    ratio = np.exp(deltas)
    return {"tokens": int(deltas.size), "mean_abs": float(a.mean()),
            "p50_abs": float(np.percentile(a, 50)), "p99_abs": float(np.percentile(a, 99)),
            "max_abs": float(a.max()), "ratio_p1": float(np.percentile(ratio, 1)),
            "ratio_p50": float(np.percentile(ratio, 50)),
            "ratio_p99": float(np.percentile(ratio, 99)),
            "outside_clip": float(np.mean((ratio < 0.8) | (ratio > 1.25)))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "logprob-gap")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
    model, tokenizer = load_model(args.model, dtype="float32")
    prompts = [render_prompt(tokenizer, p["text"])
               for p in AddTask(seed=0).heldout(args.prompts)]
    results: dict[str, Any] = {}
    for dtype in args.dtypes.split(","):
        groups, sample_s = sample(args.model, dtype, prompts, args.n, args.max_new_tokens,
                                  args.out)
        deltas, lengths = [], []
        for prompt, group in zip(prompts, groups, strict=True):
            for c in group:
                ours = trainer_logprobs(model, prompt, [int(t) for t in c.token_ids])
                deltas.append(ours - np.asarray(c.logprobs, dtype=np.float64))
                lengths.append(len(c.token_ids))
        stats = gap_stats(np.concatenate(deltas))
        stats.update(sample_s=sample_s, tokens_per_s=sum(lengths) / sample_s,
                     mean_completion_tokens=float(np.mean(lengths)))
        results[dtype] = stats
    base = results.get("float32", {}).get("mean_abs")
    print(f"{'server':>9} {'tokens':>6} {'mean|d|':>9} {'p99|d|':>8} {'max|d|':>8} "
          f"{'ratio p1':>8} {'p50':>6} {'p99':>6} {'outside':>7} {'tok/s':>6} {'vs fp32':>8}")
    for dtype, s in results.items():
        rel = f"{s['mean_abs'] / base:8.1f}x" if base else "       -"
        print(f"{dtype:>9} {s['tokens']:6d} {s['mean_abs']:9.2e} {s['p99_abs']:8.2e} "
              f"{s['max_abs']:8.2e} {s['ratio_p1']:8.3f} {s['ratio_p50']:6.3f} "
              f"{s['ratio_p99']:6.3f} {s['outside_clip']:7.1%} {s['tokens_per_s']:6.1f} {rel}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "logprob_gap.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
