"""What watches a run without steering its steps (`[eval]`, `[metrics]`, `[archive]`):
the evaluator, each role's Prometheus endpoint, and the archiver of scored groups (whose
backlog cap is the one thing here the trainer waits on)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pipeline.config.base import _Section
from pipeline.config.scoring import RewardSpec


class EvalConfig(_Section):
    rewards: list[RewardSpec] | None = None
    """Reward functions (TRL signature) and weights of the held-out evaluation; unset =
    ``scoring.rewards``."""
    pass_threshold: float = 1.0
    """A held-out completion *passes* when its weighted total eval reward is at least this
    (pass@1, sampled_pass@k); 1.0 with the built-in tasks' copy_reward = exact answer."""
    num_samples: int = Field(0, ge=0, le=1024)
    """Sampled completions per held-out prompt (at generation.temperature, top_k, top_p) for
    ``sampled_pass@k``; 0 = greedy decoding only."""
    pass_at: list[int] = Field(default_factory=lambda: [1, 8])
    """The k of the reported ``sampled_pass@k`` (those <= num_samples)."""
    every_s: float = Field(20.0, gt=0)
    """The evaluator evaluates the newest announced version at most this often (and the
    initial and final weights always)."""
    engine: Literal["auto", "transformers", "vllm"] = "auto"
    """Where held-out prompts are decoded: `transformers` in the evaluator's process;
    `vllm` on vLLM servers of the evaluator's own (`vllm_urls`, or one more server `sluice
    up` launches beside the generators'): an evaluated version is swapped into them, so
    they are never the generators' servers. `auto` = `vllm` when the run generates with
    vLLM and such servers exist (named, or launched), else `transformers`."""
    vllm_urls: list[str] = Field(default_factory=list)
    """Base URLs of the vLLM servers the evaluator uses with engine `vllm` (empty: `sluice
    up` launches one when generation.vllm.launch > 0)."""

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        if any(k < 1 for k in self.pass_at):
            raise ValueError("pass_at: every k must be >= 1")
        return self


class MetricsConfig(_Section):
    port: int = Field(0, ge=0, le=65535)
    """TCP port of this role's Prometheus ``/metrics`` (docs/running.md: Metrics); 0 = not
    served. One process per port: a port in use fails the role at start. `sluice up` gives
    each role its own free port instead (up.metrics)."""
    host: str = Field("127.0.0.1", pattern=r"^[A-Za-z0-9_.:-]{1,253}$")
    """Address ``/metrics`` listens on: loopback by default. ``0.0.0.0`` exposes it to the
    network, where anyone who can reach the port reads it (no authentication)."""


class ArchiveConfig(_Section):
    enabled: bool = False
    """Keep every scored group: `sluice archive` (started by `sluice up`) is one more
    consumer group (`archivers`) on `scored` and writes each group to Parquet files
    (docs/archive.md), which `sluice replay` trains on again and `sluice trace` reads.
    False: no archiver and no consumer group (nothing costs anything)."""
    path: str = ""
    """Where the archive is written: a folder, or an fsspec URL (``s3://bucket/prefix``;
    the filesystem's package, e.g. s3fs, must be installed; credentials from its usual
    environment, never from this file); empty = ``<output_dir>/archive``."""
    file_mb: float = Field(64.0, gt=0, le=4096)
    """A Parquet file is written once the groups read for it reach this many MB (their
    message size); its groups stay pending on the archiver until it is written."""
    file_s: float = Field(60.0, gt=0, le=86400)
    """A Parquet file is also written at least this often (seconds), so the groups of a
    quiet run reach the archive too."""
    max_backlog: int = Field(20_000, ge=2)
    """The cap on `scored` entries not yet archived (the archiver's lag + pending), which
    the janitor keeps. At the cap the trainer stops taking steps until the archive catches
    up: nothing is lost, the admission gate closes behind it, and Redis holds at most
    this many groups more than without an archive. The archiver writes a file once it
    holds half of it."""
