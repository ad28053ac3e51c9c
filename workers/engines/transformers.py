"""Plain-PyTorch/transformers rollout engine with its own batched KV-cache decode loop.

We do not use ``model.generate`` because we need (a) the exact per-token behaviour logprob
under the processed sampling distribution, (b) per-token weight versions and (c) the ability
to swap weights between decode steps while keeping the KV cache (vLLM-style pause-keep).
The cache is passed as ``cache=`` (transformers >= 5.2x renamed ``past_key_values``).

Weights come in two formats: full weights (an HF folder: sharded safetensors behind an
index, as the `file` transport publishes, or one ``model.safetensors``), or a ``lora``
adapter directory (peft format) for a peft-wrapped model; both are read in a worker
thread (decoding and the role's heartbeats go on meanwhile) and go through the same
pending swap, so LoRA versions land between decode steps exactly like full weights.
Tied embeddings stay tied: the swap copies into the model's tensors in place, so a new
input embedding is the new ``lm_head`` too. Frozen tensors (a vision-language model's
vision tower and projector, `pipeline.vlm`) are in no version and never swapped: the
engine keeps the values it loaded, bit for bit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from transformers import DynamicCache, PreTrainedTokenizerBase

from pipeline.model import adapter_to_model_keys, is_peft
from pipeline.vlm import frozen_keys
from pipeline.weights import WeightError, read_adapter, read_full
from pipeline.weights.file import aliases
from workers.engines.base import Completion, EngineError, SamplingParams


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logprobs ``[..., V]`` (float32) of the distribution tokens are actually drawn from.

    Filtered-out tokens get ``-inf``; the rest are renormalised, so ``exp`` sums to 1.
    Greedy uses the raw ``log_softmax(logits)`` (temperature 1): the argmax is the same and
    this is the natural "behaviour" logprob to report for a deterministic policy.
    """
    x = logits.float()
    if params.greedy:
        return torch.log_softmax(x, dim=-1)
    if params.temperature != 1.0:
        x = x / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))  # ties with the k-th value are kept
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        # Keep the smallest prefix whose mass reaches top_p; the top token always survives.
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, dim=-1)


def sample_tokens(
    logprobs: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> torch.Tensor:
    """Draw one token per row ``[B]`` from processed ``logprobs [B, V]`` (argmax if greedy)."""
    if params.greedy:
        return torch.argmax(logprobs, dim=-1)
    return torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)


class WeightMismatchError(EngineError, ValueError):
    """Announced weights do not fit this engine's model (format, or LoRA rank/targets).

    A set-up error: a ValueError, and an EngineError so that a generator logs it and
    keeps serving the weights it has.
    """


def read_weights(model: torch.nn.Module, path: Path, fmt: str,
                 frozen: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The tensors of a weight-store directory keyed as ``model.state_dict()``.

    ``frozen``: keys no version carries (`pipeline.vlm.frozen_keys`: a vision-language
    model's tower and projector); full weights may lack them, and any the directory does
    hold are left out, so the model keeps the values it loaded for them.

    For ``lora`` only the adapter's tensors (``model`` must be peft-wrapped); for
    ``safetensors`` the full state (``model`` must not be: its keys are the base's).
    Raises `WeightMismatchError` on a format/model mismatch or an unreadable file.
    Blocking (reads every shard): `TransformersEngine.load_weights` runs it in a thread.
    """
    if fmt not in ("safetensors", "lora"):
        raise WeightMismatchError(f"the transformers engine cannot load {fmt!r} weights")
    if fmt == "safetensors" and is_peft(model):
        raise WeightMismatchError("full weights announced for a LoRA (peft) model: "
                                  "[model.lora] must match between the trainer and this role")
    try:
        state = read_full(path) if fmt == "safetensors" else read_adapter(path)
    except (SafetensorError, OSError, WeightError) as e:  # verified, yet not loadable: junk
        raise WeightMismatchError(f"{path.name}: not loadable safetensors weights: "
                                  f"{e}") from e
    if fmt == "safetensors":
        state = {k: v for k, v in state.items() if k not in frozen}
        _check_full_state(model, state, frozen)
        return state
    try:
        return adapter_to_model_keys(model, state)
    except ValueError as e:
        raise WeightMismatchError(str(e)) from e


def _check_full_state(model: torch.nn.Module, state: dict[str, torch.Tensor],
                      frozen: frozenset[str] = frozenset()) -> None:
    """Full weights must name exactly the model's tensors with the model's shapes; an
    alias (``lm_head.weight`` of tied embeddings) may be absent, as HF checkpoints omit it,
    and so are the frozen tensors (never published).

    Checked before a swap is queued because ``load_state_dict`` copies tensor by tensor
    and only then reports missing keys or wrong shapes: a bad file found at the swap
    would leave the model half old, half new, under the old version number.
    """
    own = model.state_dict()
    required = own.keys() - aliases(own).keys() - frozen
    missing, extra = sorted(required - state.keys()), sorted(state.keys() - own.keys())
    if missing or extra:
        raise WeightMismatchError(f"weights do not match the model: missing {missing[:3]} "
                                  f"({len(missing)}), unexpected {extra[:3]} ({len(extra)})")
    for k, v in state.items():
        if v.shape != own[k].shape:
            raise WeightMismatchError(f"weight {k} has shape {tuple(v.shape)}, the model's "
                                      f"has {tuple(own[k].shape)}")


class TransformersEngine:
    """`Engine` over a HF causal LM. Single event-loop thread only; no internal locking.

    Invariants: the version recorded for a token is the version of the weights whose
    forward produced its logits (swaps happen only between steps, after recording); the
    KV cache survives swaps, so post-swap tokens attend to keys/values computed under the
    old weights, exactly as in a pause-keep inference server.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer_or_eos_id: PreTrainedTokenizerBase | int,
        *,
        seed: int = 0,
        version: int = 0,
        frozen_prefixes: Sequence[str] = (),
    ) -> None:
        """``frozen_prefixes``: ``model.frozen_prefixes``; with a vision-language model's
        tower and projector (`pipeline.vlm.frozen_keys`) they are the tensors versions
        never carry, which this engine keeps as loaded."""
        self.model = model
        self.frozen = frozenset() if is_peft(model) else frozen_keys(model, frozen_prefixes)
        if isinstance(tokenizer_or_eos_id, int):
            self.eos_id = tokenizer_or_eos_id
            pad = getattr(model.config, "pad_token_id", None)
        else:
            if tokenizer_or_eos_id.eos_token_id is None:
                raise ValueError("tokenizer has no eos_token_id")
            self.eos_id = int(tokenizer_or_eos_id.eos_token_id)
            pad = tokenizer_or_eos_id.pad_token_id
        # Pad ids are only fed at masked prompt positions or to finished rows; any valid id works.
        self.pad_id = int(pad) if pad is not None else self.eos_id
        self.version = version
        self.device = next(model.parameters()).device
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        self._pending: tuple[dict[str, torch.Tensor], int, bool] | None = None
        self._active = 0  # generate() calls in flight; swaps apply immediately only at 0

    # ----------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def health(self) -> dict[str, object]:
        return {"healthy": True}

    # ----------------------------------------------------------------- weights
    async def load_weights(self, path: Path, version: int, fmt: str = "safetensors") -> bool:
        """Read a (verified) weight-store directory and queue it (`update_weights`).

        ``safetensors``: the full state dict. ``lora``: the directory's
        ``adapter_model.safetensors``, re-keyed to this model's adapter tensors; only those
        are swapped (the frozen base stays). Mismatches (a LoRA adapter for a plain model,
        full weights for a LoRA model, another rank) raise here, before
        anything is queued, never at the swap (`WeightMismatchError`). The files are read
        in a worker thread; decoding goes on meanwhile.
        """
        if version <= self._newest():
            return False
        state = await asyncio.to_thread(read_weights, self.model, Path(path), fmt,
                                        self.frozen)
        if version <= self._newest():  # a newer one was queued while we read
            return False
        self.update_weights(state, version, strict=False)  # keys checked by read_weights
        return True

    def _newest(self) -> int:
        return self._pending[1] if self._pending is not None else self.version

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int, *,
                       strict: bool = True) -> None:
        """Queue (or, when idle, apply) a swap; stale versions are dropped silently.

        ``strict=False`` swaps a subset of the state (a LoRA adapter's tensors, or full
        weights without the alias of tied embeddings); the keys must already be known to
        be the model's (see `read_weights`).
        """
        if version <= self._newest():
            return
        self._pending = (state_dict, version, strict)
        if self._active == 0:
            self._apply_pending()

    def _apply_pending(self) -> None:
        if self._pending is None:
            return
        sd, version, strict = self._pending
        self._pending = None
        with torch.no_grad():
            self.model.load_state_dict(sd, strict=strict)
        self.version = version

    # ----------------------------------------------------------------- decoding
    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache,
    ) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    async def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams
    ) -> list[list[Completion]]:
        """Decode ``n`` continuations of each prompt in one left-padded batch.

        Positions count real tokens only, so a left-padded row sees exactly the positions
        (and hence RoPE phases) it would see unpadded.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt: need at least one token to condition on")
        if not prompts:
            return []
        rows = [list(p) for p in prompts for _ in range(n)]
        if params.max_new_tokens == 0:
            return self._pack(prompts, n, [], [], [], [], torch.zeros(len(rows), dtype=torch.bool))
        # a batch starts on the newest queued weights (the generator applies the version
        # announced at admission before decoding): any other decode is paused at a step
        # boundary now, its only await, so this is a swap point for it too
        self._apply_pending()
        self._active += 1
        try:
            return await self._decode(prompts, n, rows, params)
        finally:
            self._active -= 1
            if self._active == 0:
                self._apply_pending()

    async def _decode(
        self, prompts: list[list[int]], n: int, rows: list[list[int]], params: SamplingParams
    ) -> list[list[Completion]]:
        dev = self.device
        bsz = len(rows)
        lens = torch.tensor([len(r) for r in rows], device=dev)
        width = int(lens.max())
        input_ids = torch.full((bsz, width), self.pad_id, dtype=torch.long, device=dev)
        attn = torch.zeros((bsz, width), dtype=torch.long, device=dev)
        for i, r in enumerate(rows):
            input_ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long, device=dev)
            attn[i, width - len(r) :] = 1
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            logits = self._forward(input_ids, attn, positions, cache)

        finished = torch.zeros(bsz, dtype=torch.bool, device=dev)
        step_tokens: list[torch.Tensor] = []
        step_logprobs: list[torch.Tensor] = []
        step_versions: list[int] = []
        step_cands: list[torch.Tensor] = []  # bool [B, V] per step, only if truncating
        step_top: list[tuple[torch.Tensor, torch.Tensor]] = []  # ([B, k], [B, k]) per step
        k_top = 0 if params.greedy else min(params.top_logprobs, int(logits.shape[-1]))
        alive_before: list[torch.Tensor] = []
        next_pos = lens.clone()
        for step in range(params.max_new_tokens):
            with torch.inference_mode():
                lp = process_logits(logits, params)
                tok = sample_tokens(lp, params, self._generator)
                tok_lp = lp.gather(-1, tok[:, None]).squeeze(-1)
                tok = tok.masked_fill(finished, self.pad_id)
            if params.truncates:
                step_cands.append(torch.isfinite(lp))
            if k_top:
                with torch.inference_mode():
                    top = torch.topk(lp, k_top, dim=-1)
                step_top.append((top.indices, top.values))
            alive_before.append(~finished)
            step_tokens.append(tok)
            step_logprobs.append(tok_lp)
            step_versions.append(self.version)
            finished = finished | (tok == self.eos_id)
            if bool(finished.all()) or step == params.max_new_tokens - 1:
                break
            # Yield so a watcher coroutine can queue weights; apply them at this boundary.
            await asyncio.sleep(0)
            self._apply_pending()
            with torch.inference_mode():
                attn = torch.cat([attn, torch.ones((bsz, 1), dtype=attn.dtype, device=dev)], 1)
                logits = self._forward(tok[:, None], attn, next_pos[:, None], cache)
            next_pos = next_pos + 1
        return self._pack(
            prompts, n, step_tokens, step_logprobs, step_versions, alive_before, finished,
            step_cands, step_top,
        )

    def _pack(
        self,
        prompts: list[list[int]],
        n: int,
        step_tokens: list[torch.Tensor],
        step_logprobs: list[torch.Tensor],
        step_versions: list[int],
        alive_before: list[torch.Tensor],
        finished: torch.Tensor,
        step_cands: list[torch.Tensor] | None = None,
        step_top: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> list[list[Completion]]:
        """Trim each row at its eos: a row's length is the number of steps it was alive.
        A top-k entry outside a truncated distribution (``-inf``) is reported as id -1."""
        bsz = len(prompts) * n
        if step_tokens:
            toks = torch.stack(step_tokens, 1).cpu().numpy().astype(np.int32)
            lps = torch.stack(step_logprobs, 1).float().cpu().numpy().astype(np.float32)
            alive = torch.stack(alive_before, 1).cpu().numpy()
            lengths = alive.sum(1)
        else:
            toks = np.zeros((bsz, 0), np.int32)
            lps = np.zeros((bsz, 0), np.float32)
            lengths = np.zeros(bsz, np.int64)
        vers = np.asarray(step_versions, dtype=np.int32)
        fin = finished.cpu().numpy()
        cands = torch.stack(step_cands, 1).cpu().numpy() if step_cands else None  # [B, S, V]
        top_ids = top_lps = None
        if step_top:  # [B, S, k]
            top_lps = torch.stack([v for _, v in step_top], 1).float().cpu().numpy()
            top_ids = torch.stack([i for i, _ in step_top], 1).cpu().numpy().astype(np.int32)
            top_ids = np.where(np.isfinite(top_lps), top_ids, -1).astype(np.int32)
            top_lps = np.where(np.isfinite(top_lps), top_lps, 0.0).astype(np.float32)
        out: list[list[Completion]] = []
        for p in range(len(prompts)):
            group: list[Completion] = []
            for j in range(n):
                i = p * n + j
                t = int(lengths[i])
                cand_ids = cand_counts = None
                if cands is not None:
                    row = cands[i, :t]
                    cand_ids = np.nonzero(row)[1].astype(np.int32)  # ordered by position
                    cand_counts = row.sum(axis=1).astype(np.int32)
                group.append(
                    Completion(
                        token_ids=toks[i, :t].copy(),
                        logprobs=lps[i, :t].copy(),
                        versions=vers[:t].copy(),
                        finish_reason="stop" if bool(fin[i]) else "length",
                        candidate_ids=cand_ids,
                        candidate_counts=cand_counts,
                        top_ids=None if top_ids is None else top_ids[i, :t].copy(),
                        top_logprobs=None if top_lps is None else top_lps[i, :t].copy(),
                    )
                )
            out.append(group)
        return out

    async def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[Completion]:
        """One argmax continuation per prompt (evaluation, and greedy checks in the tests)."""
        res = await self.generate(prompts, 1, SamplingParams(max_new_tokens, greedy=True))
        return [g[0] for g in res]
