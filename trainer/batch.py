"""Turn scored groups into padded training tensors.

Row ``i`` is ``prompt_ids + completion_ids`` of one rollout, right-padded. Targets are
aligned so that ``logits[:, t]`` predicts ``input_ids[:, t + 1]``; the completion span of
each row is cut out into ``[B, T]`` tensors (T = longest completion) holding the sampled
ids, the behaviour logprobs and the loss mask (``rollout.mask`` and not padding).

Candidate sets (top-k / top-p samplers) become ``candidates [B, T, K]`` padded with -1;
a row whose engine reported none is all -1 (full-vocabulary logprobs) and is counted in
``candidates_missing`` so the trainer can say so.

The sampler's top logprobs (score centering, `pipeline.rl.centering`) become
``sampler_top_ids [B, T, k]`` (-1 = none) and ``sampler_top_logps [B, T, k]`` (-inf =
none); a row whose engine reported none is all -1 / -inf and is not centred.

A step's batch is split into micro-batches (`split_micro_batches`) by rows, under a token
budget counted as the forward will see them (`Layout` in `trainer.packing`); rows of one
group stay together so a packed forward can share their prompt. Every micro-batch is a
`Batch` itself, trimmed to its own longest row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.bus.schema import Rollout, ScoredGroup, TrainRollout


@dataclass
class Batch:
    input_ids: torch.Tensor  # int64 [B, L]
    attention_mask: torch.Tensor  # int64 [B, L]
    completion_start: torch.Tensor  # int64 [B], index of the first completion token
    completion_ids: torch.Tensor  # int64 [B, T]
    behaviour_logps: torch.Tensor  # float32 [B, T]
    mask: torch.Tensor  # float32 [B, T]
    advantages: torch.Tensor  # float32 [B], or [B, T] when a scorer gave per-token ones
    versions: torch.Tensor  # int64 [B, T]
    candidates: torch.Tensor | None = None  # int64 [B, T, K], -1 = padding / unknown
    candidates_missing: int = 0  # rows without candidate sets while others have them
    group: torch.Tensor | None = None  # int64 [B], index of the row's group in the step
    sampler_top_ids: torch.Tensor | None = None  # int64 [B, T, k], -1 = none
    sampler_top_logps: torch.Tensor | None = None  # float32 [B, T, k], -inf = none

    @property
    def num_tokens(self) -> int:
        """Trained (mask 1) completion tokens."""
        return int(self.mask.sum().item())

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_lens(self) -> torch.Tensor:
        """int64 [B]: prompt + completion tokens of each row (no padding)."""
        return self.attention_mask.sum(dim=1)

    @property
    def completion_lens(self) -> torch.Tensor:
        """int64 [B]: completion tokens of each row."""
        return self.seq_lens - self.completion_start

    @property
    def groups(self) -> torch.Tensor:
        """int64 [B]: group index per row (each row its own group when unknown)."""
        return self.group if self.group is not None else torch.arange(self.num_rows)

    def rows(self, idx: list[int] | torch.Tensor) -> Batch:
        """The batch of rows ``idx`` (in that order), trimmed to their longest row."""
        i = torch.as_tensor(idx, dtype=torch.long)
        if i.numel() == 0:
            raise ValueError("empty row selection")
        seq = int(self.seq_lens[i].max())
        comp = max(int(self.completion_lens[i].max()), 1)
        cands = None
        if self.candidates is not None:
            cands = self.candidates[i, :comp]
            missing = int((cands < 0).all(dim=-1).all(dim=-1).sum())
        top_ids = top_lps = None
        if self.sampler_top_ids is not None and self.sampler_top_logps is not None:
            top_ids, top_lps = self.sampler_top_ids[i, :comp], self.sampler_top_logps[i, :comp]
        return Batch(self.input_ids[i, :seq], self.attention_mask[i, :seq],
                     self.completion_start[i], self.completion_ids[i, :comp],
                     self.behaviour_logps[i, :comp], self.mask[i, :comp],
                     self.advantages[i] if self.advantages.dim() == 1
                     else self.advantages[i, :comp],
                     self.versions[i, :comp], cands, missing if cands is not None else 0,
                     self.groups[i], top_ids, top_lps)


def build_batch(groups: list[ScoredGroup], pad_id: int) -> Batch:
    """The padded tensors of ``groups``' rollouts, one row each, in order. Advantages are
    ``[B]``, or ``[B, T]`` when any group carries per-token advantages (the others' row
    advantage is then repeated along their tokens)."""
    rows = [(sg.group.prompt_ids, r, sg.advantage_of(i))
            for sg in groups for i, r in enumerate(sg.group.rollouts)]
    if not rows:
        raise ValueError("empty batch")
    seq_len = max(len(p) + len(r.completion_ids) for p, r, _ in rows)
    comp_len = max(max(len(r.completion_ids) for _, r, _ in rows), 1)
    b = len(rows)
    input_ids = np.full((b, seq_len), pad_id, dtype=np.int64)
    attn = np.zeros((b, seq_len), dtype=np.int64)
    start = np.zeros(b, dtype=np.int64)
    comp = np.full((b, comp_len), pad_id, dtype=np.int64)
    blp = np.zeros((b, comp_len), dtype=np.float32)
    mask = np.zeros((b, comp_len), dtype=np.float32)
    ver = np.zeros((b, comp_len), dtype=np.int64)
    per_token = any(sg.token_advantages is not None for sg in groups)
    adv = np.zeros((b, comp_len) if per_token else b, dtype=np.float32)
    for i, (p, r, a) in enumerate(rows):
        n_p, n_c = len(p), len(r.completion_ids)
        input_ids[i, :n_p] = p
        input_ids[i, n_p:n_p + n_c] = r.completion_ids
        attn[i, :n_p + n_c] = 1
        start[i] = n_p
        comp[i, :n_c] = r.completion_ids
        blp[i, :n_c] = r.logprobs
        mask[i, :n_c] = r.mask
        ver[i, :n_c] = r.versions
        if per_token:
            adv[i, :n_c] = a  # an array of n_c values, or one value repeated
        else:
            adv[i] = a
    cands, missing = _candidates([r for _, r, _ in rows], comp_len)
    top_ids, top_lps = _sampler_top([r for _, r, _ in rows], comp_len)
    group = torch.tensor([g for g, sg in enumerate(groups) for _ in sg.group.rollouts])
    return Batch(*(torch.from_numpy(x) for x in (input_ids, attn, start, comp, blp, mask)),
                 advantages=torch.from_numpy(adv), versions=torch.from_numpy(ver),
                 candidates=cands, candidates_missing=missing, group=group,
                 sampler_top_ids=top_ids, sampler_top_logps=top_lps)


def split_micro_batches(batch: Batch, budget_tokens: int,
                        cost: Callable[[list[int]], int]) -> list[Batch]:
    """Split ``batch`` into micro-batches whose ``cost`` (tokens the forward will process
    for those rows of ``batch``) stays within ``budget_tokens``; 0 = no split.

    Rows are taken in order, whole groups at a time (a group is split by rows only when it
    alone exceeds the budget); a single row over the budget forms its own micro-batch.
    Invariant: every row of ``batch`` is in exactly one micro-batch, in order.
    """
    if budget_tokens <= 0:
        return [batch]
    groups = batch.groups.tolist()
    units: list[list[int]] = []  # rows of one group, consecutive
    for i, g in enumerate(groups):
        if units and groups[units[-1][0]] == g:
            units[-1].append(i)
        else:
            units.append([i])
    out: list[Batch] = []
    current: list[int] = []
    for unit in units:
        for piece in _fit(unit, budget_tokens, cost):
            if current and cost(current + piece) > budget_tokens:
                out.append(batch.rows(current))
                current = []
            current += piece
    if current:
        out.append(batch.rows(current))
    return out


def _fit(rows: list[int], budget_tokens: int,
         cost: Callable[[list[int]], int]) -> list[list[int]]:
    """``rows`` as one piece when it fits the budget, else split greedily by rows."""
    if cost(rows) <= budget_tokens:
        return [rows]
    pieces: list[list[int]] = [[]]
    for r in rows:
        if pieces[-1] and cost(pieces[-1] + [r]) > budget_tokens:
            pieces.append([])
        pieces[-1].append(r)
    return pieces


def _candidates(rollouts: list[Rollout], comp_len: int) -> tuple[torch.Tensor | None, int]:
    with_sets = [r for r in rollouts if r.candidate_counts is not None]
    if not with_sets:
        return None, 0
    k = max(int(r.candidate_counts.max(initial=0)) for r in with_sets)  # type: ignore[union-attr]
    out = np.full((len(rollouts), comp_len, max(k, 1)), -1, dtype=np.int64)
    for i, r in enumerate(rollouts):
        for t, s in enumerate(r.candidate_sets() or []):
            out[i, t, :len(s)] = s
    return torch.from_numpy(out), len(rollouts) - len(with_sets)


def _sampler_top(rollouts: list[TrainRollout], comp_len: int
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(ids [B, T, k], logps [B, T, k])`` of the rollouts' sampler top logprobs (k = the
    widest), -1 / -inf where a rollout has fewer or none; (None, None) if none has any."""
    with_top = [r for r in rollouts if r.top_ids is not None]
    if not with_top:
        return None, None
    k = max(r.top_ids.shape[1] for r in with_top)  # type: ignore[union-attr]
    ids = np.full((len(rollouts), comp_len, k), -1, dtype=np.int64)
    lps = np.full((len(rollouts), comp_len, k), -np.inf, dtype=np.float32)
    for i, r in enumerate(rollouts):
        if r.top_ids is not None and r.top_logprobs is not None:
            t, kr = r.top_ids.shape
            ids[i, :t, :kr] = r.top_ids
            lps[i, :t, :kr] = np.where(r.top_ids >= 0, r.top_logprobs, -np.inf)
    return torch.from_numpy(ids), torch.from_numpy(lps)


def completion_logits(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``[B, T, V]`` logits that predicted each completion token (gathered per row)."""
    _, t = batch.completion_ids.shape
    offsets = torch.arange(t).unsqueeze(0) + batch.completion_start.unsqueeze(1) - 1
    offsets = offsets.clamp(max=logits.shape[1] - 1)
    idx = offsets.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    return torch.gather(logits, 1, idx)
