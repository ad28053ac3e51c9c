"""The one config type: a run described by one TOML file, read by every role.

Every field has bounds and a docstring; unknown keys are errors, so a typo fails at
start with the dotted key named instead of being silently ignored. ``--set a.b=c``
overrides are parsed as TOML values (``--set trainer.lr=3e-4``, ``--set run.name='"x"'``
or simply ``--set run.name=x``: a value that is not valid TOML is taken as a string).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from pipeline.bus.keys import RUN_NAME_PATTERN
from pipeline.evaluation import metric_names, parse_target

DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"
"""Device names a role accepts (`pipeline.devices.resolve_device`)."""


class ConfigError(ValueError):
    """A config file, key or value is wrong; the message names the key."""


OPTIONAL_IMPORT_PATH = r"^$|^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"


class _Section(BaseModel):
    """Every section: unknown keys are errors, and no float anywhere may be ``inf``,
    ``-inf`` or ``nan`` (TOML spells all three, and ``gt=0`` lets ``inf`` through: an
    infinite timeout or learning rate is never meant). A field that needs "no limit" uses
    0, documented on the field."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True,
                              use_attribute_docstrings=True, allow_inf_nan=False)


class RunConfig(_Section):
    name: str = Field("run", pattern=RUN_NAME_PATTERN)
    """Run namespace: every Redis key is ``sluice:{name}:…``. Letters, digits, ``_``,
    ``.``, ``-``, not starting with ``.`` or ``-`` (it also names files and folders)."""
    output_dir: str = "runs/run"
    """Checkpoints, weights, metrics, logs and the embedded Redis live here."""
    seed: int = Field(0, ge=0)
    """Seeds the prompt order, model init and sampling."""
    max_time_s: float = Field(0.0, ge=0)
    """`sluice up` stops the run after this many seconds (0 = no limit)."""
    ledger: bool = True
    """Every role appends its delivery events to ``output_dir/ledger/*.jsonl`` (about
    1 KB per group in all) so `sluice audit` can check the run's whole history."""
    report_to: list[Literal["trackio", "wandb", "tensorboard", "mlflow"]] = Field(
        default_factory=list)
    """Experiment trackers that get the trainer's metrics (TRL's names), the evaluator's
    `eval/…` results and the config (`pip install 'sluice[trackio]'` etc.; README: Track
    your run). Empty = metrics.jsonl and eval.jsonl only."""
    tracking_project: str = Field("sluice", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    """Tracker project (wandb project, mlflow experiment); the tracker runs are `run.name`
    (trainer) and `run.name`-eval (evaluator), grouped by `run.name`."""


class BusConfig(_Section):
    redis_url: str = ""
    """redis://, rediss:// or unix:// URL; empty = `sluice up` embeds a Redis on a unix
    socket in output_dir and every role started by it uses that."""
    credentials_file: str = ""
    """TOML file of per-role Redis users and passwords, as `sluice acl` writes it (refused
    if group/world readable); empty = ``SLUICE_REDIS_CREDENTIALS_FILE``, else credentials
    from the environment (docs/security.md). Never put a password in redis_url."""
    cluster: bool = False
    """redis_url names one node of a Redis Cluster: the client discovers the others and
    routes each key to its master (redis-py's RedisCluster). Every key of a lane shares
    one hash tag, so each Lua script and MULTI touches one slot (docs/design.md §3)."""
    partitions: int = Field(1, ge=1, le=64)
    """Lanes of the bus: rollouts, scored, dlq, admission counters and leases split into
    this many self-contained partitions, each under its own hash tag, so a Redis Cluster
    spreads them over its masters (set it to the number of masters). Fixed for the life
    of a run: a resumed run with another value is refused. Each lane gets an equal share
    of the admission window, so it must not exceed trainer.window."""
    tls_ca_file: str = ""
    """rediss:// only: PEM CA bundle the server's certificate must chain to (empty = the
    system's CAs); the hostname is always checked."""
    tls_cert_file: str = ""
    """rediss:// only: PEM client certificate, for servers with ``tls-auth-clients yes``."""
    tls_key_file: str = ""
    """rediss:// only: PEM private key of tls_cert_file (empty = inside tls_cert_file)."""
    block_ms: int = Field(1000, ge=10, le=60_000)
    """How long a blocking stream read waits before the loop checks for shutdown."""
    claim_idle_ms: int = Field(30_000, ge=100)
    """An entry pending this long on a dead consumer is reclaimed (XAUTOCLAIM)."""
    max_deliveries: int = Field(5, ge=1, le=100)
    """An entry delivered more often than this goes to the dead-letter stream."""
    max_message_bytes: int = Field(16 * 2**20, ge=1024)
    """Entries larger than this are rejected on decode (dead-lettered)."""
    heartbeat_s: float = Field(2.0, gt=0, le=60)
    """Each worker refreshes its heartbeat this often."""
    reconnect_max_s: float = Field(10.0, gt=0, le=300)
    """Ceiling of the exponential reconnect backoff."""
    control_maxlen: int = Field(1000, ge=10)
    """Approximate length cap of the control stream (announcements only)."""
    keep_acked_s: float = Field(60.0, ge=0, le=86400)
    """Acknowledged entries of ``rollouts`` and ``scored`` younger than this (by their
    stream id's time) are kept for `sluice tail`; older ones that every consumer group has
    acknowledged are trimmed by id, without reading payloads (never a pending or
    undelivered entry). A window in time, not a count: an id window needs no entry read."""

    @model_validator(mode="after")
    def _check_security(self) -> BusConfig:
        from pipeline.bus.security import TLSFiles, check_bus_url

        check_bus_url(self.redis_url, TLSFiles(self.tls_ca_file, self.tls_cert_file,
                                               self.tls_key_file))
        if self.cluster and not self.redis_url.startswith(("redis://", "rediss://")):
            raise ValueError("bus.cluster = true needs bus.redis_url = redis:// or rediss:// "
                             "naming one node of the cluster (an embedded Redis is not a "
                             f"cluster); got {self.redis_url!r}")
        return self


class LoraConfig(_Section):
    rank: int = Field(8, ge=1, le=256)
    """LoRA rank r (vLLM servers need ``--max-lora-rank`` at least this)."""
    alpha: float = Field(16.0, gt=0)
    """LoRA scaling numerator (scale = alpha / rank)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the LoRA input during training (0 keeps trainer and engine identical)."""
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj",
                                 "gate_proj", "up_proj", "down_proj"], min_length=1)
    """Module names that get adapters (peft's target_modules)."""


class ModelConfig(_Section):
    path: str = "runs/models/tiny-char"
    """A local model folder (HF format) or a hub id ``org/name``, fetched through the
    Hugging Face cache (HF_HOME, HF_HUB_OFFLINE honoured). A path that exists, is absolute
    or starts with ./ is a folder. Resolved once per run and pinned in
    output_dir/run.json: every role and resume loads that snapshot."""
    revision: str = Field("main", pattern=r"^[A-Za-z0-9_./-]+$", max_length=256)
    """Branch, tag or commit of a hub id (ignored for a folder); the commit it points to
    when the run starts is pinned, so a moved branch does not change a resumed run."""
    init: Literal["", "tiny-char-qwen2"] = "tiny-char-qwen2"
    """If the folder `path` does not exist yet, `sluice up` builds this model there
    ('' = never; never for a hub id)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of every role's copy of the model. The trainer keeps its parameters
    and optimizer state in float32 and computes in this dtype under autocast unless
    ``trainer.fp32_master`` is false (then parameters and AdamW state are this dtype)."""
    attn_implementation: str = Field("sdpa", pattern=r"^[\w./-]{1,128}$")
    """transformers' attention: `sdpa` (CPU and GPU; the packed layouts' masks),
    `eager`, `flash_attention_2`, or a `kernels` hub repo such as
    ``kernels-community/flash-attn2`` (CUDA; varlen packing, no prefix sharing)."""
    lora: LoraConfig | None = None
    """Set (``[model.lora]``) to train a peft LoRA adapter on the frozen base instead of all
    weights; the `lora` weight store then publishes only the adapter per version."""


class TaskConfig(_Section):
    name: Literal["copy", "reverse", "add", "guess", "jsonl", "hf", "reasoning_gym"] = "copy"
    """Built-in task (copy, reverse, add), `jsonl` (a JSONL file: `path`), `hf` (any
    dataset `datasets` loads: `dataset`) or `reasoning_gym` (`dataset` names one of
    reasoning-gym's procedural datasets, generated offline; its verifier is the reward)."""
    path: str = ""
    """Data file of the `jsonl` task (one JSON object per line, columns as `hf`'s)."""
    dataset: str = ""
    """`hf` task: a hub id (through the HF cache; offline roles need it cached), a
    `save_to_disk` folder, a data file (.jsonl/.json/.csv/.parquet/.arrow/.txt) or a
    folder of data files."""
    split: str = "train"
    """`hf` task: the training split (slices such as ``train[:1000]`` work except for
    `save_to_disk` folders)."""
    dataset_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the dataset: `datasets.load_dataset`'s for `hf` (``{name =
    "main"}`` picks a configuration, as GSM8K's), reasoning-gym's `create_dataset`'s for
    `reasoning_gym` (``{min_word_len = 3}``)."""
    eval_split: str = ""
    """Split of held-out prompts (minus duplicates and training prompts); empty = a stable
    hash split of `split` (about 5%)."""
    eval_dataset: str = ""
    """`hf`: held-out prompts from a dataset or data file of their own (same columns;
    its `eval_split`, default "train") instead of from `dataset`."""
    prompt_column: str = Field("prompt", min_length=1)
    """Column holding the prompt: a string, or a conversation ``[{role, content}, …]``
    (TRL's conversational format, rendered with the chat template)."""
    answer_column: str = ""
    """Column holding the expected answer, also passed to rewards as ``answer`` (empty =
    the column `answer` if any). Every column reaches rewards under its own name anyway."""
    rename_columns: dict[str, str] = Field(default_factory=dict)
    """`hf`: columns renamed after loading (old = new), as `Dataset.rename_columns`, e.g.
    ``{answer = "solution"}`` for a reward that reads `solution` (TRL's accuracy_reward);
    the column keys above name the new names."""
    conversational: bool = False
    """`hf`: a string prompt becomes one user message, so rewards get prompts and
    completions as message lists (TRL's conversational format, which e.g. TRL's
    accuracy_reward expects)."""
    system_prompt: str = ""
    """Prepended as a system message when a prompt is rendered with the chat template
    (not to a conversation that has one); rewards see the prompt as in the data."""
    max_prompt_tokens: int = Field(0, ge=0)
    """Data tasks: prompts longer than this many tokens once rendered are left out, the
    same in every role, and counted in the log (0 = keep all)."""
    num_prompts: int = Field(20_000, ge=1)
    """Training prompts of a procedural task (one epoch)."""
    heldout: int = Field(256, ge=1)
    """Held-out prompts for the greedy exact-match evaluation."""

    @model_validator(mode="after")
    def _check_source(self) -> TaskConfig:
        if self.name == "hf" and not self.dataset:
            raise ValueError("task.dataset: the hf task needs a dataset (hub id or path)")
        if self.name == "jsonl" and not (self.path or self.dataset):
            raise ValueError("task.path: the jsonl task needs a JSONL file")
        if self.name == "reasoning_gym" and not self.dataset:
            raise ValueError("task.dataset: the reasoning_gym task needs a reasoning-gym "
                             "dataset name, e.g. spell_backward")
        if self.name in ("copy", "reverse", "add") and (self.path or self.dataset):
            key = "task.path" if self.path else "task.dataset"
            raise ValueError(f"{key}: task {self.name!r} is procedural and reads no data")
        return self


class VLLMConfig(_Section):
    urls: list[str] = Field(default_factory=list)
    """Base URLs of running vLLM servers (``http://host:port``); `sluice up` fills this
    when `launch` > 0."""
    launch: int = Field(0, ge=0, le=64)
    """`sluice up` starts this many local vLLM servers and stops them on exit; 0 = use
    `urls`. Server i binds CPU core i on a CPU machine; on a GPU machine it gets GPU i mod
    n of the GPUs `sluice up` sees (its CUDA_VISIBLE_DEVICES list when set), with `nccl`
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
    """--kv-cache-memory-bytes of launched servers."""
    gpu_memory_utilization: float = Field(0.0, ge=0, le=1)
    """On a GPU: the fraction of each GPU's memory its launched servers use together;
    servers sharing a GPU split it equally (--gpu-memory-utilization = this / servers on
    that GPU). 0 = use kv_cache_memory_bytes, the CPU setting."""
    extra_args: list[str] = Field(default_factory=list)
    """Further command-line flags for launched servers."""
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
    not use: `sluice up` refuses a machine without enough."""
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
    Empty: every prompt is generated."""
    rollout: str = Field("", pattern=OPTIONAL_IMPORT_PATH)
    """Hook `package.module:function` that produces a group's rollouts itself (TRL's
    rollout_func): `async def f(prompt, ctx) -> list[Episode]`, where `ctx`
    (`workers.episodes.RolloutContext`) samples exact tokens, logprobs and versions from
    the engine. Empty: single-turn completions, or episodes of `[environment]`."""


class EnvironmentConfig(_Section):
    name: str = Field("", pattern=OPTIONAL_IMPORT_PATH)
    """A multi-turn environment, `package.module:Factory` (a class or function), built
    with `kwargs` once per episode; its async `reset(prompt)` / `step(action)` answer the
    model's turns (`workers.environments`). Empty: single-turn rollouts."""
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


class RewardSpec(_Section):
    fn: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """Import path ``package.module:function``."""
    weight: float = 1.0
    """Weight in the summed reward; 0 records the function's value without using it."""


class ScoringConfig(_Section):
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(fn="workers.tasks.rewards:copy_reward")]
    )
    """Reward functions (called by keyword as TRL does: prompts, completions,
    completion_ids, every column) and weights; the total is the weighted sum. Empty only
    with a `teacher` (pure distillation: every reward 0, advantages from the teacher)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """How advantages are scaled (TRL's scale_rewards); `batch` is per scorer read."""
    zero_variance: Literal["train", "filter"] = "train"
    """A group whose rewards are all equal (advantage 0 everywhere): `train` hands it on
    and it counts in its step at advantage 0, as in TRL (its tokens and rows are in the
    normaliser; at beta 0 it is not forwarded, having no gradient); `filter` retires it
    `filtered` and the trainer fills its step with other groups (fewer, slower steps
    once most groups saturate; docs/compared-with-trl.md)."""
    std_ddof: int = Field(1, ge=0, le=1)
    """Delta degrees of freedom of the reward std: 1 = unbiased (TRL), 0 = population."""
    std_eps: float = Field(1e-4, ge=0)
    """Added to the std before dividing (TRL: 1e-4)."""
    reward_timeout_s: float = Field(30.0, gt=0)
    """Per call of a reward function; one call covers every completion of one scorer read
    (on failure, one call per group), and one probes it at start. The scorer, the
    evaluator and the start-up probe run rewards in a child process, killed (and
    replaced) when a call outlives this."""
    read_count: int = Field(8, ge=1)
    """Groups a scorer reads per XREADGROUP."""
    advantages: str = Field("", pattern=OPTIONAL_IMPORT_PATH)
    """Hook `package.module:function` replacing group advantages: called per group as
    `f(rewards=[...], completion_ids=[...], mask=[...], **columns)`, it returns one
    advantage per rollout, or per token (a list per rollout). Empty: GRPO's
    (`scale_rewards`); `pipeline.rl.advantages:rloo` is RLOO."""
    teacher: str = ""
    """On-policy distillation: a teacher model (hub id or folder, same tokenizer
    vocabulary as the policy). Each sampled token's advantage becomes the group's reward
    advantage + `teacher_coef` x (teacher - behaviour logprob), per token (the teacher at
    temperature 1; docs/distillation.md). Empty: off."""
    teacher_urls: list[str] = Field(default_factory=list)
    """vLLM servers serving `teacher` (prompt logprobs; requests time out after
    generation.vllm.request_timeout_s); empty: each scorer runs the teacher itself."""
    teacher_device: str = Field("cpu", pattern=DEVICE_PATTERN)
    """Device of the in-process teacher (`auto`, `cpu`, `cuda`, `cuda:N`); it loads in
    `model.dtype`."""
    teacher_coef: float = Field(1.0, gt=0)
    """Weight of the teacher's per-token term in the advantage."""

    @model_validator(mode="after")
    def _check_rewards(self) -> ScoringConfig:
        if not self.rewards and not self.teacher:
            raise ValueError("scoring.rewards: empty, and there is no scoring.teacher: "
                             "nothing would give a completion an advantage")
        return self


class TrainerConfig(_Section):
    groups_per_step: int = Field(8, ge=1)
    """Groups (prompts) per optimizer step (after zero-variance groups are filtered, with
    scoring.zero_variance = filter)."""
    max_staleness: int = Field(1, ge=0)
    """Samples with version_now - min(token version) above this are dropped (retired
    `stale`). Also sizes the admission window: (max_staleness + 1) * groups_per_step."""
    admission_window: int = Field(0, ge=0)
    """Groups in flight allowed by the gate; 0 = (max_staleness + 1) * groups_per_step."""
    lr: float = Field(1e-4, gt=0)
    """AdamW learning rate (constant)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient norm clip."""
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo", "cispo"] = "dapo"
    """Normalisation of the GRPO loss, as TRL's loss_type (see pipeline/rl/losses.py); `cispo`
    is CISPO (MiniMax-M1): the ratio, capped at epsilon_high and detached, weights
    A·log π for every token; dapo's normaliser."""
    epsilon: float = Field(0.2, gt=0, lt=1)
    """Lower clip range of the surrogate ratio."""
    epsilon_high: float | None = Field(None, gt=0)
    """Upper clip range (DAPO's clip-higher); None = epsilon. With loss_type `cispo`:
    the absolute cap ε_max of the ratio (TRL's convention), required, > 1."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """`sequence`: GSPO (Zheng et al. 2025) — one ratio per sequence, the geometric mean
    of its token ratios, clipped as a whole (TRL's importance_sampling_level)."""
    decoupled_ppo: bool = True
    """AReaL's decoupled PPO (Fu et al. 2025): the ratio is clipped against the proximal
    policy (the trainer's weights at the step's start) and `is_mode` weights it to the
    behaviour policy. False: the ratio is taken against the behaviour (sampling) policy
    itself and no separate weight is applied (the clip then bounds the move from the
    sampler)."""
    geo_mask: tuple[float, float] | None = None
    """verl's rollout correction (rollout_rs = geometric): drop a sequence whose
    geometric-mean ratio exp(mean(log π_old - log π_behaviour)) is outside [lo, hi],
    e.g. [0.5, 2.0]. None = off."""
    is_mode: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none"
    ] = "token_truncate"
    """Importance-sampling correction between trainer and behaviour logprobs.
    `token_mask` with is_clip_min/is_clip_max = 0.5/5 is IcePop (Ling Team 2025)."""
    is_clip_min: float = Field(0.0, ge=0)
    """Lower bound of the IS ratio: *_mask modes zero ratios below it, *_truncate modes
    raise them to it (TRL's vllm_importance_sampling_clip_min; 0 = none)."""
    is_clip_max: float = Field(3.0, gt=0)
    """Truncation (or upper mask bound) of the IS ratio."""
    temperature: float | None = Field(None, gt=0)
    """Temperature of the policy being trained; None = generation.temperature (TRL's
    convention). A lower value than generation's samples from a hotter behaviour policy
    (exploration) and lets the IS correction account for the difference."""
    beta: float = Field(0.0, ge=0)
    """KL coefficient to the frozen initial model (k3 estimator); 0 = no reference."""
    kl_bias_correction: bool = True
    """Multiply the KL term by the policy ratio (TRL's use_bias_correction_kl): the
    unbiased reverse-KL gradient. Only matters when beta > 0."""
    num_iterations: int = Field(1, ge=1, le=64)
    """Optimizer passes over each batch (TRL's num_iterations, μ); old logprobs are
    computed once per batch, before the first pass."""
    weight_sync_steps: int = Field(1, ge=1)
    """Publish and announce weights every this many optimizer steps."""
    save_steps: int = Field(50, ge=1)
    """Checkpoint (weights, optimizer, step, version) every this many steps."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept on disk (oldest pruned)."""
    max_steps: int = Field(200, ge=1)
    """The trainer ends the run (RunFinished) after this many optimizer steps."""
    threads: int = Field(1, ge=1)
    """torch threads of the trainer process."""
    device: str = Field("auto", pattern=DEVICE_PATTERN)
    """`auto` (CUDA if available, else CPU), `cpu`, `cuda` or `cuda:N`. Under torchrun
    `auto`/`cuda` take ``cuda:LOCAL_RANK``. Asking for CUDA without it fails at start."""
    fp32_master: bool = True
    """Keep float32 parameters and AdamW state and compute in ``model.dtype`` under
    autocast (mixed precision). False: parameters and optimizer state in model.dtype."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (less memory, ~30% slower)."""
    micro_batch_tokens: int = Field(0, ge=0)
    """Token budget of one forward/backward (prompt + completion tokens, counted as
    forwarded: padded or packed); a step's samples are split into micro-batches under it
    and gradients accumulate. The loss normaliser stays that of the whole step. 0 = the
    whole step in one micro-batch. A sample longer than the budget forms its own."""
    packing: bool = False
    """Pack a micro-batch's samples into rows without padding (position ids restart per
    sample; attention stays within each sample: SDPA block mask on CPU, varlen
    flash-attention on CUDA when the model runs with a flash kernel)."""
    prefix_sharing: bool = False
    """With packing and an attention that takes a mask (sdpa, eager), forward a group's
    prompt once for all its completions under a dense tree mask. It saves the prompt's
    MLP and projection FLOPs but a whole group shares one row, so attention scores grow
    with the group's length squared: measured 0.94x padded (packed: 1.82x) on a small
    model with 32-128-token prompts (benchmarks/packing.py). Worth it for long prompts
    and short completions on wide models. Ignored by flash-attention."""
    logprob_chunk_tokens: int = Field(256, ge=1)
    """Completion tokens whose vocabulary logits are materialised at once (the LM head is
    applied to hidden states of completion positions only, in chunks of this many, each
    recomputed in backward): peak logit memory is O(chunk * vocab)."""
    fp32_lm_head: bool = True
    """Apply the LM head in float32 under bf16/fp16 autocast, so the logprobs the
    importance ratio compares with the sampler's are not rounded to bf16 (±0.06 at
    logits near 30). Costs a float32 matmul per chunk; no effect in float32."""
    lr_scheduler: Literal["constant", "constant_with_warmup", "linear", "cosine"] = "constant"
    """Learning-rate schedule (transformers.get_scheduler) over ``max_steps``."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps of the learning-rate schedule."""

    @model_validator(mode="after")
    def _check(self) -> TrainerConfig:
        if self.is_clip_min > self.is_clip_max:
            raise ValueError("is_clip_min must be <= is_clip_max")
        if self.warmup_steps > self.max_steps:
            raise ValueError("warmup_steps must be <= max_steps")
        if self.loss_type == "cispo" and not (self.epsilon_high and self.epsilon_high > 1):
            raise ValueError("loss_type = cispo needs epsilon_high > 1 (the ratio cap ε_max)")
        if self.geo_mask is not None and not 0 <= self.geo_mask[0] <= 1 <= self.geo_mask[1]:
            raise ValueError("geo_mask needs [lo, hi] with 0 <= lo <= 1 <= hi")
        return self

    @property
    def window(self) -> int:
        return self.admission_window or (self.max_staleness + 1) * self.groups_per_step


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


class WeightsConfig(_Section):
    store: str = ""
    """Where the trainer publishes weight versions and generators and the evaluator read
    them (docs/weights-store.md): empty = ``<output_dir>/weights``; a directory (a shared
    filesystem, NFS or Lustre, when roles run on several machines); or
    ``s3://bucket/prefix`` on an S3-compatible object store, whose credentials come from the
    standard AWS environment variables or credentials file, never from this file."""
    endpoint_url: str = Field("", pattern=r"^$|^https?://[^\s@]+$")
    """s3:// stores: the S3 endpoint, e.g. ``http://10.0.0.5:8333`` for SeaweedFS or MinIO
    (no user or password in it); empty = AWS (or the ``AWS_ENDPOINT_URL`` environment
    variable)."""
    cache_dir: str = ""
    """Local directory where generators and the evaluator keep versions downloaded from an
    s3:// store and versions rebuilt from deltas (each verified there before loading);
    empty = ``<output_dir>/weights-cache``."""
    full_every: int = Field(1, ge=1, le=100_000)
    """1 = every version is full weights. K > 1: a full version every K versions and
    between them deltas (only the elements that changed since the previous version, in
    model.dtype), which engines apply to the version they hold, checked by the full
    state's sha256. Full-weight runs only (a LoRA adapter is published whole)."""

    @field_validator("store")
    @classmethod
    def _check_store(cls, v: str) -> str:
        scheme = v.split("://", 1)[0] if "://" in v else ""
        if scheme and scheme != "s3":
            raise ValueError(f"a directory or s3://bucket/prefix, not a {scheme}:// URL")
        if scheme == "s3" and not v[len("s3://"):].split("/", 1)[0]:
            raise ValueError("s3:// needs a bucket: s3://bucket/prefix")
        return v


class UpConfig(_Section):
    scorers: int = Field(2, ge=0, le=64)
    """Scorer processes `sluice up` starts."""
    generators: int = Field(1, ge=0, le=64)
    """Generator processes `sluice up` starts."""
    trainer_ranks: int = Field(1, ge=1, le=64)
    """Data-parallel trainer ranks: > 1 runs the trainer as one ``torchrun`` job of this
    many processes (FSDP2; gloo on CPU, nccl on GPU; docs/gpu.md)."""
    trainer_restarts: int = Field(3, ge=0, le=100)
    """With trainer_ranks > 1: torchrun's ``--max-restarts``. A rank that dies takes the
    job down; torchrun restarts every rank, which resume from the newest checkpoint."""
    max_restarts: int = Field(3, ge=0, le=100)
    """A role that exits abnormally (a crash, ``kill -9``) is restarted after a backoff
    (1 s, doubling per crash, at most 30 s; the trainer resumes from its checkpoint); the
    run stops, naming the role and its log tail, when one role crashed more than this many
    times within restart_window_s. 0 = stop the run at the first crash."""
    restart_window_s: float = Field(300.0, gt=0)
    """The window in which a role's crashes count against max_restarts."""
    plot: bool = True
    """Write reward_curve.png into output_dir at the end."""
    metrics: bool = True
    """Every role `sluice up` starts serves ``/metrics`` on its own free port on
    metrics.host (listed by `sluice status`; a restarted role gets a new one); false = no
    role serves metrics (metrics.port is not used: roles on one machine cannot share it)."""
    stop_at: str = ""
    """Stop the run once an evaluation meets ``METRIC>=VALUE`` (or ``<=``), e.g.
    ``pass@1>=0.9`` or ``rewards/accuracy_reward>=0.5``; the metric is one the evaluator
    reports (`pipeline.evaluation`). The summary's time to target follows it. "" = never."""

    @field_validator("stop_at")
    @classmethod
    def _check_stop_at(cls, v: str) -> str:
        parse_target(v)
        return v


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


IMAGE_PATTERN = r"^[a-z0-9][a-z0-9._/:@-]{0,254}$"
"""A container image reference (``registry/name:tag`` or ``name@sha256:…``)."""


class DeployConfig(_Section):
    """`sluice deploy render` (docs/deploying.md). Counts come from the keys `sluice up`
    already reads: ``up.trainer_ranks``, ``up.generators``, ``up.scorers`` and
    ``generation.vllm.launch`` (the vLLM servers, shared out over the generators); the
    roles' devices decide their GPUs. These keys say only how the roles are laid out on
    machines; no role reads them."""

    image: str = Field("sluice:0.1.0", pattern=IMAGE_PATTERN)
    """k8s, compose: the image of the roles that use no GPU (deploy/docker/Dockerfile)."""
    gpu_image: str = Field("sluice-gpu:0.1.0", pattern=IMAGE_PATTERN)
    """k8s, compose: the image of the roles that use a GPU and of the vLLM servers
    (deploy/docker/Dockerfile.gpu, on vLLM's published image)."""
    redis: Literal["bundled", "external"] = "bundled"
    """`bundled`: the deployment runs its own Redis (AOF on, the ACL file of
    ``bus.credentials_file``'s folder); `external`: the roles use ``bus.redis_url``, a
    Redis 7+ you run."""
    redis_image: str = Field("redis:7.4", pattern=IMAGE_PATTERN)
    """k8s, compose: the image of the bundled Redis (7 or later: the ACL selectors)."""
    redis_port: int = Field(6379, ge=1, le=65535)
    """The bundled Redis's TCP port."""
    acl: bool = True
    """Every role logs in as its own Redis user: ``bus.credentials_file`` must name the
    credentials file `sluice acl` wrote (its users.acl beside it, for a bundled Redis);
    the render turns it into one credentials file or Secret per role. False: Redis's
    default user, no password (only for a Redis nothing else can reach)."""
    namespace: str = Field("sluice", pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
    """k8s: the namespace of every object."""
    trainer_nodes: int = Field(1, ge=1, le=64)
    """Machines the ``up.trainer_ranks`` ranks are spread over (torchrun, rendezvous on
    the first): slurm nodes of the trainer's component, k8s pods of the indexed Job. Must
    divide ``up.trainer_ranks``."""
    generator_nodes: int = Field(1, ge=1, le=64)
    """slurm: nodes of the generators' component; ``up.generators`` and
    ``generation.vllm.launch`` are spread evenly over them (each must be a multiple)."""
    scorers_with: Literal["trainer", "generators"] = "trainer"
    """slurm: the component the scorers run on (the trainer's first node, or spread over
    the generators' nodes)."""
    evaluator_with: Literal["trainer", "generators"] = "trainer"
    """slurm: the component the evaluator (and its vLLM server) runs on."""
    partition: str = Field("", pattern=r"^[A-Za-z0-9_.,-]{0,64}$")
    """slurm: partition of the trainer's component ("" = the cluster's default)."""
    gpu_partition: str = Field("", pattern=r"^[A-Za-z0-9_.,-]{0,64}$")
    """slurm: partition of the generators' component ("" = ``partition``)."""
    time_limit_min: int = Field(0, ge=0, le=525_600)
    """slurm: the job's time limit in minutes (0 = the partition's)."""
    rendezvous_port: int = Field(29400, ge=1, le=65535)
    """torchrun's c10d rendezvous port on the trainer's first node (trainer_ranks > 1)."""
    vllm_port: int = Field(8000, ge=1, le=65000)
    """A role's vLLM servers listen on loopback, on this port and the next ones; each runs
    beside the role that uses it (same node, pod or network namespace)."""
    metrics_port: int = Field(9100, ge=0, le=65535)
    """k8s: the port every pod serves ``/metrics`` on, at its pod IP (0 = none); slurm
    and compose keep ``metrics.port``."""
    service_monitor: bool = False
    """k8s: also render a Prometheus Operator ServiceMonitor for the roles' ``/metrics``."""
    autoscale: bool = True
    """k8s: a KEDA ScaledObject scales the scorers' Deployment between scorers_min and
    scorers_max on the lag of the `scorers` group on `rollouts` (one trigger per lane);
    false: ``up.scorers`` replicas."""
    scorers_min: int = Field(1, ge=1, le=1000)
    """Fewest scorer replicas. At least 1: entries a killed scorer left pending are not
    lag, and only a running scorer reclaims them (after ``bus.claim_idle_ms``)."""
    scorers_max: int = Field(8, ge=1, le=1000)
    """Most scorer replicas."""
    scorer_lag: int = Field(16, ge=1, le=1_000_000)
    """KEDA's target: `rollouts` entries not yet delivered to the `scorers` group per
    scorer replica (its ``lagCount``, split over the lanes)."""
    scorer_activation_lag: int = Field(0, ge=0, le=1_000_000)
    """KEDA's ``activationLagCount`` per lane (below it a trigger is inactive)."""
    polling_interval_s: int = Field(15, ge=1, le=3600)
    """How often KEDA reads the lag."""
    keda_namespace: str = Field("keda", pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
    """k8s: the namespace of KEDA's operator, which the NetworkPolicy lets reach Redis."""
    grace_s: int = Field(60, ge=1, le=3600)
    """Pod termination grace (k8s), stop_grace_period (compose), and how long the slurm
    job waits for the roles to exit after the trainer ends. A scorer stopped by SIGTERM
    finishes the groups it holds within it (so at least ``scoring.reward_timeout_s``)."""
    storage_gib: int = Field(50, ge=1, le=1_000_000)
    """k8s: size of the ReadWriteMany volume every pod mounts at /data (run.output_dir,
    the weight store, the HF cache)."""
    storage_class: str = Field("", pattern=r"^$|^[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?$")
    """k8s: its storage class ("" = the cluster's default)."""
    trainer_memory_gib: float = Field(0.0, ge=0, le=65536)
    """Memory of each trainer node/pod (0 = not requested)."""
    role_memory_gib: float = Field(0.0, ge=0, le=65536)
    """Memory of each generator, scorer and evaluator process (0 = not requested)."""
    vllm_memory_gib: float = Field(0.0, ge=0, le=65536)
    """Host memory of each vLLM server (0 = not requested)."""
    redis_memory_gib: float = Field(0.0, ge=0, le=65536)
    """Memory of the bundled Redis (0 = not requested)."""

    @model_validator(mode="after")
    def _check(self) -> DeployConfig:
        if self.scorers_min > self.scorers_max:
            raise ValueError("scorers_min must be <= scorers_max")
        return self


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    bus: BusConfig = Field(default_factory=BusConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    scoring: ScoringConfig = Field(default_factory=ScoringConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    up: UpConfig = Field(default_factory=UpConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    weights: WeightsConfig = Field(default_factory=WeightsConfig)
    archive: ArchiveConfig = Field(default_factory=ArchiveConfig)
    deploy: DeployConfig = Field(default_factory=DeployConfig)

    @model_validator(mode="after")
    def _check_engine(self) -> Config:
        v = self.generation.vllm
        if self.generation.engine == "vllm" and not v.urls and not v.launch:
            raise ValueError("generation.vllm.urls: the vllm engine needs server URLs, or "
                             "generation.vllm.launch > 0 for `sluice up` to start servers")
        if self.environment.name and "rewards" not in self.scoring.model_fields_set:
            # an environment's own rewards, unless the run names its functions
            self.scoring.rewards = [RewardSpec(fn="workers.tasks.rewards:env_reward")]
        if self.environment.name and self.generation.rollout:
            raise ValueError("generation.rollout: a rollout hook produces the episodes itself; "
                             "it cannot be combined with environment.name")
        mbt, longest = self.trainer.micro_batch_tokens, self.max_rollout_tokens
        if 0 < mbt <= longest:
            raise ValueError(f"trainer.micro_batch_tokens: {mbt} cannot hold one prompt and "
                             f"a {longest}-token rollout; use 0 (one micro-batch per step) or "
                             "a budget above generation.max_new_tokens (or "
                             "environment.max_episode_tokens)")
        if self.eval_engine == "vllm" and not self.eval.vllm_urls and not (
                self.generation.engine == "vllm" and v.launch > 0):
            raise ValueError("eval.vllm_urls: the evaluator's vllm engine needs servers of its "
                             "own (or generation.vllm.launch > 0 for `sluice up` to start one)")
        if self.bus.partitions > self.trainer.window:
            raise ValueError(f"bus.partitions: {self.bus.partitions} lanes cannot share an "
                             f"admission window of {self.trainer.window} groups (each lane "
                             "needs one); lower bus.partitions or raise "
                             "trainer.admission_window")
        target = parse_target(self.up.stop_at)
        if target is not None:
            e = self.eval
            names = [r.fn.rsplit(":", 1)[1] for r in self.eval_rewards]
            known = metric_names(names, e.num_samples, e.pass_at)
            if target.metric not in known:
                raise ValueError(f"up.stop_at: the evaluator does not report {target.metric!r}"
                                 f"; it reports {', '.join(known)}")
        if self.weights.full_every > 1 and self.model.lora is not None:
            raise ValueError("weights.full_every: deltas are for full weights; a LoRA run "
                             "publishes its adapter whole (leave it at 1)")
        if v.weight_transfer == "nccl" and self.model.lora is not None:
            raise ValueError("generation.vllm.weight_transfer: nccl carries full weights; "
                             "LoRA runs use the file store")
        return self

    @property
    def multi_turn(self) -> bool:
        """Rollouts are episodes (an environment or a rollout hook), not one completion."""
        return bool(self.environment.name or self.generation.rollout)

    @property
    def max_rollout_tokens(self) -> int:
        """The longest rollout the trainer can see: ``generation.max_new_tokens``, or an
        episode's ``environment.max_episode_tokens`` (when longer) with multi-turn rollouts."""
        g = self.generation.max_new_tokens
        return max(g, self.environment.max_episode_tokens) if self.multi_turn else g

    @property
    def eval_engine(self) -> Literal["transformers", "vllm"]:
        """The evaluator's engine, `auto` resolved (see ``eval.engine``)."""
        if self.eval.engine != "auto":
            return self.eval.engine
        own = self.eval.vllm_urls or self.generation.vllm.launch > 0
        return "vllm" if self.generation.engine == "vllm" and own else "transformers"

    @property
    def eval_rewards(self) -> list[RewardSpec]:
        """The evaluator's reward functions: ``eval.rewards``, else ``scoring.rewards``."""
        return self.scoring.rewards if self.eval.rewards is None else self.eval.rewards

    @property
    def output_path(self) -> Path:
        return Path(self.run.output_dir).resolve()

    @property
    def embedded_socket(self) -> Path:
        return self.output_path / "redis" / "redis.sock"

    @property
    def redis_url(self) -> str:
        """The bus URL every role uses: the configured one, else the embedded socket."""
        return self.bus.redis_url or f"unix://{self.embedded_socket}"


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one ``a.b=c`` override to a raw config dict, in place."""
    key, sep, raw = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {assignment!r}: expected section.key=value")
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {part!r} is not a section")
        node = child
    node[parts[-1]] = _parse_value(raw.strip())


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(root)"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        whole = e["type"] == "extra_forbidden" or isinstance(e.get("input"), dict)
        got = "" if whole else f" (got {e.get('input')!r})"
        lines.append(f"  {key}: {msg}{got}")
    return "\n".join(lines)


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a TOML file (or defaults when ``path`` is None), apply overrides, validate.

    Relative ``run.output_dir`` and ``model.path`` are relative to the current directory
    of each process; `sluice up` starts every role in its own directory, so they agree
    (and every role loads the model folder pinned in run.json, `pipeline.rundir`).
    """
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        source = str(p)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {p}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not UTF-8 text, so not TOML: {e}") from None
        except OSError as e:  # a directory, no permission, …
            raise ConfigError(f"{p}: cannot read the config file: {e.strerror or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
    for assignment in overrides:
        apply_override(data, assignment)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None


def _toml_value(v: Any) -> str:
    if isinstance(v, BaseModel):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.model_dump().items()) + "}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)


def reference_rows() -> list[str]:
    """The configuration table of docs/configuration.md (one markdown row per key, from
    the docstrings); a unit test keeps the file equal to it."""
    rows: list[str] = []

    def walk(prefix: str, node: BaseModel) -> None:
        for key, info in type(node).model_fields.items():
            value = getattr(node, key)
            doc = " ".join((info.description or "").split())
            if isinstance(value, _Section):
                walk(f"{prefix}{key}.", value)
                continue
            optional = [a for a in get_args(info.annotation)
                        if isinstance(a, type) and issubclass(a, _Section)]
            if value is None and optional:  # an optional section: its row, then its keys
                rows.append(f"| `{prefix}{key}` | unset | {doc} |")
                walk(f"{prefix}{key}.", optional[0]())
                continue
            rows.append(f"| `{prefix}{key}` | `{_toml_value(value)}` | {doc} |")

    walk("", Config())
    return rows
