"""vLLM engine vs the in-process transformers engine: throughput and weight-swap pause.

    .venv/bin/python benchmarks/engines.py [--groups 64] [--concurrency 16] [--out F.json]

One run, same tiny model (the quick start's char-level Qwen2, fp32, built in a temp dir),
same ``copy`` prompts, same sampling settings (examples/copy.toml: 8 completions per
group, 8 new tokens, temperature 1) on both engines. Measured per engine:

* wall time, completion tokens (sum of ``len(token_ids)``), groups/s and tokens/s for
  ``--groups`` groups, after a warm-up; row ``quick`` uses copy.toml's settings (eos
  ends a completion), row ``long`` uses ``--long-tokens`` with eos ignored, so both
  engines produce exactly the same number of tokens and fixed per-request costs (HTTP,
  JSON, prefill) do not dominate;
* CPU seconds spent (this process + the vLLM server's process tree) in the timed window;
* weight-swap pause. vLLM: ``servers[0].swaps`` (pause -> reload -> label -> reset cache
  -> resume, read from the store dir on disk) alternating two checkpoints, idle and once
  while a batch decodes. transformers: ``load_weights`` idle (file read +
  ``load_state_dict``), ``update_weights`` alone (``load_state_dict``), and mid-generation
  the file read plus the time until the new version is in use (includes one decode step).

Fairness: the transformers engine decodes in this process with torch threads = 1, in
batches of ``batch_groups`` groups, like a generator. The vLLM server's OpenMP threads are
bound to core 0 (``VLLM_CPU_OMP_THREADS_BIND``); this process is then pinned to core 1.
So each engine *decodes* on one core, but not all CPU use is equal: the vLLM side also
spends CPU outside its decode core (API-server process, HTTP/JSON in this client, which
shares core 1), and the transformers engine pays its Python overhead on its one core.
The CPU-seconds column and "tokens per CPU-s" ratio show that cost. vLLM runs
``--concurrency`` groups in flight (``concurrency / batch_groups`` batches of
``batch_groups`` one-request-per-group, as the generator with ``concurrent_batches``);
the transformers engine cannot overlap batches. The machine is noisy: read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import tomllib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from safetensors.torch import load_file

from pipeline.model import init_tiny_model, load_model, model_state_for_publish
from pipeline.runtime import set_threads
from pipeline.weights import WEIGHTS_FILE, FileWeightStore
from workers.engines.base import Completion, SamplingParams
from workers.engines.transformers import TransformersEngine
from workers.engines.vllm import VLLMEngine
from workers.engines.vllm_server import LocalServer, ServerSpec, launch
from workers.generator import render_prompt
from workers.tasks import make_task

ROOT = Path(__file__).resolve().parent.parent
Groups = list[list[Completion]]


class NoEosVLLMEngine(VLLMEngine):
    """`VLLMEngine` whose requests carry ``ignore_eos`` (the ``long`` row); the run checks
    every completion has exactly max_new_tokens tokens, so a silent no-op is caught."""

    @staticmethod
    def sampling(params: SamplingParams) -> dict[str, Any]:
        return {**VLLMEngine.sampling(params), "ignore_eos": True}


# ----------------------------------------------------------------- pure helpers
def summarize(groups: Groups, wall_s: float, cpu_s: float) -> dict[str, float]:
    """Counts and rates of one timed run."""
    tokens = sum(len(c.token_ids) for g in groups for c in g)
    return {"groups": len(groups), "completions": sum(len(g) for g in groups),
            "tokens": tokens, "wall_s": wall_s, "cpu_s": cpu_s,
            "groups_per_s": len(groups) / wall_s, "tokens_per_s": tokens / wall_s,
            "tokens_per_cpu_s": tokens / cpu_s if cpu_s > 0 else float("nan")}


def pause_stats(seconds: list[float]) -> dict[str, float]:
    return {"n": len(seconds), "median_ms": 1e3 * statistics.median(seconds),
            "max_ms": 1e3 * max(seconds)} if seconds else {"n": 0}


def spans_versions(groups: Groups) -> int:
    """Completions whose tokens carry more than one weight version."""
    return sum(len(set(c.versions.tolist())) > 1 for g in groups for c in g)


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


# ----------------------------------------------------------------- runners
async def run_transformers(e: TransformersEngine, prompts: list[list[int]], n: int,
                           params: SamplingParams, batch_groups: int) -> Groups:
    out: Groups = []
    for i in range(0, len(prompts), batch_groups):
        out += await e.generate(prompts[i:i + batch_groups], n, params)
    return out


async def run_vllm(e: VLLMEngine, prompts: list[list[int]], n: int, params: SamplingParams,
                   batch_groups: int, concurrency: int) -> Groups:
    """``concurrency // batch_groups`` producers, each generating a batch of groups (one
    request per group) and waiting for all of it before taking the next, as the
    generator's ``produce`` loops do."""
    size = min(batch_groups, concurrency)
    batches = [list(range(i, min(i + size, len(prompts)))) for i in range(0, len(prompts), size)]
    out: list[list[Completion]] = [[] for _ in prompts]

    async def producer() -> None:
        while batches:
            idx = batches.pop(0)
            res = await asyncio.gather(*(e.generate([prompts[i]], n, params) for i in idx))
            for i, r in zip(idx, res, strict=True):
                out[i] = r[0]

    await asyncio.gather(*(producer() for _ in range(max(1, concurrency // size))))
    return out


async def timed(fn: Callable[[], Awaitable[Groups]],
                procs: list[psutil.Process]) -> tuple[Groups, float, float]:
    c0, t0 = cpu_seconds(procs), time.perf_counter()
    res = await fn()
    wall = time.perf_counter() - t0
    return res, wall, cpu_seconds(procs) - c0


async def until_running(url: str, timeout_s: float = 30.0) -> None:
    """Wait until the server reports a running request (so a swap lands mid-decode)."""
    async with aiohttp.ClientSession() as s:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            async with s.get(url + "/metrics") as r:
                for line in (await r.text()).splitlines():
                    if line.startswith("vllm:num_requests_running") and float(line.split()[-1]):
                        return
            await asyncio.sleep(0.01)
    raise RuntimeError("no request ever ran on the vLLM server")


# ----------------------------------------------------------------- benchmark
async def bench(a: argparse.Namespace, server: LocalServer, model_dir: Path,
                ckpts: list[Path]) -> dict[str, Any]:
    model, tok = load_model(model_dir)
    task = make_task("copy", seed=0, num_prompts=a.groups + a.concurrency)
    prompts = [render_prompt(tok, str(task.prompt(i)["text"])) for i in range(len(task))]
    timed_p, warm_p = prompts[:a.groups], prompts[a.groups:]
    rows = {"quick": (SamplingParams(a.max_new_tokens, temperature=a.temperature), False),
            "long": (SamplingParams(a.long_tokens, temperature=a.temperature), True)}
    srv = psutil.Process(server.proc.pid)  # type: ignore[union-attr]
    server_procs = [srv, *srv.children(recursive=True)]
    me = [psutil.Process()]
    tf = {False: TransformersEngine(model, tok, seed=0), True: TransformersEngine(model, -1)}
    vl = {False: VLLMEngine([server.url], str(model_dir), seed=0),
          True: NoEosVLLMEngine([server.url], str(model_dir), seed=0)}
    for e in vl.values():
        await e.start()
    out: dict[str, Any] = {"rows": {}, "server_cpu_s_while_idle": 0.0}
    try:
        for row, (params, no_eos) in rows.items():
            await run_vllm(vl[no_eos], warm_p, a.num_generations, params, a.batch_groups,
                           a.concurrency)
            await run_transformers(tf[no_eos], warm_p[:a.batch_groups], a.num_generations,
                                   params, a.batch_groups)
            res: dict[str, list[dict[str, float]]] = {"vllm": [], "transformers": []}
            for rep in range(a.repeats):  # alternate who goes first
                for name in (["vllm", "transformers"] if rep % 2 == 0
                             else ["transformers", "vllm"]):
                    if name == "vllm":
                        g, wall, cpu = await timed(lambda p=params, x=no_eos: run_vllm(
                            vl[x], timed_p, a.num_generations, p, a.batch_groups,
                            a.concurrency), me + server_procs)
                    else:
                        srv_c0 = cpu_seconds(server_procs)
                        g, wall, cpu = await timed(lambda p=params, x=no_eos: run_transformers(
                            tf[x], timed_p, a.num_generations, p, a.batch_groups), me)
                        out["server_cpu_s_while_idle"] += cpu_seconds(server_procs) - srv_c0
                    if no_eos and any(len(c) != params.max_new_tokens for x in g for c in x):
                        raise RuntimeError(f"{name}: eos was not ignored in row {row!r}")
                    res[name].append(summarize(g, wall, cpu))
            out["rows"][row] = {k: {m: statistics.median(r[m] for r in v) for m in v[0]}
                                | {"runs": v} for k, v in res.items()}
        out["swaps"] = await swaps(a, vl[True], tf[True], ckpts, warm_p, server.url)
    finally:
        for e in vl.values():
            await e.close()
    return out


async def swaps(a: argparse.Namespace, vl: VLLMEngine, tf: TransformersEngine,
                ckpts: list[Path], prompts: list[list[int]], url: str) -> dict[str, Any]:
    """Alternate the two checkpoints (B, A, B, ...) at increasing versions."""
    n, long = a.num_generations, SamplingParams(a.long_tokens, temperature=a.temperature)
    s = vl.servers[0]
    for v in range(1, a.swaps + 1):
        assert await vl.load_weights(str(ckpts[v % 2]), v, "safetensors")
    idle = list(s.swaps)
    job = asyncio.create_task(run_vllm(vl, prompts, n, long, a.batch_groups, a.concurrency))
    await until_running(url)
    await asyncio.sleep(0.05)
    v = a.swaps + 1
    assert await vl.load_weights(str(ckpts[v % 2]), v, "safetensors")
    mid = s.swaps[len(idle):]
    spans = spans_versions(await job)
    out: dict[str, Any] = {"vllm": {"idle": pause_stats(idle), "mid_generation": pause_stats(mid),
                                    "mid_spanning_completions": spans}}

    load, apply = [], []
    for v in range(1, a.swaps + 1):
        t = time.perf_counter()
        assert await tf.load_weights(ckpts[v % 2], v, "safetensors")
        load.append(time.perf_counter() - t)
    for v in range(a.swaps + 1, 2 * a.swaps + 1):
        state = load_file(str(ckpts[v % 2] / WEIGHTS_FILE))
        t = time.perf_counter()
        tf.update_weights(state, v)
        apply.append(time.perf_counter() - t)
    v = 2 * a.swaps + 1
    job = asyncio.create_task(tf.generate(prompts[:a.batch_groups], n, long))
    for _ in range(4):  # let it decode a few steps
        await asyncio.sleep(0)
    t = time.perf_counter()
    await tf.load_weights(ckpts[v % 2], v, "safetensors")
    read = time.perf_counter() - t
    while tf.version != v and not job.done():
        await asyncio.sleep(0)
    applied = time.perf_counter() - t
    out["transformers"] = {"idle_load_weights": pause_stats(load),
                           "idle_update_weights": pause_stats(apply),
                           "mid_read_ms": 1e3 * read, "mid_applied_after_ms": 1e3 * applied,
                           "mid_spanning_completions": spans_versions(await job)}
    return out


def report(a: argparse.Namespace, r: dict[str, Any]) -> None:
    cols = ("groups", "completions", "tokens", "wall_s", "groups_per_s", "tokens_per_s",
            "cpu_s", "tokens_per_cpu_s")
    print(f"\n{'row':<6} {'engine':<13}" + "".join(f"{c:>17}" for c in cols))
    for row, engines in r["rows"].items():
        for name, m in engines.items():
            print(f"{row:<6} {name:<13}" + "".join(f"{m[c]:>17.2f}" for c in cols))
    print()
    for row, m in r["rows"].items():
        v, t = m["vllm"], m["transformers"]
        print(f"{row}: vllm/transformers tokens/s = {v['tokens_per_s'] / t['tokens_per_s']:.2f}×"
              f", groups/s = {v['groups_per_s'] / t['groups_per_s']:.2f}×"
              f", tokens per CPU-s = {v['tokens_per_cpu_s'] / t['tokens_per_cpu_s']:.2f}×")
    sv, st = r["swaps"]["vllm"], r["swaps"]["transformers"]
    print(f"\nvllm swap pause idle: median {sv['idle']['median_ms']:.1f} ms, max "
          f"{sv['idle']['max_ms']:.1f} ms (n={sv['idle']['n']}); mid-generation "
          f"{sv['mid_generation']['max_ms']:.1f} ms ({sv['mid_spanning_completions']} "
          "completions span two versions)")
    print(f"transformers load_weights idle (read + load_state_dict): median "
          f"{st['idle_load_weights']['median_ms']:.1f} ms, max "
          f"{st['idle_load_weights']['max_ms']:.1f} ms; load_state_dict alone: median "
          f"{st['idle_update_weights']['median_ms']:.1f} ms; mid-generation: read "
          f"{st['mid_read_ms']:.1f} ms, in use after {st['mid_applied_after_ms']:.1f} ms "
          f"(incl. one decode step; {st['mid_spanning_completions']} completions span two "
          "versions)")
    print(f"\nvLLM server CPU while idle (during transformers runs): "
          f"{r['server_cpu_s_while_idle']:.2f} s. " + r["fairness"])


def main() -> None:
    gen = tomllib.loads((ROOT / "examples" / "copy.toml").read_text())["generation"]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=64, help="timed groups per engine and row")
    p.add_argument("--max-new-tokens", type=int, default=gen["max_new_tokens"])
    p.add_argument("--long-tokens", type=int, default=64, help="max_new_tokens, row `long`")
    p.add_argument("--num-generations", type=int, default=gen["num_generations"])
    p.add_argument("--temperature", type=float, default=gen["temperature"])
    p.add_argument("--batch-groups", type=int, default=gen["batch_groups"])
    p.add_argument("--concurrency", type=int, default=2 * gen["batch_groups"],
                   help="vLLM groups in flight (batch_groups * concurrent_batches)")
    p.add_argument("--swaps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per engine and row")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--out", type=Path, default=None, help="write results JSON here")
    a = p.parse_args()
    set_threads(1)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sluice-bench-engines-") as d:
        tmp = Path(d)
        model_dir = init_tiny_model(tmp / "model_a", seed=0)
        store = FileWeightStore(tmp / "weights")
        # ckpts[v % 2]: odd versions -> B (other weights), even -> A (the served ones)
        ckpts = [store.dir_for(1), store.dir_for(2)]
        for v, src in ((1, model_dir), (2, init_tiny_model(tmp / "model_b", seed=1))):
            store.publish(model_state_for_publish(load_model(src)[0]), version=v, step=0)
        t0 = time.perf_counter()
        spec = ServerSpec(python=a.vllm_python, model=str(model_dir), cpu_core=0)
        server = launch([spec], tmp / "vllm", timeout_s=300)[0]
        try:
            start_s = time.perf_counter() - t0
            # after launch: the server must not inherit this pinning
            if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
                os.sched_setaffinity(0, {1})
            r = asyncio.run(bench(a, server, model_dir, ckpts))
        finally:
            server.stop()
    r["fairness"] = ("Decoding: transformers = this process, 1 torch thread, pinned to core "
                     "1; vLLM = server OpenMP threads bound to core 0. CPU outside decoding "
                     "(vLLM API server, this HTTP client on core 1) is counted in cpu_s.")
    r |= {"args": {k: str(v) for k, v in vars(a).items()}, "server_start_s": start_s,
          "total_s": time.perf_counter() - t_start}
    report(a, r)
    print(f"server start {start_s:.1f} s; whole benchmark {r['total_s']:.1f} s")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(r, indent=2))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
