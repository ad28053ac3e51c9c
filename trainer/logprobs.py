"""Memory-lean logprobs: vocabulary logits only at trained completion positions, in chunks.

A causal LM's ``forward`` computes ``[R, C, V]`` logits at every position; at a 152k
vocabulary that dominates a step's memory (64 x 512 tokens: ~20 GB in float32). Here the
decoder body runs alone (`pipeline.rl.logprobs.split_lm`), the hidden states of the
positions that predict a trained token (mask 1) are gathered into ``[N, H]``, and the LM
head is applied to ``chunk_tokens`` of them at a time
(`pipeline.rl.logprobs.chunked_head_logprobs`, which the distillation teacher also
uses). Each chunk's logits are recomputed in backward (activation checkpointing), so the
peak is O(chunk_tokens x V) in forward and backward, whatever N is. Entropy is computed
from the same chunk, without gradient.

Results are scattered back to ``[B, T]`` (zeros where the mask is 0), the shape the loss
(`pipeline.rl.losses`) takes. The maths is `selective_log_softmax` / `candidate_log_softmax`
(`pipeline.rl.logprobs`) on each chunk, so values equal the full-logits path (tested to
1e-5).

The body gets the layout in the form its attention implementation needs (`trainer.packing`
states why): a varlen attention (`pipeline.attention.is_varlen`: flash, hub kernels) gets a
packed layout's segment boundaries as ``cu_seq_lens_*`` / ``max_length_*`` keyword
arguments; only a mask attention (sdpa, eager) is given a 4D mask, and ``eager`` gets the
shared layout's boolean tree mask as an additive float mask.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.attention import MASK_ATTENTIONS, is_varlen
from pipeline.rl.logprobs import chunked_head_logprobs, split_lm
from trainer.batch import Batch
from trainer.packing import Layout, model_positions


class CompletionLogprobs(nn.Module):
    """``forward(layout, batch) -> (logps [B, T], entropy [B, T] | None, top [B, T, k] |
    None)`` of a policy; ``top`` holds its logprobs at the sampler's top ids when the batch
    carries them (score centering; 0 where an id is -1), computed from the same chunk.

    A module (not a function) so that a data-parallel wrapper (FSDP2's ``fully_shard``)
    can be applied to it as the root: its forward is the one call that runs the model.
    """

    def __init__(self, policy: nn.Module, temperature: float, chunk_tokens: int = 256,
                 fp32_head: bool = True):
        """``fp32_head``: apply the LM head in float32 even under bf16/fp16 autocast
        (`trainer.fp32_lm_head`). Logits near ±30 lose ~0.06 to bf16 rounding, which the
        importance ratio against the sampler's logprobs then reads as policy change."""
        super().__init__()
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.policy = policy
        self.temperature = temperature
        self.chunk_tokens = chunk_tokens
        self.fp32_head = fp32_head

    def forward(self, layout: Layout, batch: Batch, with_entropy: bool = False,
                entropy_grad: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        body, head = split_lm(self.policy)
        device = head.weight.device
        attn = attention_implementation(body)
        mask = _to(layout.attention_mask, device)
        if mask is not None and mask.dim() == 4:
            if attn not in MASK_ATTENTIONS:
                raise ValueError(f"attention {attn!r} takes no 4D (tree) mask: the shared "
                                 "layout needs sdpa or eager (use the packed layout)")
            if attn == "eager":
                mask = _additive(mask, _score_dtype(head, device))
        varlen = layout.varlen_kwargs(device) if is_varlen(attn) else {}
        hidden = body(input_ids=layout.input_ids.to(device), attention_mask=mask,
                      position_ids=_to(model_positions(layout.position_ids, body.config),
                                       device),
                      use_cache=False, **varlen).last_hidden_state
        sel = batch.mask > 0
        h = hidden[layout.rows[sel].to(device), layout.cols[sel].to(device)]  # [N, H]
        ids = batch.completion_ids[sel].to(device)
        top_ids = batch.sampler_top_ids
        if top_ids is not None:  # [N, 1 + k]: the sampled id, then the sampler's top ids
            ids = torch.cat([ids.unsqueeze(-1), top_ids[sel].to(device)], -1)
        cands = None if batch.candidates is None else batch.candidates[sel].to(device)
        logps, entropy_flat = chunked_head_logprobs(
            head, h, ids, chunk_tokens=self.chunk_tokens, temperature=self.temperature,
            candidates=cands, fp32_head=self.fp32_head, with_entropy=with_entropy,
            entropy_grad=entropy_grad)
        shape = batch.mask.shape
        where = sel.to(device)
        top = None
        if top_ids is not None:
            logps, top_flat = logps[:, 0], logps[:, 1:]
            top = torch.zeros((*shape, top_ids.shape[-1]), dtype=torch.float32, device=device)
            top = top.masked_scatter(where.unsqueeze(-1).expand_as(top), top_flat)
        out = torch.zeros(shape, dtype=torch.float32, device=device)
        out = out.masked_scatter(where, logps)
        entropy = None
        if entropy_flat is not None:
            entropy = torch.zeros(shape, dtype=torch.float32, device=device)
            entropy = entropy.masked_scatter(where, entropy_flat)
        return out, entropy, top


def attention_implementation(body: nn.Module) -> str:
    """The attention implementation the body's layers dispatch to. ``None`` (a config never
    dispatched) is ``eager``: it is what transformers' ``AttentionInterface.get_interface``
    falls back to for it."""
    return getattr(body.config, "_attn_implementation", None) or "eager"


def _score_dtype(head: nn.Module, device: torch.device) -> torch.dtype:
    """The dtype eager's attention scores are computed in: the autocast dtype when autocast
    is on, else the parameters'. (Any float dtype masks correctly, since the scores plus
    the mask are promoted to the wider of the two; matching avoids a wider copy.)"""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return head.weight.dtype


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = may attend) as eager attention's additive one: 0 where
    allowed, ``dtype``'s min elsewhere. eager computes ``scores + mask``, so a boolean mask
    (True = 1, False = 0) would mask nothing. Every query sees at least itself (the tree
    mask's diagonal), so no softmax row is all masked."""
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.finfo(dtype).min)


def _to(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)
