"""Per-token log-probabilities of given token ids: the one implementation of that maths.

Two callers need "the model's logprob of each of these tokens": the trainer (the policy's
logprobs, with gradient, `trainer.logprobs.CompletionLogprobs`) and the distillation
teacher (`workers.teacher.LocalTeacher`, under inference mode). Both call the functions
here, so a teacher logprob and a trainer logprob of the same model and tokens are the
same computation (a unit test pins it).

* `split_lm`: a causal LM as (decoder body -> hidden states, LM head). Calling the body
  alone lets a caller gather the hidden states of only the positions it needs.
* `chunked_head_logprobs`: the LM head on ``[N, H]`` gathered hidden states,
  ``chunk_tokens`` rows at a time, each chunk reduced at once to the logprob of its ids.
  At a 152k vocabulary the full ``[B, L, V]`` logits would dominate memory; here the peak
  is O(chunk_tokens x V). With gradient enabled each chunk runs under activation
  checkpointing, so its logits are recomputed in backward instead of kept.
* `selective_log_softmax` / `candidate_log_softmax`: ``log_softmax(logits / T)[id]``
  over the full vocabulary, or renormalised over the sampler's recorded candidate set
  (top-k / top-p), without a ``[B, T, V]`` log-softmax copy.
* `entropy_from_logits`: the entropy metric, from the same logits.

Invariants: logprobs are float32 or wider (logits are cast up before any reduction);
nothing here changes a model or keeps logits beyond one chunk.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from pipeline.model import is_peft

__all__ = [
    "candidate_log_softmax",
    "chunked_head_logprobs",
    "entropy_from_logits",
    "head_logprobs",
    "logprobs_at",
    "selective_log_softmax",
    "split_lm",
]


def split_lm(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(decoder body returning hidden states, LM head) of a causal LM, peft-wrapped or not.

    The body is the HF base model (``get_decoder()``); LoRA layers injected by peft live
    inside it, so calling it directly still applies (or, under ``disable_adapter``, skips)
    the adapter.
    """
    base = model.get_base_model() if is_peft(model) else model  # type: ignore[operator]
    body, head = base.get_decoder(), base.get_output_embeddings()
    if body is None or head is None:
        raise ValueError(f"{type(base).__name__} has no decoder/LM head split "
                         "(get_decoder / get_output_embeddings)")
    return body, head


def head_logprobs(head: nn.Module, hidden: Tensor, ids: Tensor, candidates: Tensor | None,
                  temperature: float, fp32_head: bool,
                  with_entropy: bool, entropy_grad: bool = False) -> tuple[Tensor, Tensor]:
    """One chunk: (logprob ``[n]`` of ``ids [n]`` under ``head(hidden [n, H]) / T``,
    entropy ``[n]`` of that distribution, zeros unless ``with_entropy``).

    ``ids`` may be ``[n, 1 + k]``: column 0 the sampled token (the maths above), the other
    columns more ids under the same distribution (`logprobs_at`: the sampler's top-k ids
    for score centering; -1 = none, logprob 0); the logprobs are then ``[n, 1 + k]``.

    ``candidates`` ``[n, K]`` (or None): renormalise over each token's candidate set
    (`candidate_log_softmax`). ``fp32_head``: apply the head in float32 outside autocast,
    on float32 copies of its weights (the chunk is small); logits near ±30 lose ~0.06 to
    bf16 rounding otherwise. Without it the head runs in its own dtype and the logits are
    then cast to float32. Entropy carries gradient only with ``entropy_grad`` (an
    entropy bonus in the loss, `pipeline.rl.entropy_control`).
    """
    if fp32_head:
        with torch.autocast(hidden.device.type, enabled=False):
            bias = getattr(head, "bias", None)
            logits = F.linear(hidden.float(), head.weight.float(),
                              None if bias is None else bias.float()).unsqueeze(0)
    else:
        logits = head(hidden).float().unsqueeze(0)  # [1, n, V]
    if ids.dim() == 2:  # sampled + top-k ids: every column from one logsumexp per row
        lp = logprobs_at(logits.squeeze(0), ids, candidates, temperature)
    elif candidates is None:
        lp = selective_log_softmax(logits, ids.unsqueeze(0), temperature).squeeze(0)
    else:
        lp = candidate_log_softmax(logits, ids.unsqueeze(0), candidates.unsqueeze(0),
                                   temperature).squeeze(0)
    ent = torch.zeros(lp.shape[0], device=lp.device)
    if with_entropy and entropy_grad:
        ent = entropy_from_logits(logits / temperature).squeeze(0)
    elif with_entropy:
        with torch.no_grad():
            ent = entropy_from_logits(logits.detach() / temperature).squeeze(0)
    return lp, ent


def logprobs_at(logits: Tensor, ids: Tensor, candidates: Tensor | None,
                temperature: float = 1.0) -> Tensor:
    """``[n, k]`` logprobs of ``ids [n, k]`` under ``softmax(logits [n, V] / T)``, or
    renormalised over each row's candidate set (``candidates [n, K]``, -1 padded; a row
    with none known uses the full vocabulary), ids outside a known set getting ``-inf``.
    An id of -1 (no entry) gets 0. In float32 or wider; one logsumexp per row."""
    scaled = logits / temperature if temperature != 1.0 else logits
    scaled = scaled.to(torch.promote_types(scaled.dtype, torch.float32))
    lse = torch.logsumexp(scaled, -1, keepdim=True)
    present = ids >= 0
    picked = torch.gather(scaled, -1, ids.clamp(min=0).long())
    if candidates is not None:
        valid = candidates >= 0
        known = valid.any(-1, keepdim=True)
        cand = torch.gather(scaled, -1, candidates.clamp(min=0).long())
        cand_lse = torch.logsumexp(cand.masked_fill(~valid, -math.inf), -1, keepdim=True)
        lse = torch.where(known, cand_lse, lse)
        # [n, V] membership (not [n, k, K]); padding adds 0 at id 0, never erases it
        in_set = torch.zeros(scaled.shape, dtype=torch.int32, device=scaled.device)
        in_set.scatter_add_(-1, candidates.clamp(min=0).long(), valid.int())
        member = torch.gather(in_set, -1, ids.clamp(min=0).long()) > 0
        picked = torch.where(member | ~known, picked, -math.inf)
    return torch.where(present, picked - lse, 0.0)


def chunked_head_logprobs(head: nn.Module, hidden: Tensor, ids: Tensor, *,
                          chunk_tokens: int, temperature: float = 1.0,
                          candidates: Tensor | None = None, fp32_head: bool = True,
                          with_entropy: bool = False, entropy_grad: bool = False
                          ) -> tuple[Tensor, Tensor | None]:
    """(logprobs ``[N]`` float32, entropy ``[N]`` or None without ``with_entropy``) of
    ``ids [N]`` (or ``[N, 1 + k]``, logprobs ``[N, 1 + k]``: `head_logprobs`) given
    gathered hidden states ``[N, H]``: `head_logprobs` on
    ``chunk_tokens`` rows at a time (checkpointed when gradient is enabled, so backward
    recomputes each chunk's logits). ``N = 0`` gives empty tensors on the head's device.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    device = head.weight.device
    logps, ents = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = start + chunk_tokens
        args = (head, hidden[start:end], ids[start:end],
                None if candidates is None else candidates[start:end],
                temperature, fp32_head, with_entropy, entropy_grad)
        if torch.is_grad_enabled():
            lp, ent = checkpoint(head_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = head_logprobs(*args)
        logps.append(lp)
        ents.append(ent)
    return _cat(logps, device, tuple(ids.shape[1:])), (_cat(ents, device) if with_entropy
                                                        else None)


def _cat(parts: list[Tensor], device: torch.device, shape: tuple[int, ...] = ()) -> Tensor:
    return torch.cat(parts) if parts else torch.zeros((0, *shape), device=device)


def entropy_from_logits(logits: Tensor, chunk_size: int = 128) -> Tensor:
    """Entropy (nats) of ``softmax(logits)`` over the last dim -> ``logits.shape[:-1]``.

    Computed in row chunks to bound memory, as TRL does. Pass temperature-scaled logits
    to get the entropy of the sampling distribution.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    parts = []
    for chunk in flat.split(chunk_size, dim=0):
        logp = F.log_softmax(chunk, dim=-1)
        parts.append(-(logp.exp() * logp).sum(dim=-1))
    if not parts:
        return logits.new_zeros(logits.shape[:-1])
    return torch.cat(parts).reshape(logits.shape[:-1])


def selective_log_softmax(logits: Tensor, ids: Tensor, temperature: float = 1.0) -> Tensor:
    """``log_softmax(logits / temperature)[..., ids]`` -> ``[B, T]`` without a [B,T,V] copy.

    ``logits`` is ``[B, T, V]``, ``ids`` ``[B, T]``. float32/64 use gather - logsumexp
    row by row; lower precision uses a per-row log_softmax (logsumexp is unstable there).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if temperature != 1.0:
        logits = logits / temperature
    ids = ids.long()
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, dim=-1, index=ids.unsqueeze(-1)).squeeze(-1)
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return picked - lse
    rows = []
    for row_logits, row_ids in zip(logits, ids, strict=True):
        row_logps = F.log_softmax(row_logits, dim=-1)
        rows.append(row_logps.gather(dim=-1, index=row_ids.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


def candidate_log_softmax(
    logits: Tensor,
    ids: Tensor,
    candidates: Tensor,
    temperature: float = 1.0,
) -> Tensor:
    """Log-probability of ``ids`` renormalised over each position's candidate set.

    ``logits`` ``[B, T, V]``; ``ids`` ``[B, T]``; ``candidates`` ``[B, T, K]`` token ids
    the sampler could have drawn at that position (after top-k / top-p), padded with -1.
    A position whose row is all -1 (set unknown) gets the full-vocabulary log-softmax.
    Returns ``logits[id]/T - logsumexp(logits[candidates]/T)``: the trainer's logprob of
    the same truncated distribution the sampler drew from, so ``exp(trainer - behaviour)``
    is an unbiased importance ratio. Invariant: the sampled id must be in its set (the
    engine records the set it drew from); if it is not, the result is ``-inf`` there.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if candidates.dim() != 3 or candidates.shape[:2] != ids.shape:
        raise ValueError(f"candidates must be [B, T, K] matching ids {tuple(ids.shape)}, "
                         f"got {tuple(candidates.shape)}")
    scaled = logits / temperature if temperature != 1.0 else logits
    scaled = scaled.to(torch.promote_types(scaled.dtype, torch.float32))  # >= float32
    valid = candidates >= 0
    known = valid.any(dim=-1)
    picked = torch.gather(scaled, -1, candidates.clamp(min=0).long())
    picked = picked.masked_fill(~valid, -math.inf)
    lse = torch.logsumexp(picked, dim=-1)
    member = ((candidates == ids.unsqueeze(-1)) & valid).any(dim=-1)
    own = torch.gather(scaled, -1, ids.long().unsqueeze(-1)).squeeze(-1)
    renorm = torch.where(member, own - torch.where(known, lse, 0.0), -math.inf)
    if bool(known.all()):  # the usual case: no second log-softmax over the vocabulary
        return renorm
    return torch.where(known, renorm, selective_log_softmax(scaled, ids))
