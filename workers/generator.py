"""Generator role: admit prompts, sample groups, append them to ``rollouts``.

Loop: claim up to ``batch_groups`` admission slots from the gate in one script call
(Lua over ``state``), which also returns ``state.version``; apply that version if it is
newer than the engine's (the newest announcement, through the same `Generator.apply` as
the watcher) before decoding, so a batch admitted right after a publish never decodes on
the old weights; map each cursor to ``(epoch, prompt_index)`` by a per-epoch seeded
shuffle; decode all their completions in one batch; append one `RolloutGroup` per prompt,
all of a batch's appends in one pipelined round trip. A watcher coroutine follows
``control`` and queues each strictly newer, hash-verified weight version on the engine
(verified and read in worker threads: `pipeline.weights`), which swaps it in between
decode steps, so each token's version is exact.

Invariant: once admitted, a group is appended exactly once or retired ``dead``. Each
admitted cursor is leased to this generator (``generation.lease_s``, renewed while it
works); on a clean stop the current batches are finished and written; if the generator
dies, its leases expire and another (or the restarted) generator takes the cursors over
and generates them. Appending is conditional on holding the lease (one Lua script), so a
group is never appended twice, even by a generator that was only slow. A group is appended
only if its encoded bytes decode with the codec and limits its scorer uses
(`pipeline.runtime.limits`); one that does not (a NaN logprob, a token id outside the
vocabulary) is retired ``dead`` instead (`Generator.abandon`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np

from pipeline.attention import attention_for, check_attention
from pipeline.bus import control
from pipeline.bus.client import Bus, worker_id
from pipeline.bus.codec import DecodeError, decode, encode
from pipeline.bus.ledger import Ledger
from pipeline.bus.schema import RolloutGroup, RunFinished, WeightsPublished
from pipeline.bus.transient import transient
from pipeline.config import Config
from pipeline.devices import resolve_device
from pipeline.metrics import start as start_metrics
from pipeline.model import load_policy, load_tokenizer
from pipeline.runtime import Heartbeat, connect, join, limits, set_threads
from pipeline.weights import WeightError, check_store, engine_format, make_transport
from workers.engines.base import Engine, EngineError, SamplingParams
from workers.engines.transformers import TransformersEngine
from workers.environments.base import EpisodeFailure
from workers.episodes import Episode, RolloutContext, TurnBatcher, check_episodes
from workers.hooks import load_filter, load_rollout, render_group_prompt, tool_stats
from workers.prompt_filter import PromptFilter
from workers.rollout_loop import load_loop
from workers.staleness import WeightsBehind
from workers.tasks.catalog import Task, prompt_for_cursor, task_from_config
from workers.tasks.prompts import Messages

log = logging.getLogger("sluice.generator")
T = TypeVar("T")
STOP_GRACE_S = 10.0  # on SIGTERM, how long admitted batches may wait for a usable server


def make_engine(cfg: Config, tokenizer: object, seed: int) -> Engine:
    """The configured engine. The vLLM engine needs no model in this process (the
    servers hold it): only the tokenizer, for prompts and completion text."""
    if cfg.generation.engine == "vllm":
        from workers.engines.vllm import VLLMEngine

        return VLLMEngine.from_config(cfg, seed=seed)
    model, _ = load_policy(cfg, device=resolve_device(cfg.generation.device,
                                                      "generation.device"))
    return TransformersEngine(model, tokenizer, seed=seed, version=0,  # type: ignore[arg-type]
                              frozen_prefixes=cfg.model.frozen_prefixes)


class Generator:
    def __init__(self, cfg: Config, name: str | None = None):
        self.cfg = cfg
        self.wid = worker_id("generator", name)
        self.metrics = start_metrics(cfg.metrics, "generator", self.wid)  # before the model
        self.tokenizer = load_tokenizer(cfg.model.path, cfg.model.revision)
        self.task = task_from_config(cfg, self.tokenizer)
        # distinct, reproducible sampling streams per generator name
        seed = (cfg.run.seed * 1_000_003 + zlib.crc32(self.wid.encode())) % 2**31
        self.engine: Engine = make_engine(cfg, self.tokenizer, seed)
        self.weights = make_transport(cfg)  # engine side: receive (verify) versions
        self.params = SamplingParams.of(cfg.generation)
        self.rollout = load_rollout(cfg, self.tokenizer)  # None: single completions
        self.filter = PromptFilter(cfg, len(self.task))
        self.limits = limits(cfg)  # the scorer's decode limits: same function, same config
        self.batcher = TurnBatcher(self.engine)  # episodes in flight share engine batches
        self.skipped_prompts = 0
        self.groups = 0
        self.completions = 0
        self.tokens = 0
        self.dead_groups = 0
        self.gate_wait_s = 0.0
        self.gate_closed = False
        self.rejected_weights = 0
        self.taken_over = 0
        self.lost_leases = 0
        self._swap_lock = asyncio.Lock()
        self.announced = asyncio.Event()  # set by the control watcher on each new version
        self.behind = WeightsBehind(cfg.trainer.max_staleness)  # admits only while current
        self.lease_ms = int(cfg.generation.lease_s * 1000)
        # expired leases are looked for every lease/4 (and at the first admission), not on
        # every poll of the gate: the scan reads the whole leases hash (O(window)) on the
        # Redis thread, and a lease only expires lease_s after its holder's last renewal
        self.takeover_every_s = cfg.generation.lease_s / 4
        self._next_takeover = 0.0  # time.monotonic() of the next scan
        self.leases: set[int] = set()  # cursors this process holds and still has to emit
        self.ledger = Ledger.for_role(cfg.output_path, "generator", self.wid.split("/", 1)[1],
                                      cfg.run.ledger)

    def info(self) -> dict[str, object]:
        engine = self.engine.health()
        return {"version": self.engine.version, "groups": self.groups,
                "completions": self.completions, "tokens": self.tokens,
                "dead_groups": self.dead_groups, "skipped_prompts": self.skipped_prompts,
                "gate_wait_s": round(self.gate_wait_s, 3), "gate_closed": self.gate_closed,
                "rejected_weights": self.rejected_weights, "taken_over": self.taken_over,
                "lost_leases": self.lost_leases, "leases": len(self.leases), "engine": engine,
                "waiting_for_weights": self.behind.waiting, "weights_behind": self.behind.behind(
                    self.engine.version),
                "weights_wait_s": round(self.behind.wait_s, 3),
                **({"tools": tools} if (tools := tool_stats(self.rollout)) is not None else {}),
                **({"healthy": False} if not engine.get("healthy", True) else {})}

    async def apply(self, msg: WeightsPublished) -> None:
        """Swap in a strictly newer version; refuse bad weights and keep serving.

        Swaps are serialised (watcher and catch-up may both see a version). A version the
        engine could not load (a file that matches its sha256 but is not loadable, tensors
        that do not fit the model, no server taking it) is refused like one that fails
        verification: counted in ``rejected_weights``, logged, and the engine keeps the
        weights it has; the next announcement (or catch-up) tries again. Verifying
        (hashing every shard) and reading run off the event loop, so heartbeats, lease
        renewals and decoding go on during a big load."""
        async with self._swap_lock:
            if msg.version <= self.engine.version:
                return
            t0 = time.perf_counter()
            try:
                path = await self.weights.receive(msg)
            except (WeightError, OSError, ValueError) as e:
                self.rejected_weights += 1
                log.warning("refusing weights v%d: %s", msg.version, e)
                return
            try:
                await self.engine.load_weights(path, msg.version, engine_format(msg))
            except EngineError as e:
                self.rejected_weights += 1
                log.warning("engine could not load weights v%d: %s", msg.version, e)
                return
            self.metrics.observe("perf_weight_apply_seconds", time.perf_counter() - t0)

    async def watch_control(self, bus, stop: asyncio.Event) -> None:
        async for msg in control.watch(bus, from_id="0", stop=stop,
                                       block_ms=self.cfg.bus.block_ms):
            if isinstance(msg, WeightsPublished):
                self.behind.saw(msg.version)
                self.announced.set()  # the gate opens as the trainer retires its step
                await self.apply(msg)
            elif isinstance(msg, RunFinished):
                log.info("run finished (%s); stopping", msg.reason)
                stop.set()

    async def admit_batch(self, bus: Bus, stop: asyncio.Event) -> tuple[list[int], int]:
        """Up to batch_groups cursors: first expired leases of dead generators (looked for
        at most every ``takeover_every_s``: `takeover_due`), then new admissions (one
        script call for all of them), and ``state.version`` as that call saw it; waits
        while the gate is closed and nothing expired. The admit call has one op id per
        attempt at a batch, so a retry after a lost reply gets the same cursors.

        The gate opens when the trainer retires a step's groups, right after it announces
        the step's weights: a closed gate is polled again 5 ms after an announcement
        reaches the control watcher, and with a backoff up to 0.2 s otherwise (a blind
        0.2 s backoff left generators asleep for whole trainer steps)."""
        window, want = self.cfg.trainer.window, self.cfg.generation.batch_groups
        wait_s = 0.005
        asked = time.monotonic()
        while not stop.is_set():
            self.announced.clear()
            cursors: list[int] = []
            if self.takeover_due():
                cursors = await bus.retrying(
                    lambda: bus.takeover(self.wid, self.lease_ms, want), "take over", stop)
                if len(cursors) >= want:  # a full batch: more may have expired, look again
                    self._next_takeover = 0.0
            for c in cursors:
                self.leases.add(c)
                self.taken_over += 1
                self.ledger.write("takeover", self.group_id(c), cursor=c)
            op, more = f"admit:{self.wid}:{uuid.uuid4().hex}", want - len(cursors)
            got = await bus.retrying(lambda op=op, more=more: bus.admit_many(
                window, self.wid, self.lease_ms, more, op=op), "admit", stop)
            for c in got.cursors:
                self.leases.add(c)
                self.ledger.write("admitted", self.group_id(c), cursor=c,
                                  gate_wait_s=round(time.monotonic() - asked, 4))
            cursors += got.cursors
            if cursors:
                self.gate_closed = False
                self.metrics.wait("admission", time.monotonic() - asked)
                return cursors, got.version
            self.gate_closed = True
            t0 = time.monotonic()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.announced.wait(), wait_s)
            self.gate_wait_s += time.monotonic() - t0
            wait_s = 0.005 if self.announced.is_set() else min(wait_s * 1.5, 0.2)
        return [], 0

    def takeover_due(self) -> bool:
        """Whether this poll of the gate scans for expired leases; the next scan is then
        ``takeover_every_s`` away. A dead generator's group is thus taken over at most
        lease_s + lease_s/4 after its last renewal (the gate itself is polled far more
        often: one cheap ADMIT per group)."""
        now = time.monotonic()
        if now < self._next_takeover:
            return False
        self._next_takeover = now + self.takeover_every_s
        return True

    def group_id(self, cursor: int) -> str:
        epoch, idx = prompt_for_cursor(cursor, len(self.task), self.cfg.run.seed)
        return f"{epoch}:{idx}"

    async def renew_leases(self, bus: Bus, done: asyncio.Event) -> None:
        """Keep this process's leases alive every lease/3 until ``done``; a lease found
        taken over (we missed renewals, e.g. Redis was unreachable longer than a lease)
        is dropped here, and its group's append will be refused."""
        while not done.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), self.lease_ms / 3000)
            held = sorted(self.leases)
            if not held:
                continue
            try:
                lost = await bus.renew(self.wid, held, self.lease_ms)
            except Exception as e:  # Redis away: renew at the next tick
                if not transient(e):
                    raise
                log.debug("lease renewal failed: %s", e)
                continue
            for c in lost:
                log.warning("lease of cursor %d was taken over by another generator", c)

    async def catch_up(self, bus: Bus, version: int) -> None:
        """Before decoding a batch admitted at ``version`` (``state.version`` in the admit
        reply): if the engine is older, apply the newest announcement now (`apply`, as the
        watcher would, serialised with it) rather than waiting for the watcher to be
        scheduled. `pipeline.bus.control.announce` writes the announcement before moving
        ``state.version``, so it is there to read."""
        if version > self.engine.version:
            msg = await control.latest(bus)
            if msg is not None:
                await self.apply(msg)

    async def _generate(self, prompts: list[dict[str, Any]], prompt_ids: list[list[int]],
                        convs: list[Messages | None]) -> list[list[Episode] | str]:
        """Rollouts per prompt, or the reason a prompt's group failed for good.

        Single completions: an engine with independent requests (vLLM: one request per
        prompt, retried on other servers) fails per group; the in-process engine decodes
        the batch as one. Episodes (an environment or a rollout hook): per group, its
        failure (an `EpisodeFailure`, an engine error, a hook that raised or returned
        something else than its episodes) is that group's alone."""
        n = self.cfg.generation.num_generations
        if self.rollout is not None:
            return list(await asyncio.gather(*(self._episodes(p, ids, conv)
                                               for p, ids, conv in zip(prompts, prompt_ids,
                                                                       convs, strict=True))))
        if not getattr(self.engine, "independent_prompts", False):
            out = await self.engine.generate(prompt_ids, n, self.params)
            return [[Episode.of(c) for c in g] for g in out]

        async def one(p: list[int]) -> list[Episode] | str:
            try:
                return [Episode.of(c) for c in
                        (await self.engine.generate([p], n, self.params))[0]]
            except EngineError as e:
                return str(e)

        return list(await asyncio.gather(*(one(p) for p in prompt_ids)))

    async def _episodes(self, prompt: dict[str, Any], ids: list[int],
                        conv: Messages | None) -> list[Episode] | str:
        assert self.rollout is not None
        n = self.cfg.generation.num_generations
        ctx = RolloutContext(prompt, ids, n, self.params, self.tokenizer, self.batcher,
                             self.engine.version, conversation=conv)
        what = "the environment" if self.cfg.environment.enabled else "generation.rollout"
        try:
            return check_episodes(await self.rollout(dict(prompt), ctx), n, what)
        except EpisodeFailure as e:
            return f"environment: {e}"
        except EngineError as e:
            return str(e)
        except Exception as e:  # a user hook failed: its group dies, the run goes on
            return f"{what}: {e!r}"

    async def skip_prompts(self, bus: Bus, cursors: list[int]) -> list[int]:
        """Cursors whose prompt the prompt filter keeps (`workers.prompt_filter`); the
        others retire ``filtered`` now. `FilterRejectedEpoch` once the skips complete an
        epoch the filter rejected whole (the kept cursors' leases then expire)."""
        if not self.filter.active:
            return cursors
        where = [(c, *prompt_for_cursor(c, len(self.task), self.cfg.run.seed)) for c in cursors]
        wanted = await self.filter.keep(bus, [(e, i, self.task.prompt(i)) for _c, e, i in where])
        skipped: set[int] = set()
        for (c, epoch, _i), ok in zip(where, wanted, strict=True):
            if ok:
                continue
            op, skipped = f"skip:{c}:{self.wid}", skipped | {epoch}
            if await self.settle(bus, c, op, {"ev": "filtered", "retired": True},
                                 lambda c=c, op=op, e=epoch: bus.skip(c, owner=self.wid,
                                                                      op=op, epoch=e)):
                self.skipped_prompts += 1
        await self.filter.check_epochs(bus, skipped)
        return [c for (c, _e, _i), ok in zip(where, wanted, strict=True) if ok]

    async def generate_batch(self, bus: Bus, cursors: list[int]) -> None:
        """Generate and append one group per cursor. A group is appended whole or, if
        its generation failed for good, retired `dead` with the reason: never half."""
        cursors = await self.skip_prompts(bus, cursors)
        if not cursors:
            return
        t_admit = time.time()
        metas, prompt_ids, convs = [], [], []
        for c in cursors:
            epoch, idx = prompt_for_cursor(c, len(self.task), self.cfg.run.seed)
            prompt = self.task.prompt(idx)
            metas.append((c, epoch, idx, prompt))
            ids, conv = render_group_prompt(self.cfg, self.tokenizer, prompt["text"])
            prompt_ids.append(ids)
            convs.append(conv)
        with self.metrics.timed("perf_generate_seconds"):
            results = await self._generate([m[3] for m in metas], prompt_ids, convs)
        t_done = time.time()
        emits: list[tuple[int, bytes, str, int, list[Episode]]] = []
        for (c, epoch, idx, prompt), pids, comps in zip(metas, prompt_ids, results, strict=True):
            group_id = f"{epoch}:{idx}"
            if isinstance(comps, str):
                await self.abandon(bus, c, group_id, f"generation failed: {comps}")
                continue
            group = RolloutGroup(
                group_id=group_id, prompt_index=idx, epoch=epoch, prompt=prompt,
                prompt_ids=np.asarray(pids, dtype=np.int32), generator=self.wid,
                t_admit=t_admit, t_done=t_done,
                rollouts=[x.to_rollout(self.tokenizer) for x in comps])
            payload = encode(group)
            try:  # what the scorer will decode, exactly: the same bytes, codec and limits
                decode(payload, self.limits, expect=RolloutGroup)
            except DecodeError as e:
                await self.abandon(bus, c, group_id, f"invalid group: {e}")
                continue
            emits.append((c, payload, f"emit:{c}:{self.wid}", group.min_version, comps))
        if not emits:
            return
        # one pipelined round trip for the batch, retried on connection loss (each EMIT is
        # idempotent per op): an admitted group must reach the stream
        ids = await self.settle_many(
            bus, [(c, op, {"ev": "emitted", "version": int(v)}) for c, _p, op, v, _ in emits],
            lambda: bus.emit_many([(c, p, op) for c, p, op, _v, _ in emits], self.wid))
        for (*_, comps), entry_id in zip(emits, ids, strict=True):
            if entry_id:
                self.groups += 1
                self.completions += len(comps)
                self.tokens += sum(int(x.mask.sum()) for x in comps)

    async def abandon(self, bus: Bus, cursor: int, group_id: str, reason: str) -> None:
        """Retire the leased group ``cursor`` ``dead`` with a dlq record naming ``reason``
        (the lease-checked ABANDON script): its generation failed for good, or it came out
        as something its consumer would reject. WHY not append the latter: an entry that
        does not decode is dead-lettered without retiring the group it names (that name is
        not believed, `pipeline.bus.inbound`), so the group would hold a slot of the
        window for good; only its producer can retire it."""
        log.warning("group %s retired dead: %s", group_id, reason)
        op = f"abandon:{cursor}:{self.wid}"
        self.dead_groups += await self.settle(
            bus, cursor, op, {"ev": "dead", "retired": True},
            lambda: bus.abandon(group_id, cursor=cursor, owner=self.wid, reason=reason,
                                role=self.wid, op=op))

    async def settle(self, bus: Bus, cursor: int, op: str, event: dict[str, object],
                     call: Callable[[], Awaitable[T]]) -> T:
        """Append or abandon the leased group ``cursor`` (``call``, retried until Redis
        answers), recording it in the ledger; a falsy result means another generator had
        taken the lease over, and our copy is dropped."""
        async def one() -> list[T]:
            return [await call()]
        return (await self.settle_many(bus, [(cursor, op, event)], one))[0]

    async def settle_many(self, bus: Bus, items: list[tuple[int, str, dict[str, object]]],
                          call: Callable[[], Awaitable[list[T]]]) -> list[T]:
        """`settle` of several leased groups ``(cursor, op, event)`` by one ``call`` (a
        pipelined batch, retried as a whole until Redis answers: each script in it is
        idempotent per op) that returns one result per item, in order."""
        planned = [(op, [{**event, "gid": self.group_id(c), "cursor": c}])
                   for c, op, event in items]
        results = await self.ledger.settle_many(
            planned, lambda: bus.retrying(call, f"{items[0][2]['ev']} group"))
        for (cursor, _op, _ev), result in zip(items, results, strict=True):
            self.leases.discard(cursor)
            if not result:
                gid = self.group_id(cursor)
                self.lost_leases += 1
                log.warning("group %s was taken over by another generator; dropping ours", gid)
                self.ledger.write("lost_lease", gid, cursor=cursor)
        return results

    async def produce(self, bus: Bus, stop: asyncio.Event) -> None:
        """One admit -> generate -> append loop; `run` keeps ``concurrent_batches`` of them.
        Nothing is admitted while the engine is more than ``max_staleness`` versions behind
        the run (`workers.staleness`): all it would decode is retired stale."""
        if self.behind.run_version is None:  # before the first admission, not after it
            raw = await bus.retrying(lambda: bus.r.hget(bus.keys.state, "version"),
                                     "version", stop)  # the global one: lanes mirror it
            self.behind.saw(int(raw or 0))
        while not stop.is_set():
            await self.behind.wait_current(
                lambda: self.engine.version,
                lambda: bus.retrying(lambda: self.catch_up(bus, self.behind.run_version or 0),
                                     "catch up", stop),
                self.announced, stop)
            if stop.is_set():
                break
            cursors, version = await self.admit_batch(bus, stop)
            self.behind.saw(version)
            if cursors:  # the gate opened on a new version: decode on it, not the last one
                await bus.retrying(lambda v=version: self.catch_up(bus, v), "catch up", stop)
                await self.generate_batch(bus, cursors)

    async def run(self, stop: asyncio.Event) -> None:
        await self.engine.start()
        bus = connect(self.cfg)
        hb = Heartbeat(bus, self.wid, self.cfg.bus.heartbeat_s, self.info, self.metrics)
        hb.start()
        watcher = asyncio.create_task(self.watch_control(bus, stop))
        producing_done = asyncio.Event()
        renewer = asyncio.create_task(self.renew_leases(bus, producing_done))
        log.info("generator %s started (engine %s)", self.wid, self.cfg.generation.engine)
        try:
            producers = asyncio.gather(*(self.produce(bus, stop)
                                         for _ in range(self.cfg.generation.concurrent_batches)))
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait([producers, stopping], return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            # stopping: admitted batches finish; after a grace period, requests that are
            # still waiting for a usable server give up (their groups retire dead)
            done, _ = await asyncio.wait([producers], timeout=STOP_GRACE_S)
            if not done and hasattr(self.engine, "stop_waiting"):
                log.warning("stopping: giving up on requests still waiting for a server")
                self.engine.stop_waiting()
            await producers
        except asyncio.CancelledError:
            pass
        finally:
            stop.set()
            producing_done.set()
            await join(renewer, 5)
            await join(watcher, self.cfg.bus.block_ms / 1000 + 5)
            await hb.stop()
            self.ledger.close()
            await bus.close()
            await self.engine.close()
            await self.weights.close()  # its rebuilt deltas, if any
            log.info("generator %s stopped: %d groups", self.wid, self.groups)


def preflight(cfg: Config, policy_tokenizer: Callable[[], Any]) -> Task:
    """What a generator loads first, checked before any role starts (`sluice generate`,
    `sluice up`): the in-process engine's ``generation.device`` (and that it can run
    ``model.attn_implementation``), the task (data, columns, prompt lengths, rendered
    with ``policy_tokenizer()``: None when `sluice up` is about to build the tiny model),
    the environment or rollout hook (one instance built), the prompt filter or rollout
    loop (one set up) and the weight store it reads (`pipeline.weights.check_store`).
    Each failure is a ``ConfigError`` / ``ValueError`` naming the key. Returns the task,
    which the other roles' checks reuse."""
    if cfg.generation.engine == "transformers":
        device = resolve_device(cfg.generation.device, "generation.device")
        check_attention(attention_for(cfg, device), device.type,
                        device_key="generation.device")
    tokenizer = policy_tokenizer()
    task = task_from_config(cfg, tokenizer)
    load_rollout(cfg, tokenizer)
    load_filter(cfg)
    load_loop(cfg, "generator")
    check_store(cfg, write=False)
    return task


async def main(cfg: Config, stop: asyncio.Event, name: str | None = None) -> None:
    set_threads(cfg.generation.threads)
    await Generator(cfg, name).run(stop)
