"""The `nccl` transport: trainer → vLLM weight push over NCCL (vLLM 0.32's dense ``nccl``
weight-transfer backend), with the `file` transport as the store engines fall back to.

`NCCLTransport.publish` pushes the version to every server first, then writes it to the
store and returns that announcement: a generator finds its servers already labelled with
the version and reloads from disk only a server that missed the push
(`workers.engines.vllm_weights`). The push sends what the store writes (the fallback's
`FileTransport.serving_items`: with tied embeddings, ``lm_head.weight`` as its own
tensor, in the store's serving dtype; for a LoRA run with ``model.lora.sync = "merged"``
the merged base + adapter weights of `MergedLoraTransport`), each tensor cast on the GPU
only when the broadcast reaches it.

Weight sync never hangs and never stops the run: the join at start and each push are
bounded by ``timeout_s`` (``generation.vllm.nccl_timeout_s``), the resume that follows a
push by ``resume_timeout_s``. A join or push that fails or times out is logged and its
version goes through the file store alone (a *fallback*, counted in
`NCCLTransport.fallbacks`, the trainer's ``weight_fallbacks`` heartbeat key and
``sluice_batch_weight_fallbacks_total``); generators then reload it from disk, since the
servers' label is still the old version.

NEEDS CUDA GPUs AND NCCL. Untested end to end: it cannot run on CPU machines (vLLM CPU's
worker builds the engine, but ``/init_weight_transfer_engine`` fails without an
accelerator). Only the HTTP orchestration is tested, against fake servers and vLLM's own
route handlers, with the NCCL join and broadcast replaced.

Servers need ``VLLM_SERVER_DEV_MODE=1`` (the RL and ``/reset_prefix_cache`` routes are
only registered in dev mode) and ``--weight-transfer-config '{"backend": "nccl"}'``.

Reviewed in vllm 0.32 (site-packages/vllm/):
- entrypoints/rl/online/api_router.py: ``/pause`` (``mode``, ``clear_cache`` are QUERY
  parameters), ``/resume``, ``/get_world_size`` (TP*PP*DP of a server),
  ``/init_weight_transfer_engine {"init_info"}``, ``/start_weight_update``,
  ``/update_weights {"update_info"}``, ``/finish_weight_update {"weight_version": str}``
  (it also sets the version: ``AsyncLLM.finish_weight_update``),
  ``/shutdown_weight_transfer_engine``; entrypoints/serve/dev/cache/api_router.py:
  ``/reset_prefix_cache`` → ``{"success": bool}``.
- distributed/weight_transfer/nccl_common.py: ``NCCLWeightTransferInitInfo`` (keyword
  fields), ``worker_init_process_group`` (worker rank = rank_offset + dp_index*TP*PP +
  rank), ``trainer_init(dict, rank=0)`` (versions without ``rank`` take the dict alone:
  `trainer_init_kwargs` passes ``rank`` only where the signature has it); nccl_engine.py:
  ``NCCLWeightTransferUpdateInfo`` (``dtype_names`` read with ``getattr(torch, name)``,
  so "bfloat16", not "torch.bfloat16"), ``NCCLTrainerWeightTransferEngine`` (single
  server only: it hard-codes rank_offset=1, hence this module); packed_tensor.py:
  ``packed_nccl_broadcast_producer``.
- v1/engine/core.py ``pause_scheduler``: ``mode=keep`` with ``clear_cache=true`` (the
  route default) PREEMPTS frozen requests and resets the prefix cache (their KV is
  recomputed under the new weights on resume), contrary to the route docstring.

Ordering invariants (every step on every server concurrently):
1. init: every server's ``/init_weight_transfer_engine`` and the trainer's rank-0 join
   run at the same time (all block in one NCCL rendezvous). Server i owns ranks
   ``1 + sum(sizes[:i]) ...``; world = 1 + sum(sizes).
2. push: pause → start_weight_update → (``/update_weights`` on all servers ∥ broadcast)
   → finish_weight_update(version) → reset_prefix_cache; resume always, in ``finally``.
   update_info is planned from names, shapes and dtypes (`planned_update_info`), and
   every tensor the broadcast sends is checked against it (`as_announced`), so names,
   order, dtypes and shapes agree (the packed receiver cuts chunks from update_info).
3. A failed or cut-short transfer leaves the group unusable (peers stay blocked in
   NCCL); the sync is marked broken and further pushes refuse until re-created. A step
   that times out (join, push) marks it broken too, whatever phase it was in, so no
   later version waits out the timeout again.
4. Servers are never left wedged: when a join or push fails once the servers were in it
   (their workers may be blocked in NCCL for good: no timeout, no abort from outside,
   and ``/health`` still answers), every server is asked to exit (``POST /sluice/exit``,
   which the key guard `sluice.vllm_launch` loads into each keyed server answers:
   `workers.engines.vllm_guard`) instead of resumed; whatever started it starts it again
   (`sluice up` restarts the servers it launched; Kubernetes restarts the container), and
   it comes back with the newest version from the store. A server that cannot be asked
   (no guard) is named in the log, to restart by hand.
5. Bounded: `init` returns or raises within ``timeout_s``; `push` within ``timeout_s``
   plus ``resume_timeout_s``. A blocking NCCL call that never returns is left in its
   daemon thread (it cannot be interrupted), never awaited past the bound.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp

from pipeline.vllm_auth import auth_headers, vllm_api_key
from pipeline.weights.nccl_binding import (
    Binding,
    Weights,
    as_announced,
    check_binding,
    local_binding,
    trainer_init_kwargs,
    update_info,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger("sluice.nccl")
T = TypeVar("T")
Pairs = list[tuple[str, "torch.Tensor"]]
# vllm packed_tensor.DEFAULT_PACKED_*; sent to the servers, so both sides always agree.
PACKED_BUFFER_SIZE_BYTES = 1 << 30
PACKED_NUM_BUFFERS = 2
NCCL_TIMEOUT_S = 300.0  # the default of generation.vllm.nccl_timeout_s
RESUME_TIMEOUT_S = 30.0  # at most; never more than the sync's timeout_s
EXIT_PATH = "/sluice/exit"  # workers.engines.vllm_guard.EXIT_PATH (stdlib-only over there)


class WeightSyncError(RuntimeError):
    """A server refused or did not answer a weight-sync call (``status`` None: no answer)."""

    def __init__(self, server: str, path: str, status: int | None, body: str) -> None:
        super().__init__(f"{server}{path}: HTTP {status if status is not None else '-'}: "
                         f"{body[:500]}")
        self.server, self.path, self.status, self.body = server, path, status, body


def _in_daemon_thread(fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
    """Run blocking NCCL work off the loop. A daemon thread (not ``to_thread``): a peer
    that never arrives wedges it forever, and that must not block interpreter exit."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(value: Any, exc: BaseException | None) -> None:
        if not fut.done():
            fut.set_exception(exc) if exc is not None else fut.set_result(value)

    def run() -> None:
        try:
            value, exc = fn(*args), None
        except BaseException as e:
            value, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, value, exc)
        except RuntimeError:  # loop already closed: nobody is waiting
            pass

    threading.Thread(target=run, name="sluice-nccl", daemon=True).start()
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "unretrieved"
    return fut


class NCCLWeightSync:
    """Pushes full weights from this process (NCCL rank 0) to every vLLM server's workers.

    ``workers_per_server`` None: each server's size is read from ``GET /get_world_size``.
    ``join(rendezvous) -> group`` and ``broadcast(pairs)`` default to vLLM's trainer
    helpers, found by ``binding()`` (default `local_binding`), which `init` checks
    against every server's ``GET /version`` before asking any server to join
    (`check_binding`: a refusal raises `NCCLBindingError` and no server blocks); tests
    replace ``join``/``broadcast``, and then no binding is checked unless given.
    ``clear_cache`` is passed to ``/pause`` (see module doc).
    ``timeout_s`` bounds `init` and each `push` as a whole (its HTTP calls, the join, the
    broadcast); ``resume_timeout_s`` (None: min(30 s, ``timeout_s``)) each ``/resume``.
    """

    def __init__(self, servers: Sequence[str], master_address: str, master_port: int, *,
                 workers_per_server: int | None = None,
                 session: aiohttp.ClientSession | None = None,
                 timeout_s: float = NCCL_TIMEOUT_S,
                 resume_timeout_s: float | None = None, clear_cache: bool = True,
                 packed_buffer_size_bytes: int = PACKED_BUFFER_SIZE_BYTES,
                 packed_num_buffers: int = PACKED_NUM_BUFFERS,
                 join: Callable[[dict[str, Any]], Any] | None = None,
                 broadcast: Callable[[Pairs], None] | None = None,
                 device: int | None = None, api_key: str | None = None,
                 binding: Callable[[], Binding] | None = None) -> None:
        if not servers:
            raise ValueError("NCCLWeightSync needs at least one server")
        self.servers = [s.rstrip("/") for s in servers]
        self.master_address, self.master_port = master_address, master_port
        self.workers_per_server = workers_per_server
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.resume_timeout_s = (min(RESUME_TIMEOUT_S, timeout_s) if resume_timeout_s is None
                                 else resume_timeout_s)
        # no bound per call: `_bounded` bounds the whole step a call belongs to, so a
        # timeout always marks the sync broken (a per-call one would race it)
        self.timeout = aiohttp.ClientTimeout(total=None)
        self.resume_timeout = aiohttp.ClientTimeout(total=self.resume_timeout_s)
        self.clear_cache = clear_cache
        self.buffer_bytes, self.num_buffers = packed_buffer_size_bytes, packed_num_buffers
        self._join = join or self._vllm_join
        self._broadcast = broadcast or self._vllm_broadcast
        self._binding = binding or (local_binding if join is None else None)
        self.bound: Binding | None = None  # what `init` checked and joins with
        self._session, self._own_session = session, session is None
        # the servers' key on every call (vllm_auth); None: $VLLM_API_KEY
        self.headers = auth_headers(vllm_api_key() if api_key is None else api_key)
        self.device = device  # CUDA index for the NCCL threads; None: current at init()
        self.group: Any = None
        self.world_size = 0
        self.broken: str | None = None
        self.last_cache_reset: dict[str, bool] = {}
        self.in_collective = False  # the servers were asked into a join or a transfer
        self.exited: list[str] = []  # servers asked to exit after one was cut short

    # ------------------------------------------------------------------ HTTP
    async def _call(self, url: str, method: str, path: str, body: dict[str, Any] | None = None,
                    params: dict[str, str] | None = None,
                    timeout: aiohttp.ClientTimeout | None = None) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            async with self._session.request(method, url + path, json=body, params=params,
                                             headers=self.headers,
                                             timeout=timeout or self.timeout) as r:
                text = await r.text()
                if r.status >= 400:
                    raise WeightSyncError(url, path, r.status, text)
                return await r.json(content_type=None) if text.strip() else None
        except (aiohttp.ClientError, TimeoutError) as e:
            raise WeightSyncError(url, path, None, repr(e)) from e

    async def _all(self, path: str, bodies: Sequence[dict[str, Any] | None] | None = None,
                   params: dict[str, str] | None = None, method: str = "POST") -> list[Any]:
        """One call per server, concurrently; the first failure cancels the rest and raises
        (fail fast: peers of a failed NCCL call would otherwise wait out the timeout)."""
        tasks = [asyncio.ensure_future(self._call(u, method, path, bodies[i] if bodies else None,
                                                  params)) for i, u in enumerate(self.servers)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in tasks:
                if t.done() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            return [t.result() for t in tasks]
        finally:
            for t in tasks:
                t.cancel()  # no-op for finished ones; also runs when we are cancelled

    async def _with_nccl(self, work: asyncio.Future[T], http: Callable[[], Any]) -> T:
        """Await ``http()`` and the NCCL thread ``work`` together; the first error wins."""
        calls = asyncio.ensure_future(http())
        try:
            done, _ = await asyncio.wait({work, calls}, return_when=asyncio.FIRST_EXCEPTION)
        except BaseException:  # cancelled mid-transfer: peers may be stuck in NCCL
            calls.cancel()
            work.cancel()  # stops nobody waiting on it; the thread itself runs on
            self.broken = "NCCL transfer cancelled"
            raise
        for f in (calls, work):
            if f in done and f.exception() is not None:
                calls.cancel()
                self.broken = f"NCCL transfer failed: {f.exception()!r}"
                raise f.exception()  # type: ignore[misc]
        await calls
        return await work

    async def _bounded(self, what: str, step: Awaitable[T]) -> T:
        """``step`` within ``timeout_s``, else `TimeoutError` and the sync marked broken
        (a peer may be blocked in NCCL, or a server in an unknown state). A
        `TimeoutError` the step raises itself, earlier, passes through as it is."""
        t0 = time.monotonic()
        try:
            return await asyncio.wait_for(step, self.timeout_s)
        except TimeoutError:
            if time.monotonic() - t0 < self.timeout_s:
                raise
            self.broken = f"{what} timed out after {self.timeout_s:g} s"
            raise TimeoutError(f"NCCL weight sync: {self.broken}") from None

    # ------------------------------------------------------------------ API
    async def init(self) -> int:
        """Form the NCCL group (trainer = rank 0); returns its world size. Returns or
        raises within ``timeout_s``; a join cut short with the servers in it asks them
        to exit (module doc, invariant 4)."""
        try:
            return await self._bounded("joining the weight-transfer group", self._init())
        except BaseException:
            if self.in_collective:
                await self._exit_servers("the join was cut short")
            raise

    async def _init(self) -> int:
        if self._binding is not None:  # before any server is asked to join (module doc)
            bound = self._binding()
            answers = await self._all("/version", method="GET")
            check_binding(bound, {u: (a or {}).get("version") if isinstance(a, dict) else None
                                  for u, a in zip(self.servers, answers, strict=True)})
            self.bound = bound
        if self.workers_per_server is not None:
            sizes = [self.workers_per_server] * len(self.servers)
        else:
            sizes = [int(r["world_size"]) for r in await self._all("/get_world_size",
                                                                   method="GET")]
        self.world_size = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        rdv = {"master_address": self.master_address, "master_port": self.master_port,
               "world_size": self.world_size}
        bodies = [{"init_info": {**rdv, "rank_offset": off, "packed": True,
                                 "packed_buffer_size_bytes": self.buffer_bytes,
                                 "packed_num_buffers": self.num_buffers}} for off in offsets]
        if self.device is None:
            import torch
            self.device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.in_collective = True
        self.group = await self._with_nccl(_in_daemon_thread(self._join, rdv),
                                           lambda: self._all("/init_weight_transfer_engine",
                                                             bodies))
        self.in_collective = False
        self.broken = None
        return self.world_size

    async def push(self, weights: Weights, version: int,
                   info: dict[str, list[Any]] | None = None) -> float:
        """Send ``weights`` (HF checkpoint names) as ``version``; returns seconds paused.
        With ``info`` (`planned_update_info`), ``weights`` is consumed one tensor at a
        time as it is broadcast (each checked against ``info``: `as_announced`), never
        held all at once; without it, it is listed first and ``info`` taken from it.
        Returns or raises within ``timeout_s`` + ``resume_timeout_s``."""
        if self.broken:
            raise RuntimeError(f"weight sync unusable ({self.broken}); re-create servers/group")
        if self.group is None:
            raise RuntimeError("NCCLWeightSync.push before init()")
        pairs: Iterable[tuple[str, torch.Tensor]]
        if info is None:
            pairs = list(weights.items() if isinstance(weights, Mapping) else weights)
            info = update_info(pairs)
        else:
            pairs = as_announced(weights.items() if isinstance(weights, Mapping) else weights,
                                 info)
        t0, failed = time.perf_counter(), False
        try:
            await self._bounded(f"pushing v{version}", self._push(pairs, info, version))
        except BaseException:
            failed = True
            raise
        finally:
            if failed and self.in_collective:  # workers may be stuck in NCCL for good
                await self._exit_servers(f"the push of v{version} was cut short")
            else:
                await self._resume_all(raise_errors=not failed)
        return time.perf_counter() - t0

    async def _push(self, pairs: Iterable[tuple[str, torch.Tensor]], info: dict[str, list[Any]],
                    version: int) -> None:
        await self._all("/pause", params={"mode": "keep",
                                          "clear_cache": str(self.clear_cache).lower()})
        await self._all("/start_weight_update")
        self.in_collective = True
        await self._with_nccl(_in_daemon_thread(self._broadcast, pairs),
                              lambda: self._all("/update_weights", [{"update_info": info}]
                                                * len(self.servers)))
        self.in_collective = False
        await self._all("/finish_weight_update",
                        [{"weight_version": str(version)}] * len(self.servers))
        resets = await self._all("/reset_prefix_cache")
        self.last_cache_reset = {u: bool((r or {}).get("success")) for u, r in
                                 zip(self.servers, resets, strict=True)}
        if not all(self.last_cache_reset.values()):
            log.warning("prefix cache not reset (blocks held by frozen requests): %s",
                        self.last_cache_reset)

    async def _resume_all(self, raise_errors: bool) -> None:
        """Resume every server, even after an error. A failed resume is raised only when
        no other error is on its way out (it must never hide the original one)."""
        out = await asyncio.gather(*(self._call(u, "POST", "/resume",
                                                timeout=self.resume_timeout)
                                     for u in self.servers), return_exceptions=True)
        errors = [e for e in out if isinstance(e, BaseException)]
        for e in errors:
            log.error("resume failed: %s", e)
        if errors and raise_errors:
            raise errors[0]

    async def _exit_servers(self, why: str) -> None:
        """Ask every server to exit (module doc, invariant 4); never raises. The sync
        stays broken: the rest of the run's versions go through the file store."""
        self.broken = self.broken or why
        log.error("%s: the servers' workers may be blocked in NCCL for good; asking %s to "
                  "exit (whatever started them starts them again)", why, self.servers)
        out = await asyncio.gather(*(self._call(u, "POST", EXIT_PATH,
                                                timeout=self.resume_timeout)
                                     for u in self.servers), return_exceptions=True)
        for url, r in zip(self.servers, out, strict=True):
            if isinstance(r, BaseException):
                log.error("%s could not be asked to exit (%s): restart it by hand, it "
                          "will not generate again", url, r)
            else:
                self.exited.append(url)
        self.in_collective = False

    async def close(self) -> None:
        """Drop the trainer's communicator and a session this object created."""
        if self.group is not None and hasattr(self.group, "destroy"):
            self.group.destroy()
        self.group = None
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------ vLLM helpers
    def _vllm_join(self, rendezvous: dict[str, Any]) -> Any:
        import torch

        assert self.bound is not None and self.bound.trainer_init is not None  # `_init`
        trainer_init = self.bound.trainer_init
        if self.device is not None:  # a new thread starts on device 0
            torch.cuda.set_device(self.device)
        args, kwargs = trainer_init_kwargs(trainer_init, rendezvous)
        group = trainer_init(*args, **kwargs)
        if getattr(group, "disabled", False):  # no libnccl / VLLM_DISABLE_PYNCCL: broadcast
            raise RuntimeError("vLLM's PyNcclCommunicator is disabled")  # would be a no-op
        return group

    def _vllm_broadcast(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        import torch

        assert self.bound is not None and self.bound.broadcast_producer is not None
        packed_nccl_broadcast_producer = self.bound.broadcast_producer
        dev = torch.device("cuda", self.device)
        if self.device is not None:
            torch.cuda.set_device(self.device)
        # The producer packs (and here casts: `serving_items`) on its own side streams,
        # which do not wait for the default stream: the step's optimizer kernels queued
        # there may still be writing the parameters it reads. Every stream of the device
        # drained first.
        torch.cuda.synchronize(dev)
        packed_nccl_broadcast_producer(iterator=iter(pairs), group=self.group, src=0,
                                       post_iter_func=lambda item: item[1].detach().to(dev),
                                       buffer_size_bytes=self.buffer_bytes,
                                       num_buffers=self.num_buffers)
        torch.cuda.current_stream().synchronize()
