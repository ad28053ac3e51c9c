"""How a micro-batch's rows are laid out for the forward: padded, packed, or packed with
shared prompts. Every layout says where the logits that predict each completion token sit.

- ``padded``: one row per sample, right-padded to the longest (the batch's own tensors).
- ``packed``: samples concatenated into rows of at most ``capacity`` tokens (first-fit
  decreasing; capacity = the longest sample, so no row is longer than a padded one), with
  ``position_ids`` restarting at 0 per sample and no 2D mask. The layout also carries its
  segment boundaries over the flattened rows (``cu_seqlens``, int32, and ``max_seqlen``):
  every sample is a segment, and so is each row's padding tail.
- ``shared`` (packed + prefix sharing): a group's prompt is written once, followed by each
  of its completions, each completion's positions continuing from the prompt's end, with
  an explicit 4D boolean tree mask: a completion token sees the prompt and the earlier
  tokens of its own completion only. The first completion token of every sample is
  predicted by the prompt's last position, shared by the group.

How attention stays inside each sample depends on the attention implementation
(``config._attn_implementation``), classified by `pipeline.attention`:

- Mask attentions (``MASK_ATTENTIONS``: ``sdpa``, ``eager``): transformers'
  ``masking_utils`` finds a packed row's samples from its position ids, row by row
  (``find_packed_sequence_indices``), and builds a block-causal mask; they take the
  ``shared`` tree mask as is. ``eager`` *adds* its mask to the scores, so the forward
  (`trainer.logprobs`) turns the boolean tree mask into 0 / dtype-min for it.
- Varlen attentions (``is_varlen``: every other name but ``flex_attention``, i.e.
  ``flash_attention_2``/``3``, a `kernels` hub repo such as ``kernels-community/flash-attn2``
  or any unknown kernel). transformers' flash path (``_flash_attention_forward``) infers
  samples from position ids only when the batch has one row (``_is_packed_sequence``);
  with R > 1 rows it would run plain causal attention across every sample of a row. So
  the forward hands them the packed layout's boundaries explicitly, as the
  ``DataCollatorWithFlattening`` contract does: ``cu_seq_lens_q`` = ``cu_seq_lens_k`` =
  ``cu_seqlens``, ``max_length_q`` = ``max_length_k`` = ``max_seqlen`` (a Python int).
  The model's forward passes these keyword arguments down to the attention function; the
  flash path then flattens the R rows and runs varlen attention over those segments (and
  skips the per-layer device sync of finding them).
- ``flex_attention`` gets its block mask from ``masking_utils``, row by row, like sdpa.
- Only mask attentions get the ``shared`` layout (`trainer.setup.layout_kind`), and the
  forward refuses a 4D mask for any other: a tree mask cannot be expressed as segments,
  and flex would add a boolean mask to its scores.

M-RoPE text models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5: rotary positions on three
axes, time/height/width): a text token has the same position on all three, so the packed
positions are the 1D ones repeated. `model_positions` hands such a body ``[4, R, C]``: the
text positions, then the three axes, the form whose first row transformers' Qwen-VL text
models read to find a packed row's samples (given ``[R, C]``, Qwen2-VL and Qwen2.5-VL
expand it to the three axes only and build a plain causal mask: the samples of a row would
see each other).

Invariant (tested against the padded forward to 1e-5): for every sample ``b`` and
completion token ``t``, the hidden state at ``(rows[b, t], cols[b, t])`` equals the one the
padded layout gives, so logprobs do not depend on the layout. Padding positions of a row
attend to themselves only (a query that sees nothing would make SDPA return NaN, which a
backward would multiply by zero and still propagate); in the packed layout the padding
tail is a segment of its own, never seen by a sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from trainer.batch import Batch

LayoutKind = Literal["padded", "packed", "shared"]


@dataclass
class Layout:
    """One micro-batch as the forward sees it; ``input_ids.numel()`` (R * C) is the
    positions it computes, which `shapes_cost` predicts exactly."""

    input_ids: torch.Tensor  # int64 [R, C]
    position_ids: torch.Tensor | None  # int64 [R, C]; None = 0..C-1 per row
    attention_mask: torch.Tensor | None  # int64 [R, C] (padded) | bool [R, 1, C, C] | None
    rows: torch.Tensor  # int64 [B, T]: row of the position predicting completion token t
    cols: torch.Tensor  # int64 [B, T]: its column
    # packed only: int32 [S + 1] starts of the S segments (samples, padding tails) in the
    # R * C flattened positions; row ends are always boundaries. None otherwise.
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0  # longest segment (packed only)

    def varlen_kwargs(self, device: torch.device) -> dict[str, torch.Tensor | int]:
        """The varlen attention keyword arguments of a packed layout (empty otherwise), in
        the names transformers' flash path reads: cu_seqlens as int32 on ``device``, max
        lengths as Python ints (the varlen kernels want ints)."""
        if self.cu_seqlens is None:
            return {}
        cu = self.cu_seqlens.to(device)
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
                "max_length_q": self.max_seqlen, "max_length_k": self.max_seqlen}


RowShape = tuple[int, int, int]
"""(tokens, prompt tokens, group) of one row: all a layout's cost depends on."""


def is_mrope(config: object) -> bool:
    """The body's rotary embedding is M-RoPE (an ``mrope_section`` in its rope
    parameters: transformers 5's ``rope_parameters``, older ``rope_scaling``)."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = getattr(config, key, None)
        if isinstance(rope, dict) and rope.get("mrope_section"):
            return True
    return False


def model_positions(position_ids: torch.Tensor | None, config: object
                    ) -> torch.Tensor | None:
    """``position_ids`` ``[R, C]`` in the form the body with ``config`` takes: as they are,
    or for M-RoPE ``[4, R, C]`` (module docstring). None stays None (the model's own
    0..C-1, the same on every axis)."""
    if position_ids is None or position_ids.dim() != 2 or not is_mrope(config):
        return position_ids
    return position_ids.unsqueeze(0).expand(4, *position_ids.shape)


def row_shapes(batch: Batch) -> list[RowShape]:
    """Each row's `RowShape`, in batch order."""
    return list(zip(batch.seq_lens.tolist(), batch.completion_start.tolist(),
                    batch.groups.tolist(), strict=True))


def layout_cost(batch: Batch, kind: LayoutKind) -> int:
    """Tokens a forward of ``batch`` in layout ``kind`` computes, without building it."""
    return shapes_cost(row_shapes(batch), kind)


def shapes_cost(shapes: list[RowShape], kind: LayoutKind) -> int:
    """`layout_cost` of rows given by their shapes (cheap: plain integers)."""
    if kind == "padded":
        return max(n for n, _, _ in shapes) * len(shapes)
    sizes = [size for size, _ in _units(shapes, kind == "shared")]
    return len(_first_fit(sizes, max(sizes))) * max(sizes)


def layout_stats(batches: list[Batch], kind: LayoutKind) -> dict[str, float]:
    """What one pass over ``batches`` (the step's micro-batches) forwards, under TRL's
    names: ``batch/forwarded_tokens_per_step`` (positions computed, padding included),
    ``batch/rows``, ``batch/row_tokens_mean`` (non-padding tokens per row; a shared
    prompt counts once), ``batch/samples_per_row``, ``batch/row_fill_frac`` (non-padding
    share of the positions) and ``sample/forwarded_tokens_mean`` (non-padding tokens
    forwarded per sample)."""
    rows = forwarded = real = samples = 0
    for b in batches:
        shapes = row_shapes(b)
        units = [n for n, _, _ in shapes] if kind == "padded" else \
            [size for size, _ in _units(shapes, kind == "shared")]
        n_rows = len(shapes) if kind == "padded" else len(_first_fit(units, max(units)))
        rows += n_rows
        forwarded += shapes_cost(shapes, kind)
        real += sum(units)
        samples += len(shapes)
    return {"batch/forwarded_tokens_per_step": float(forwarded), "batch/rows": float(rows),
            "batch/row_tokens_mean": real / max(rows, 1),
            "batch/samples_per_row": samples / max(rows, 1),
            "batch/row_fill_frac": real / max(forwarded, 1),
            "sample/forwarded_tokens_mean": real / max(samples, 1)}


def make_layout(batch: Batch, kind: LayoutKind, pad_id: int) -> Layout:
    """``batch`` laid out as ``kind`` (module docstring); packed rows are filled with
    ``pad_id`` past their last unit."""
    if kind == "padded":
        return _padded(batch)
    units = _units(row_shapes(batch), kind == "shared")
    sizes = [size for size, _ in units]
    capacity = max(sizes)
    bins = _first_fit(sizes, capacity)
    n_rows, t = len(bins), batch.completion_ids.shape[1]
    ids = torch.full((n_rows, capacity), pad_id, dtype=torch.long)
    pos = torch.zeros((n_rows, capacity), dtype=torch.long)
    seg = torch.full((n_rows, capacity), -1, dtype=torch.long)  # tree id per column
    branch = torch.full((n_rows, capacity), -1, dtype=torch.long)  # -1 = prompt/own
    rows = torch.zeros((batch.num_rows, t), dtype=torch.long)
    cols = torch.zeros((batch.num_rows, t), dtype=torch.long)
    starts = batch.completion_start.tolist()
    lens = batch.seq_lens.tolist()
    segments: list[int] = []  # lengths, row after row: its units, then its padding tail
    for r, members in enumerate(bins):
        col = 0
        for u in members:
            size, samples = units[u]
            segments.append(size)
            p = starts[samples[0]]
            ids[r, col:col + p] = batch.input_ids[samples[0], :p]
            pos[r, col:col + p] = torch.arange(p)
            seg[r, col:col + p] = u
            last_prompt = col + p - 1
            col += p
            for b in samples:
                c = lens[b] - p
                ids[r, col:col + c] = batch.input_ids[b, p:p + c]
                pos[r, col:col + c] = torch.arange(p, p + c)
                seg[r, col:col + c] = u
                branch[r, col:col + c] = b
                rows[b, :] = r
                cols[b, 0] = last_prompt
                cols[b, 1:c] = torch.arange(col, col + c - 1)
                cols[b, c:] = col + c - 1 if c > 0 else last_prompt  # padding: any valid
                col += c
        pad = capacity - col
        pos[r, col:] = torch.arange(pad)  # a segment of its own: never seen by samples
        if pad:
            segments.append(pad)
    if kind == "packed":
        cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(segments, dtype=torch.int32).cumsum(0)
        return Layout(ids, pos, None, rows, cols, cu, max(segments))
    return Layout(ids, pos, _tree_mask(seg, branch), rows, cols)


def _padded(batch: Batch) -> Layout:
    b, t = batch.completion_ids.shape
    cols = (torch.arange(t).unsqueeze(0) + batch.completion_start.unsqueeze(1) - 1)
    cols = cols.clamp(max=batch.input_ids.shape[1] - 1)
    rows = torch.arange(b).unsqueeze(1).expand(b, t)
    return Layout(batch.input_ids, None, batch.attention_mask, rows.contiguous(), cols)


def _units(shapes: list[RowShape], share: bool) -> list[tuple[int, list[int]]]:
    """(tokens, sample rows) per packing unit: one sample, or with ``share`` one group's
    samples behind a single copy of their (identical) prompt."""
    if not share:
        return [(n, [b]) for b, (n, _, _) in enumerate(shapes)]
    by_group: dict[int, list[int]] = {}
    for b, (_, _, g) in enumerate(shapes):
        by_group.setdefault(g, []).append(b)
    units = []
    for samples in by_group.values():
        p = shapes[samples[0]][1]
        units.append((p + sum(shapes[b][0] - p for b in samples), samples))
    return units


def _first_fit(sizes: list[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: unit indices per row, each row's sizes summing to at most
    ``capacity`` (every size is at most capacity)."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        for k, room in enumerate(free):
            if sizes[i] <= room:
                bins[k].append(i)
                free[k] -= sizes[i]
                break
        else:
            bins.append([i])
            free.append(capacity - sizes[i])
    return bins


def _tree_mask(seg: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """bool [R, 1, C, C]: query i sees key j iff j <= i, both in one tree, and j is the
    prompt or i's own completion. Padding (seg -1) sees only itself."""
    c = seg.shape[1]
    causal = torch.ones(c, c, dtype=torch.bool).tril()
    same_tree = (seg.unsqueeze(2) == seg.unsqueeze(1)) & (seg.unsqueeze(2) >= 0)
    key_prompt = (branch == -1).unsqueeze(1)
    same_branch = branch.unsqueeze(2) == branch.unsqueeze(1)
    mask = causal & same_tree & (key_prompt | same_branch)
    mask |= torch.eye(c, dtype=torch.bool)
    return mask.unsqueeze(1)
