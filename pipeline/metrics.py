"""Prometheus ``/metrics`` of a role process (docs/design.md §11): one registry, one HTTP server.

Each role process owns one `RoleMetrics`: its own `CollectorRegistry` (not the global one,
so tests that run several roles in one process never collide), served by
prometheus-client's HTTP server on ``metrics.host:metrics.port`` (loopback by default;
port 0 = not served). A port that cannot be bound fails the role at start with
`MetricsPortError`, which names ``metrics.port`` and the port. Under `sluice up` every role
gets its own free port (``up.metrics``) and publishes its URL in its heartbeat, so
`sluice status` lists them. Roles bind first thing in their constructor, before loading a
model; the trainer once it knows its rank (only rank 0 of a torchrun job serves).

Names are ``sluice_<stage>_<what>`` (`SPECS`), the stage as in docs/design.md §11: ``rollout_``
(generators; the evaluator's engine version too), ``sample_`` (scorers), ``batch_``
(trainer), ``eval_`` (evaluator), ``perf_`` (durations), ``bus_`` (streams, consumer
groups, the gate, leases, the Redis connection), ``archive_`` (the archiver). Every
series carries ``role`` and ``worker`` (the worker id's name: stable under `sluice up`),
plus ``stream``, ``group``, ``outcome``, ``reason`` or ``metric`` where a spec says so:
never a group or prompt id, so cardinality stays small. prometheus-client's process
collector adds ``process_*`` (CPU, memory).

Where the numbers come from:

- counters mirror the role's heartbeat counters (`RoleMetrics.sync`, called by
  `pipeline.runtime.Heartbeat` on every beat, ``bus.heartbeat_s``): one source of truth
  with `sluice status`; a scrape sees them at most one heartbeat old; so do the scorer's
  per-period means (reward, the teacher's reverse KL), from cumulative sums and counts;
- histograms and per-step gauges are observed where the event happens (a trainer step, a
  weight publish, a weight apply);
- bus gauges are read from Redis on every beat, only while serving, by the roles that
  consume the stream (`RoleMetrics.refresh`): each scorer reports ``rollouts``/``scorers``,
  the trainer ``scored``/``trainers``, the ``dlq`` length and the ``state`` counters (gate
  occupancy, retired by reason). Several scorers report the same stream: aggregate with
  ``max``. dlq count = ``sluice_bus_stream_length{stream="dlq"}``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import re
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)

from pipeline.bus.client import Bus
from pipeline.bus.keys import RETIRE_REASONS
from pipeline.config import ConfigError, MetricsConfig
from pipeline.tracking import TRL_PREFIXES

log = logging.getLogger("sluice.metrics")
PREFIX = "sluice_"
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
VERSIONS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)
WAIT_WINDOW = 2048  # waits per hop kept for the heartbeat's p50 / p99


class MetricsPortError(ConfigError):
    """``/metrics`` cannot be served on the configured address (port in use, bad host)."""


@dataclass(frozen=True)
class Spec:
    """One metric family: ``name`` without the prefix (and, for counters, without
    ``_total``, which prometheus-client appends); ``labels`` beyond role and worker."""

    kind: type[Counter] | type[Gauge] | type[Histogram]
    name: str
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = SECONDS


SPECS: tuple[Spec, ...] = (
    # rollout_: generators
    Spec(Counter, "rollout_groups", "Groups appended to rollouts"),
    Spec(Counter, "rollout_completions", "Completions appended to rollouts"),
    Spec(Counter, "rollout_tokens", "Completion tokens appended to rollouts"),
    Spec(Counter, "rollout_dead_groups", "Admitted groups whose generation failed for good"),
    Spec(Counter, "rollout_taken_over", "Expired leases of other generators taken over"),
    Spec(Counter, "rollout_lost_leases", "Own groups dropped: their lease was taken over"),
    Spec(Counter, "rollout_rejected_weights", "Announced weight versions refused"),
    Spec(Counter, "rollout_gate_wait_seconds", "Time spent waiting on a closed gate"),
    Spec(Gauge, "rollout_gate_closed", "1 while the generator waits on a closed gate"),
    Spec(Gauge, "rollout_waiting_for_weights",
         "1 while the generator, over max_staleness behind, waits for newer weights"),
    Spec(Gauge, "rollout_policy_version", "Weight version the engine samples from"),
    # sample_: scorers
    Spec(Counter, "sample_groups", "Groups settled by the scorer", ("outcome",)),
    Spec(Counter, "sample_completions", "Completions rewarded"),
    Spec(Counter, "sample_reward_errors", "Reward calls that failed for a group"),
    Spec(Counter, "sample_reward_restarts", "Reward processes killed (a call outlived "
         "scoring.reward_timeout_s) or lost, each replaced"),
    Spec(Counter, "sample_reclaimed", "Entries reclaimed from idle consumers (XAUTOCLAIM)"),
    Spec(Gauge, "sample_reward", "Mean total reward of the completions rewarded in the "
         "last heartbeat period"),
    Spec(Counter, "sample_teacher_errors", "Teacher calls that failed for a group"),
    Spec(Gauge, "sample_teacher_kl", "On-policy distillation: mean per-token reverse KL "
         "(behaviour - teacher logprob, mask-1 tokens) of the tokens scored in the last "
         "heartbeat period"),
    # batch_: trainer (rank 0)
    Spec(Counter, "batch_steps", "Optimizer steps taken by this process"),
    Spec(Counter, "batch_tokens", "Tokens trained (forwarded)"),
    Spec(Counter, "batch_groups", "Groups read off scored and settled", ("outcome",)),
    Spec(Counter, "batch_skipped_steps", "Steps skipped: loss or gradient not finite"),
    Spec(Counter, "batch_failed_steps", "Steps that raised"),
    Spec(Counter, "batch_weight_fallbacks", "Weight versions published through the file "
         "store alone: their NCCL push failed or timed out, or the group was unusable"),
    Spec(Gauge, "batch_step", "Optimizer step of the run"),
    Spec(Gauge, "batch_version", "Newest weight version published"),
    Spec(Gauge, "batch_loss", "Loss of the last step"),
    Spec(Gauge, "batch_grad_norm", "Pre-clip gradient norm of the last step"),
    Spec(Gauge, "batch_reward", "Mean reward of the last step's samples"),
    Spec(Gauge, "batch_reward_std", "Reward standard deviation of the last step's samples"),
    Spec(Gauge, "batch_learning_rate", "Learning rate of the last step"),
    Spec(Gauge, "batch_entropy", "Mean token entropy of the last step"),
    Spec(Gauge, "batch_figure", "The last step's TRL-named figures (perf/mfu_fwd_bwd, "
         "perf/fwd_bwd_s, batch/*, sample/*, sampling/*; docs/metrics.md), by name",
         ("metric",)),
    Spec(Counter, "batch_tool_calls", "Tool calls the generators ran, summed over the "
         "trainer's steps (each step's tools/<name>/calls): rate() gives calls per second",
         ("tool",)),
    Spec(Counter, "batch_tool_failures", "Failed tool calls, summed over the trainer's "
         "steps (each step's tools/<name>/failures)", ("tool",)),
    Spec(Histogram, "batch_staleness", "Versions between the weights a group was trained "
         "on and its oldest token, per trained group", buckets=VERSIONS),
    # eval_: evaluator
    Spec(Counter, "eval_evaluations", "Held-out evaluations done"),
    Spec(Counter, "eval_reward_errors", "Held-out evaluations skipped: a reward call failed"),
    Spec(Counter, "eval_reward_restarts", "The evaluator's reward processes killed (a call "
         "outlived scoring.reward_timeout_s) or lost, each replaced"),
    Spec(Gauge, "eval_result", "Figures of the last held-out evaluation", ("metric",)),
    # perf_: durations
    Spec(Histogram, "perf_step_seconds", "Trainer: a step from its groups buffered to "
         "recorded (train, publish, retire)"),
    Spec(Histogram, "perf_rollout_wait_seconds", "Trainer: waiting for a step's groups"),
    Spec(Histogram, "perf_weight_publish_seconds", "Trainer: publish and announce a version"),
    Spec(Histogram, "perf_weight_apply_seconds", "Generator, evaluator: verify and load an "
         "announced version into the engine"),
    Spec(Histogram, "perf_generate_seconds", "Generator: decode one batch of groups"),
    Spec(Histogram, "perf_queue_wait_seconds", "Time an entry waited in a stream before its "
         "consumer read it, from its id's time (the Redis clock at the append) to the read: "
         "rollouts -> scorer, scored -> trainer, scored -> archiver (role)", ("stream",)),
    Spec(Histogram, "perf_admission_wait_seconds", "Generator: from asking the gate for a "
         "batch to being admitted (the wait at a closed gate)"),
    # archive_: the archiver (archive.enabled)
    Spec(Counter, "archive_groups", "Groups written to the archive"),
    Spec(Counter, "archive_files", "Archive files written"),
    Spec(Counter, "archive_skipped", "Entries of scored not archived: undecodable (acked)"),
    Spec(Gauge, "archive_buffered", "Groups read and not yet in a written file (pending on "
         "the archiver)"),
    Spec(Gauge, "batch_archive_paused", "Trainer: 1 while it waits for the archive (its "
         "backlog reached archive.max_backlog)"),
    # bus_: streams, groups, gate, leases, connection
    Spec(Gauge, "bus_stream_length", "Entries in a stream (XLEN)", ("stream",)),
    Spec(Gauge, "bus_group_lag", "Entries never delivered to the group", ("stream", "group")),
    Spec(Gauge, "bus_group_pending", "Entries delivered to the group, not acknowledged",
         ("stream", "group")),
    Spec(Gauge, "bus_gate_in_flight", "Admitted groups not yet retired (cursor - retired)"),
    Spec(Gauge, "bus_gate_window", "Admission window (in flight at most)"),
    Spec(Gauge, "bus_admitted", "Groups ever admitted (state cursor)"),
    Spec(Gauge, "bus_retired", "Groups ever retired (state counters)", ("reason",)),
    Spec(Gauge, "bus_leases_held", "Admission leases this generator holds"),
    Spec(Counter, "bus_reconnects", "Times Redis became reachable again after an outage"),
    Spec(Gauge, "bus_healthy", "1 while Redis answers this role"),
)

KINDS = {s.name: s.kind for s in SPECS}

SYNCED: dict[str, dict[str, tuple[str, dict[str, str]]]] = {
    "generator": {"groups": ("rollout_groups", {}), "completions": ("rollout_completions", {}),
                  "tokens": ("rollout_tokens", {}), "dead_groups": ("rollout_dead_groups", {}),
                  "taken_over": ("rollout_taken_over", {}),
                  "lost_leases": ("rollout_lost_leases", {}),
                  "rejected_weights": ("rollout_rejected_weights", {}),
                  "gate_wait_s": ("rollout_gate_wait_seconds", {}),
                  "gate_closed": ("rollout_gate_closed", {}),
                  "waiting_for_weights": ("rollout_waiting_for_weights", {}),
                  "version": ("rollout_policy_version", {}), "leases": ("bus_leases_held", {})},
    "scorer": {"scored": ("sample_groups", {"outcome": "scored"}),
               "filtered": ("sample_groups", {"outcome": "filtered"}),
               "dead": ("sample_groups", {"outcome": "dead"}),
               "reward_n": ("sample_completions", {}),
               "reward_errors": ("sample_reward_errors", {}),
               "reward_restarts": ("sample_reward_restarts", {}),
               "teacher_errors": ("sample_teacher_errors", {}),
               "reclaimed": ("sample_reclaimed", {})},
    "trainer": {"trained_groups": ("batch_groups", {"outcome": "trained"}),
                "stale": ("batch_groups", {"outcome": "stale"}),
                "duplicates": ("batch_groups", {"outcome": "duplicate"}),
                "dead": ("batch_groups", {"outcome": "dead"}),
                "skipped_steps": ("batch_skipped_steps", {}),
                "failed_steps": ("batch_failed_steps", {}),
                "weight_fallbacks": ("batch_weight_fallbacks", {}),
                "step": ("batch_step", {}), "version": ("batch_version", {}),
                "archive_paused": ("batch_archive_paused", {})},
    "archiver": {"archived": ("archive_groups", {}), "files": ("archive_files", {}),
                 "skipped": ("archive_skipped", {}), "buffered": ("archive_buffered", {})},
    "evaluator": {"version": ("rollout_policy_version", {}),
                  "reward_errors": ("eval_reward_errors", {}),
                  "reward_restarts": ("eval_reward_restarts", {})},
}
"""Heartbeat key of each role → the metric (and labels) that mirrors it: a counter grows
by the key's increase since the previous beat (role counters start at 0 in each process),
a gauge takes its value. ``healthy`` and ``reconnects`` are mirrored for every role."""

EVENT_COUNTERS = {"trainer": ("batch_steps", "batch_tokens"), "evaluator": ("eval_evaluations",)}
"""Counters a role increments where the event happens (not from its heartbeat)."""

STEP_GAUGES = {"loss": "batch_loss", "grad_norm": "batch_grad_norm", "reward": "batch_reward",
               "reward_std": "batch_reward_std", "lr": "batch_learning_rate",
               "entropy": "batch_entropy"}
"""Trainer step row (metrics.jsonl) key → the gauge that shows its last value."""
FIGURE_PREFIXES = TRL_PREFIXES
"""Trainer step row keys shown on ``batch_figure{metric=<key>}`` (TRL's names)."""
TOOL_COUNT = re.compile(r"tools/(.+)/(calls|failures)")
"""Step row keys summed into ``batch_tool_calls`` / ``batch_tool_failures`` by tool: a
step's own count is a delta since the previous step, mostly 0 between two heartbeats,
so its gauge (``batch_figure``) is seldom caught non-zero by a scrape; the sum is."""


def build(registry: CollectorRegistry) -> dict[str, Any]:
    """Every family of `SPECS` registered on ``registry``, by short name."""
    out: dict[str, Any] = {}
    for s in SPECS:
        labels = ("role", "worker", *s.labels)
        kw: dict[str, Any] = {"buckets": s.buckets} if s.kind is Histogram else {}
        out[s.name] = s.kind(PREFIX + s.name, s.doc, labels, registry=registry, **kw)
    return out


def exposed_names(registry: CollectorRegistry | None = None) -> set[str]:
    """Every sample name ``/metrics`` can show (``_total``, ``_bucket``… included): what a
    dashboard may query. Default: a fresh role registry with the process collector."""
    if registry is None:
        registry = RoleMetrics("any", "any").registry
    suffixes = {"counter": ("_total", "_created"), "gauge": ("",),
                "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("_sum", "_count", "_created"), "info": ("_info",)}
    names: set[str] = set()
    for family in registry.collect():
        names.update(family.name + x for x in suffixes.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
    return names


class RoleMetrics:
    """The metrics of one role process, every series bound to its role and worker.

    ``groups`` (stream, group), ``lengths`` (streams) and ``window`` (> 0: read ``state``
    for the gate and retirements) say what `refresh` reads from Redis; nothing is read
    unless the endpoint is served."""

    def __init__(self, role: str, worker: str, *, groups: Sequence[tuple[str, str]] = (),
                 lengths: Sequence[str] = (), window: int = 0):
        self.role, self.worker = role, worker.split("/", 1)[-1]
        self.groups, self.lengths, self.window = tuple(groups), tuple(lengths), window
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.families = build(self.registry)
        self.url: str | None = None
        self._server: Any = None
        self._last: dict[str, float] = {}
        self._waits: dict[str, collections.deque[float]] = {}
        # this role's counters exist (at 0) from the start, so a rate over the first
        # scrapes is right and a scrape before the first beat shows what the role counts
        for name, labels in [*SYNCED.get(role, {}).values(), ("bus_reconnects", {}),
                             *((n, {}) for n in EVENT_COUNTERS.get(role, ()))]:
            if KINDS[name] is Counter:
                self.child(name, **labels)

    def child(self, name: str, **labels: str) -> Any:
        return self.families[name].labels(role=self.role, worker=self.worker, **labels)

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        if amount > 0:
            self.child(name, **labels).inc(amount)

    def set(self, name: str, value: float, **labels: str) -> None:
        self.child(name, **labels).set(value)

    def observe(self, name: str, value: float) -> None:
        self.child(name).observe(value)

    def wait(self, hop: str, seconds: float) -> None:
        """A wait at one hop of a group's life: ``admission`` (a generator's wait for the
        gate) or the stream an entry waited in (``rollouts``, ``scored``). Observed in its
        histogram and kept in a window of the last `WAIT_WINDOW` for `wait_summary`."""
        seconds = max(0.0, float(seconds))
        if hop == "admission":
            self.child("perf_admission_wait_seconds").observe(seconds)
        else:
            self.child("perf_queue_wait_seconds", stream=hop).observe(seconds)
        self._waits.setdefault(hop, collections.deque(maxlen=WAIT_WINDOW)).append(seconds)

    def wait_summary(self) -> dict[str, dict[str, float]]:
        """p50 / p99 (seconds) and count of each hop's last `WAIT_WINDOW` waits: what the
        heartbeat carries for `sluice status`."""
        out = {}
        for hop, xs in self._waits.items():
            if xs:
                p50, p99 = np.percentile(np.fromiter(xs, float, len(xs)), [50, 99])
                out[hop] = {"p50": round(float(p50), 4), "p99": round(float(p99), 4),
                            "n": len(xs)}
        return out

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Observe the wall time of the ``with`` body in the histogram ``name`` (also when
        it raises: a failed batch took that long too)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.observe(name, time.perf_counter() - t0)

    # ------------------------------------------------------------ serving

    def serve(self, cfg: MetricsConfig) -> int | None:
        """Serve ``/metrics`` on ``cfg.host:cfg.port`` in a daemon thread; returns the port
        (None: port 0, not served). `MetricsPortError` if it cannot be bound."""
        if cfg.port == 0:
            return None
        try:
            server, _thread = start_http_server(cfg.port, addr=cfg.host,
                                                registry=self.registry)
        except OSError as e:
            raise MetricsPortError(
                f"metrics.port: cannot serve /metrics on {cfg.host}:{cfg.port}: "
                f"{e.strerror or e} (another process on port {cfg.port}? give each role "
                "its own metrics.port, or 0 to serve none)") from None
        self._server = server
        port = int(server.server_port)
        host = socket.gethostname() if cfg.host in ("0.0.0.0", "::") else cfg.host
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"
        log.info("%s metrics on %s", self.role, self.url)
        return port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ------------------------------------------------------------ updates

    def sync(self, info: Mapping[str, Any]) -> None:
        """Mirror a heartbeat's counters (`SYNCED`): counters grow by their increase since
        the previous beat, gauges take the value; the scorer's mean reward of the period
        comes from its cumulative ``reward_sum`` / ``reward_n``."""
        for key, (name, labels) in {**SYNCED.get(self.role, {}),
                                    "reconnects": ("bus_reconnects", {}),
                                    "healthy": ("bus_healthy", {})}.items():
            value = info.get(key)
            if not isinstance(value, int | float):  # bool is an int: healthy, gate_closed
                continue
            if KINDS[name] is Counter:
                self.inc(name, float(value) - self._last.get(key, 0.0), **labels)
                self._last[key] = max(float(value), self._last.get(key, 0.0))
            else:
                self.set(name, float(value), **labels)
        if self.role == "scorer":
            self._period_mean(info, "reward_sum", "reward_n", "sample_reward")
            self._period_mean(info, "teacher_kl_sum", "teacher_tokens", "sample_teacher_kl")

    def _period_mean(self, info: Mapping[str, Any], sum_key: str, n_key: str,
                     gauge: str) -> None:
        """Set ``gauge`` to the mean over the last heartbeat period of a cumulative sum
        and count of the heartbeat (unchanged when nothing was added)."""
        n, total = info.get(n_key), info.get(sum_key)
        if not (isinstance(n, int) and isinstance(total, int | float)):
            return
        dn = n - self._last.get(f"_{n_key}", 0)
        if dn > 0:
            self.set(gauge, (total - self._last.get(f"_{sum_key}", 0.0)) / dn)
            self._last[f"_{n_key}"], self._last[f"_{sum_key}"] = n, float(total)

    def step(self, row: Mapping[str, Any], staleness: Sequence[int]) -> None:
        """A trainer step as recorded in metrics.jsonl (``row``) and the staleness of each
        group it trained."""
        self.inc("batch_steps")
        self.inc("batch_tokens", float(row.get("tokens", 0) or 0))
        self.set("batch_step", float(row["step"]))
        self.set("batch_version", float(row["version"]))
        for key, name in STEP_GAUGES.items():
            v = row.get(key)
            if isinstance(v, int | float) and math.isfinite(v):
                self.set(name, float(v))
        for key, v in row.items():
            if key.startswith(FIGURE_PREFIXES) and isinstance(v, int | float) \
                    and math.isfinite(v):
                self.set("batch_figure", float(v), metric=key)
        for key, v in row.items():  # the per-step deltas, summed: what a scrape sees
            tool = TOOL_COUNT.fullmatch(key)  # whichever step it lands between
            if tool and isinstance(v, int | float) and math.isfinite(v) and v >= 0:
                self.child(f"batch_tool_{tool[2]}", tool=tool[1]).inc(float(v))  # 0: shown
        for s in staleness:
            self.observe("batch_staleness", s)
        self.observe("perf_step_seconds", float(row["step_time_s"]))
        self.observe("perf_rollout_wait_seconds", float(row["rollout_wait_s"]))

    def evaluated(self, result: Mapping[str, Any]) -> None:
        """One held-out evaluation: its figures (reward, pass@1, rewards/…)."""
        self.inc("eval_evaluations")
        for key, v in result.items():
            if isinstance(v, int | float) and key not in ("t", "ts", "n", "step", "version"):
                self.set("eval_result", float(v), metric=key)

    async def refresh(self, bus: Bus) -> None:
        """Read the bus gauges this role reports (class docstring) from Redis; only while
        served. A failed read (Redis down, a refused command) leaves the last values."""
        if self._server is None or not (self.groups or self.lengths or self.window):
            return
        try:
            lengths, views = await bus.stream_stats(self.lengths, self.groups)
            state = await bus.state() if self.window else {}
        except Exception as e:
            log.debug("metrics refresh failed: %s", e)
            return
        for stream, n in lengths.items():
            if n is not None:
                self.set("bus_stream_length", n, stream=stream)
        for (stream, group), v in views.items():
            if v.lag is not None:
                self.set("bus_group_lag", v.lag, stream=stream, group=group)
            self.set("bus_group_pending", v.pending, stream=stream, group=group)
        if self.window:
            self.set("bus_gate_in_flight", state.get("cursor", 0) - state.get("retired", 0))
            self.set("bus_gate_window", self.window)
            self.set("bus_admitted", state.get("cursor", 0))
            for reason in RETIRE_REASONS:
                self.set("bus_retired", state.get(f"retired:{reason}", 0), reason=reason)


def start(cfg: MetricsConfig, role: str, worker: str, *, serve: bool = True,
          **refresh: Any) -> RoleMetrics:
    """A role's metrics, served now when ``serve`` and ``cfg.port`` ask for it (call it
    first in the role's constructor: a port in use then fails the role before it loads
    anything)."""
    m = RoleMetrics(role, worker, **refresh)
    if serve:
        m.serve(cfg)
    return m
