"""pipeline.weights.nccl: the HTTP orchestration of vLLM's NCCL weight transfer.

No GPU: the NCCL join and broadcast are replaced by fakes that block until the servers'
side of the "rendezvous" arrives (as NCCL would), so concurrency is checked, not assumed.
Fake servers are aiohttp apps on 127.0.0.1; the last test serves vLLM's own route
handlers (from .venv-vllm, skipped without it) with a recording engine client.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web

from pipeline.ports import free_port
from pipeline.weights.nccl import EXIT_PATH, NCCLWeightSync, WeightSyncError, update_info
from pipeline.weights.nccl_binding import Binding

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 5.0
VLLM_VERSION = "0.32.0"  # what the fake servers report on GET /version
PUSH_ORDER = ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update",
              "/reset_prefix_cache", "/resume"]


def _state() -> dict[str, torch.Tensor]:
    return {"model.embed_tokens.weight": torch.zeros(8, 4, dtype=torch.bfloat16),
            "model.layers.0.mlp.up_proj.weight": torch.zeros(6, 4),
            "model.norm.weight": torch.ones(4, dtype=torch.float16),
            "step": torch.zeros((), dtype=torch.int64)}


class Rendezvous:
    """Both sides of a fake NCCL call: each blocks until the other has arrived."""

    def __init__(self) -> None:
        self.servers_in, self.trainer_in = threading.Event(), threading.Event()
        self.calls: list[Any] = []

    def trainer(self, arg: Any) -> str:
        self.trainer_in.set()
        if not self.servers_in.wait(WAIT_S):
            raise TimeoutError("no server joined the fake collective")
        self.calls.append(arg)
        return "group"

    async def server(self) -> None:
        self.servers_in.set()
        deadline = time.monotonic() + WAIT_S
        while not self.trainer_in.is_set():
            assert time.monotonic() < deadline, "trainer never joined the fake collective"
            await asyncio.sleep(0.005)


@asynccontextmanager
async def fake_servers(n: int, rdv: Rendezvous, fail: dict[tuple[int, str], int] | None = None,
                       sizes: list[int] | None = None):
    """``n`` servers logging ``(server, path, query, body)``; ``fail[(i, path)]`` = status."""
    log: list[tuple[int, str, dict[str, str], Any]] = []
    runners, urls = [], []
    for i in range(n):
        async def handle(req: web.Request, i: int = i) -> web.Response:
            body = await req.json() if req.can_read_body else None
            log.append((i, req.path, dict(req.query), body))
            status = (fail or {}).get((i, req.path))
            if req.path in ("/update_weights", "/init_weight_transfer_engine") and not status:
                await rdv.server()
            if status:
                return web.Response(status=status, text=f"boom {i}")
            if req.path == "/version":  # vLLM's GET /version
                return web.json_response({"version": VLLM_VERSION})
            if req.path == "/get_world_size":
                return web.json_response({"world_size": (sizes or [1] * n)[i]})
            if req.path == "/reset_prefix_cache":
                return web.json_response({"success": True})
            return web.json_response({"message": "ok"})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    try:
        yield urls, log
    finally:
        for r in runners:
            await r.cleanup()


def _sync(urls: list[str], rdv: Rendezvous, **kw: Any) -> NCCLWeightSync:
    return NCCLWeightSync(urls, "10.0.0.1", 29500, join=rdv.trainer, broadcast=rdv.trainer,
                          **kw)


def test_update_info_is_what_vllm_parses() -> None:
    # vllm/distributed/weight_transfer/nccl_engine.py: NCCLWeightTransferUpdateInfo(names,
    # dtype_names, shapes: list[list[int]]); the receiver does getattr(torch, dtype_name).
    info = update_info(_state())
    assert info == {"names": list(_state()),
                    "dtype_names": ["bfloat16", "float32", "float16", "int64"],
                    "shapes": [[8, 4], [6, 4], [4], []]}
    assert [getattr(torch, d) for d in info["dtype_names"]] == [
        t.dtype for t in _state().values()]
    assert update_info(list(_state().items())) == info
    json.dumps(info)  # travels as JSON


def test_push_order_bodies_and_concurrent_broadcast() -> None:
    async def main() -> None:
        rdv = Rendezvous()
        async with fake_servers(2, rdv) as (urls, log):
            sync = _sync(urls, rdv, workers_per_server=1)
            sync.group = "group"
            paused = await sync.push(_state(), version=7)
            await sync.close()
        assert paused > 0
        assert rdv.calls and [n for n, _ in rdv.calls[0]] == list(_state())
        for i in range(2):
            mine = [(p, q, b) for s, p, q, b in log if s == i]
            assert [p for p, _, _ in mine] == PUSH_ORDER
            assert mine[0][1] == {"mode": "keep", "clear_cache": "true"}
            assert mine[2][2] == {"update_info": update_info(_state())}
            assert mine[3][2] == {"weight_version": "7"}
        # every phase is done on all servers before the next starts; resume is last
        phases = [PUSH_ORDER.index(p) for _, p, _, _ in log]
        assert phases == sorted(phases)
        assert sync.last_cache_reset == dict.fromkeys(urls, True)

    asyncio.run(main())


def test_a_transfer_cut_short_asks_every_server_to_exit_instead_of_resuming() -> None:
    """Server 1 refuses /update_weights while server 0's workers are in the collective
    with the trainer: server 0 would wait in NCCL for good, so neither is resumed; both
    are asked to exit (`workers.engines.vllm_guard`), and the error is raised."""
    async def main() -> None:
        rdv = Rendezvous()
        async with fake_servers(2, rdv, fail={(1, "/update_weights"): 500}) as (urls, log):
            sync = _sync(urls, rdv, workers_per_server=1, clear_cache=False)
            sync.group = "group"
            with pytest.raises(WeightSyncError) as e:
                await sync.push(_state(), version=3)
            assert (e.value.server, e.value.path, e.value.status) == (
                urls[1], "/update_weights", 500)
            assert "boom 1" in str(e.value) and isinstance(e.value, RuntimeError)
            assert sync.broken  # the group is unusable after a cut-short transfer
            with pytest.raises(RuntimeError, match="unusable"):
                await sync.push(_state(), version=4)
            await sync.close()
        paths = [p for _, p, _, _ in log]
        assert "/finish_weight_update" not in paths and "/reset_prefix_cache" not in paths
        assert "/resume" not in paths
        assert sorted(s for s, p, _, _ in log if p == EXIT_PATH) == [0, 1]
        assert paths[-2:] == [EXIT_PATH, EXIT_PATH] and sync.exited == urls
        assert log[0][2] == {"mode": "keep", "clear_cache": "false"}

    asyncio.run(main())


def test_a_failed_pause_resumes_all_and_a_failed_resume_is_raised() -> None:
    async def main() -> None:
        rdv = Rendezvous()
        async with fake_servers(2, rdv, fail={(0, "/pause"): 503}) as (urls, log):
            sync = _sync(urls, rdv, workers_per_server=1)
            sync.group = "group"
            with pytest.raises(WeightSyncError, match="HTTP 503"):
                await sync.push(_state(), version=1)
            assert sorted(s for s, p, _, _ in log if p == "/resume") == [0, 1]
            assert not sync.broken and not rdv.calls
            await sync.close()
        async with fake_servers(1, rdv, fail={(0, "/resume"): 500}) as (urls, log):
            sync = _sync(urls, rdv, workers_per_server=1)
            sync.group = "group"
            with pytest.raises(WeightSyncError, match="/resume"):
                await sync.push(_state(), version=2)
            await sync.close()

    asyncio.run(main())


def test_init_gives_each_server_its_own_ranks() -> None:
    async def main() -> None:
        rdv = Rendezvous()
        async with fake_servers(3, rdv, sizes=[1, 2, 4]) as (urls, log):
            sync = _sync(urls, rdv)
            assert await sync.init() == 8
            await sync.close()
        inits = {s: b["init_info"] for s, p, _, b in log if p == "/init_weight_transfer_engine"}
        assert [inits[i]["rank_offset"] for i in range(3)] == [1, 2, 4]
        for info in inits.values():
            assert info["world_size"] == 8 and info["packed"] is True
            assert (info["master_address"], info["master_port"]) == ("10.0.0.1", 29500)
        assert rdv.calls == [{"master_address": "10.0.0.1", "master_port": 29500,
                              "world_size": 8}]

    asyncio.run(main())


def test_init_with_a_fixed_worker_count_skips_discovery() -> None:
    async def main() -> None:
        rdv = Rendezvous()
        async with fake_servers(2, rdv) as (urls, log):
            sync = _sync(urls, rdv, workers_per_server=2)
            assert await sync.init() == 5
            await sync.close()
        assert all(p == "/init_weight_transfer_engine" for _, p, _, _ in log)
        assert sorted(b["init_info"]["rank_offset"] for _, _, _, b in log) == [1, 3]

    asyncio.run(main())


# ---------------------------------------------------------------- vLLM's own routes
VLLM_APP = """
import sys, torch, uvicorn
from types import SimpleNamespace
from fastapi import FastAPI
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
from vllm.entrypoints.rl.online.api_router import router as rl
from vllm.entrypoints.serve.dev.cache.api_router import router as cache

calls = []
class Engine:
    vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(world_size_across_dp=2))
    async def pause_generation(self, mode, clear_cache): calls.append(["pause", mode, clear_cache])
    async def resume_generation(self): calls.append(["resume"])
    async def init_weight_transfer_engine(self, req):
        info = NCCLWeightTransferInitInfo(**req.init_info)
        calls.append(["init", info.rank_offset, info.world_size, info.packed])
    async def start_weight_update(self): calls.append(["start"])
    async def update_weights(self, request):
        u = NCCLWeightTransferUpdateInfo(**request.update_info)
        calls.append(["update", u.names, [str(getattr(torch, d)) for d in u.dtype_names],
                      u.shapes])
    async def finish_weight_update(self, weight_version): calls.append(["finish", weight_version])
    async def reset_prefix_cache(self, running, external):
        calls.append(["reset", running, external]); return True

app = FastAPI()
app.include_router(rl); app.include_router(cache)
app.get("/calls")(lambda: calls)
app.state.engine_client = Engine()
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


@pytest.fixture
def vllm_routes(tmp_path: Path) -> Iterator[str]:
    py = Path(os.environ.get("SLUICE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    if not py.exists():
        pytest.skip("no .venv-vllm: vLLM's route handlers are not available")
    (tmp_path / "app.py").write_text(VLLM_APP)
    port = free_port()
    proc = subprocess.Popen([str(py), str(tmp_path / "app.py"), str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_vllm_route_handlers_accept_every_request(vllm_routes: str) -> None:
    async def main() -> list[Any]:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 120
            while True:
                try:
                    async with http.get(vllm_routes + "/calls") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, "vLLM route app did not start"
                await asyncio.sleep(0.2)
            sync = NCCLWeightSync([vllm_routes], "127.0.0.1", 29500, session=http,
                                  join=lambda rdv: "group", broadcast=lambda pairs: None)
            assert await sync.init() == 3  # /get_world_size says 2
            await sync.push(_state(), version=7)
            async with http.get(vllm_routes + "/calls") as r:
                return await r.json()

    calls = asyncio.run(main())
    info = update_info(_state())
    assert calls == [["init", 1, 3, True], ["pause", "keep", True], ["start"],
                     ["update", info["names"], [str(t.dtype) for t in _state().values()],
                      info["shapes"]],
                     ["finish", "7"], ["reset", False, False], ["resume"]]


# ---------------------------------------------------------------- vLLM's trainer_init
RDV = {"master_address": "10.0.0.1", "master_port": 29500, "world_size": 3}


@pytest.mark.parametrize("shape", ["init_info", "init_info, rank=0", "init_info, *, rank=0"])
def test_vllm_join_calls_trainer_init_of_either_signature(shape: str) -> None:
    """vLLM 0.32 has ``trainer_init(init_info, rank=0)``; versions without the rank take
    ``trainer_init(init_info)`` only (the trainer is always rank 0 there)."""
    calls: list[dict[str, Any]] = []
    scope: dict[str, Any] = {"calls": calls}
    exec(f"def trainer_init({shape}):\n    calls.append(dict(locals()))\n"
         "    return 'group'\n", scope)
    sync = NCCLWeightSync(["http://x:1"], "10.0.0.1", 29500, device=None)
    sync.bound = Binding("0.32.0", "2.13.0", "2.13.0", cuda=True,
                         trainer_init=scope["trainer_init"])  # as `init` leaves it
    assert sync._vllm_join(dict(RDV)) == "group"
    assert calls[0]["init_info"] == RDV
    assert calls[0].get("rank", 0) == 0


def test_trainer_init_arguments_fit_the_installed_vllm() -> None:
    """The call `trainer_init_kwargs` builds binds to the real signature of the vLLM in
    .venv-vllm (read in a subprocess: the CPU trainer environment has no vLLM)."""
    import inspect

    from pipeline.weights.nccl import trainer_init_kwargs

    py = Path(os.environ.get("SLUICE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    if not py.exists():
        pytest.skip("no .venv-vllm: the installed vLLM's trainer_init cannot be read")
    probe = ("import inspect, json\n"
             "from vllm.distributed.weight_transfer.nccl_common import trainer_init\n"
             "print(json.dumps([[p.name, p.kind.name, p.default is not p.empty]\n"
             "                  for p in inspect.signature(trainer_init).parameters.values()]))")
    out = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=300,
                         check=True, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    params = json.loads(out.stdout.strip().splitlines()[-1])
    sig = inspect.Signature([inspect.Parameter(
        name, getattr(inspect.Parameter, kind),
        **({"default": 0} if has_default else {})) for name, kind, has_default in params])

    def real(*args: Any, **kwargs: Any) -> Any:
        return sig.bind(*args, **kwargs)

    real.__signature__ = sig  # type: ignore[attr-defined]
    args, kwargs = trainer_init_kwargs(real, dict(RDV))
    bound = sig.bind(*args, **kwargs)  # raises TypeError if our call does not fit
    bound.apply_defaults()
    assert next(iter(bound.arguments.values())) == RDV
    assert bound.arguments.get("rank", 0) == 0
    assert [p[0] for p in params][:2] == ["init_info", "rank"]  # vllm 0.32, as reviewed


# ---------------------------------------------------------------- timeouts and fallback
class Stuck:
    """A blocking NCCL call that never completes on its own (a peer that never arrives);
    `release` frees the daemon thread at the end of a test."""

    def __init__(self, rdv: Rendezvous | None = None) -> None:
        self.rdv, self.gate, self.entered = rdv, threading.Event(), threading.Event()

    def __call__(self, arg: Any) -> str:
        self.entered.set()
        if self.rdv is not None:
            self.rdv.trainer_in.set()  # the servers' side of the call completes
        self.gate.wait()
        return "group"

    def release(self) -> None:
        self.gate.set()


@asynccontextmanager
async def silent_server():
    """A TCP server on 127.0.0.1 that accepts connections and never answers."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.read()  # until the client gives up

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        for w in held:
            w.close()
        server.close()


def _small_state() -> dict[str, torch.Tensor]:
    return {"model.embed_tokens.weight": torch.arange(32.0).reshape(8, 4),
            "model.norm.weight": torch.ones(4)}


def _transport(sync: NCCLWeightSync, root: Path) -> Any:
    from pipeline.weights.file import FileTransport
    from pipeline.weights.nccl_transport import NCCLTransport

    return NCCLTransport(sync, FileTransport(root))


TIMEOUT_S = 1.0


def test_a_broadcast_that_never_completes_falls_back_to_the_files(tmp_path: Path) -> None:
    """The servers answer every call, but the trainer's broadcast never returns: the
    publish comes back within the timeout with a store version generators can load."""
    async def main() -> None:
        rdv, stuck = Rendezvous(), None
        stuck = Stuck(rdv)
        async with fake_servers(2, rdv) as (urls, log):
            sync = NCCLWeightSync(urls, "10.0.0.1", 29500, workers_per_server=1,
                                  join=rdv.trainer, broadcast=stuck, timeout_s=TIMEOUT_S)
            t = _transport(sync, tmp_path / "w")
            await t.start()
            assert sync.group == "group" and not sync.broken
            try:
                t0 = time.monotonic()
                msg = await asyncio.wait_for(t.publish(_small_state(), version=1, step=1),
                                             TIMEOUT_S + 10)
                took = time.monotonic() - t0
                assert stuck.entered.is_set() and took < TIMEOUT_S + 5
                assert sync.broken and "timed out" in sync.broken
                d = await t.receive(msg)  # what a generator does with the announcement
                assert msg.format == "safetensors" and d == t.store.dir_for(1)
                loaded = t.fallback.load(msg)
                assert all(torch.equal(loaded[k], v) for k, v in _small_state().items())
                assert t.fallbacks == 1 and t.stats["weight_fallbacks"] == 1
                # the servers were in the transfer: asked to exit, not resumed; the version
                # label was never set by the push
                paths = [p for _, p, _, _ in log]
                assert paths.count(EXIT_PATH) == 2 and "/resume" not in paths
                assert "/finish_weight_update" not in paths
                # the group is unusable now: the next version goes through the files at once
                t0 = time.monotonic()
                msg2 = await t.publish(_small_state(), version=2, step=2)
                assert time.monotonic() - t0 < TIMEOUT_S and msg2.version == 2
                assert t.fallbacks == 2 and paths == [p for _, p, _, _ in log]
                await t.close()
            finally:
                stuck.release()

    asyncio.run(main())


def test_servers_that_never_answer_time_out_at_start_and_the_run_goes_on(
        tmp_path: Path) -> None:
    """A real socket that accepts and never answers: the join at start gives up within
    the timeout (the trainer goes on, on the files), and so does a push."""
    async def main() -> None:
        stuck = Stuck()
        async with silent_server() as url:
            sync = NCCLWeightSync([url], "127.0.0.1", free_port(), workers_per_server=1,
                                  join=stuck, broadcast=stuck, timeout_s=TIMEOUT_S)
            t = _transport(sync, tmp_path / "w")
            try:
                t0 = time.monotonic()
                await asyncio.wait_for(t.start(), TIMEOUT_S + 10)  # no exception
                assert time.monotonic() - t0 < TIMEOUT_S + 5
                assert sync.broken and sync.group is None
                msg = await asyncio.wait_for(t.publish(_small_state(), version=1, step=1),
                                             TIMEOUT_S + 10)
                assert await t.receive(msg) == t.store.dir_for(1) and t.fallbacks == 1
                # a push to a server that never answers, on a group that formed
                sync.broken, sync.group = None, "group"
                t0 = time.monotonic()
                msg = await asyncio.wait_for(t.publish(_small_state(), version=2, step=2),
                                             2 * TIMEOUT_S + 10)
                # the push is bounded by the timeout, resume by min(30 s, the timeout)
                assert time.monotonic() - t0 < 2 * TIMEOUT_S + 5
                assert sync.broken and "timed out" in sync.broken
                assert await t.receive(msg) == t.store.dir_for(2) and t.fallbacks == 2
                await t.close()
            finally:
                stuck.release()

    asyncio.run(main())


def test_the_exit_path_is_the_guards() -> None:
    from workers.engines import vllm_guard

    assert EXIT_PATH == vllm_guard.EXIT_PATH


def test_the_timeout_defaults_agree_with_the_config() -> None:
    from pipeline.config import VLLMConfig
    from pipeline.weights.nccl import NCCL_TIMEOUT_S

    assert VLLMConfig().nccl_timeout_s == NCCL_TIMEOUT_S
    sync = NCCLWeightSync(["http://x:1"], "h", 1)
    assert sync.timeout_s == NCCL_TIMEOUT_S and sync.resume_timeout_s == 30.0
    assert NCCLWeightSync(["http://x:1"], "h", 1, timeout_s=2.0).resume_timeout_s == 2.0


def test_fallbacks_are_a_trainer_counter_fed_by_the_heartbeat() -> None:
    from prometheus_client import generate_latest

    from pipeline.metrics import RoleMetrics

    m = RoleMetrics("trainer", "trainer/trainer-0")
    text = generate_latest(m.registry).decode()
    assert 'sluice_batch_weight_fallbacks_total{role="trainer",worker="trainer-0"} 0.0' in text
    m.sync({"weight_fallbacks": 2})
    m.sync({"weight_fallbacks": 3})
    text = generate_latest(m.registry).decode()
    assert 'sluice_batch_weight_fallbacks_total{role="trainer",worker="trainer-0"} 3.0' in text


def test_the_run_s_nccl_transport_takes_its_timeout_and_the_trainers_gpu(
        tmp_path: Path) -> None:
    """make_transport wires generation.vllm.nccl_timeout_s into the sync, and the NCCL
    threads' device is the trainer's (None without one here: the CPU)."""
    from pipeline.config import load_config
    from pipeline.weights import make_transport

    cfg = load_config(None, [f"run.output_dir={tmp_path}", "generation.engine=vllm",
                             "generation.vllm.urls=['http://127.0.0.1:9']",
                             "generation.vllm.weight_transfer=nccl",
                             "generation.vllm.nccl_timeout_s=7"])
    transport = make_transport(cfg)
    assert transport.name == "nccl"
    assert transport.sync.timeout_s == 7.0  # type: ignore[attr-defined]
    assert transport.sync.device is None  # type: ignore[attr-defined]
    assert transport.fallbacks == 0  # type: ignore[attr-defined]
