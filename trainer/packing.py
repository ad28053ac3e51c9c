"""How a micro-batch's rows are laid out for the forward: padded, packed, or packed with
shared prefixes (a group's prompt, or a trie of every shared prefix). Every layout says
where the logits that predict each completion token sit.

- ``padded``: one row per sample, right-padded to the longest (the batch's own tensors).
- ``packed``: samples concatenated into rows of at most ``capacity`` tokens (first-fit
  decreasing; capacity = the longest sample, so no row is longer than a padded one), with
  ``position_ids`` restarting at 0 per sample and no 2D mask. The layout also carries its
  segment boundaries over the flattened rows (``cu_seqlens``, int32, and ``max_seqlen``):
  every sample is a segment, and so is each row's padding tail.
- ``shared`` (packed + prompt sharing): a group's prompt is written once, followed by each
  of its completions, each completion's positions continuing from the prompt's end, with
  an explicit 4D boolean tree mask: a completion token sees the prompt and the earlier
  tokens of its own completion only. The first completion token of every sample is
  predicted by the prompt's last position, shared by the group. A group is one unit, so
  the capacity is the largest group's prompt + completions.
- ``trie`` (packed + prefix trie): the samples' token sequences (prompt + completion,
  schema-3 observation tokens included) folded into a trie whose nodes are written once:
  whatever prefix several samples share is forwarded once, be it a group's prompt, the
  earlier turns several episodes took alike (the same action gets the same observation
  from a deterministic environment), or a system prompt common to every group. A node's
  position is its depth (its position in every sample through it) and the tree mask lets
  a token see its ancestors and itself. Completion token ``t`` of sample ``b`` is
  predicted by the node at depth ``start_b + t - 1`` on b's path, which several samples
  may gather (each scores its own next token on the same hidden state), so the trie
  shares up to the very token where samples diverge. Rows have ``packed``'s capacity (the
  longest sample: no row longer than a padded one, the same bound on a row's attention)
  and a sample's whole path sits in one row: a row holding some of a node's descendants
  writes that node, so a prefix is repeated once per row its descendants landed in.
  Placement, on the samples in lexicographic order of their tokens (the trie's
  depth-first order: samples sharing a prefix are neighbours), the fewest rows of three
  plans: each sample into the open row whose last sample it shares the longest prefix
  with among those it fits (first on ties), else a new row; or the order cut into chains
  of neighbours that share a prefix and fit one row, the chains packed first-fit
  decreasing; or ``packed``'s own rows (little sharing, unlucky sizes) under the tree
  mask. So ``trie`` never forwards more positions than ``packed``. ``shared`` is the
  one-level case of the same writer (every sample forks from its group's first sample at
  the prompt's end); ``packed`` the zero-level one (every sample a tree of its own).

How attention stays inside each sample depends on the attention implementation
(``config._attn_implementation``), classified by `pipeline.attention`:

- Mask attentions (``MASK_ATTENTIONS``: ``sdpa``, ``eager``): transformers'
  ``masking_utils`` finds a packed row's samples from its position ids, row by row
  (``find_packed_sequence_indices``), and builds a block-causal mask; they take the
  ``shared`` and ``trie`` tree masks as is. ``eager`` *adds* its mask to the scores, so
  the forward (`trainer.logprobs`) turns a boolean tree mask into 0 / dtype-min for it.
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
- Only mask attentions get ``shared`` or ``trie`` (`trainer.setup.layout_kind`), and the
  forward refuses a 4D mask for any other: a tree is not a set of segments (a node has
  several descendants, each of which must see it), and flex would add a boolean mask to
  its scores. Any other attention gets ``packed``: every sample's path written out in
  full, the path-duplicating form of the trie, whose segments a varlen kernel takes.

What TRL does (1.16, ``trl.experimental.async_grpo.packing``): ``TreeRow`` folds a rank's
samples into one trie row under a budget of unique tokens, and its own attention function
(``tree_fa3``) feeds FA3's ``flash_attn_varlen_func`` the trie's unary chains as query
segments (``cu_seqlens_q``) with K/V gathered along each chain's root-to-chain path
(``cu_seqlens_k`` over the gathered rows; causal, aligned bottom-right), on the GPU only;
it has no mask path. Its nodes are keyed on (token, next token), forking one token early
so each position has a single next-token label; here samples gather hidden states per
token (``rows``/``cols``), so that early fork is not needed. Mirrored here: the trie over
every shared prefix (not only a group's prompt), positions = depth, the shared-prefix
placement, and the budget counting unique tokens (`shapes_cost`). Not built: the
gathered-K/V varlen call, which needs an attention function of its own around the kernel
(transformers' flash path takes K and V from the same rows as Q, so it cannot gather a
segment's ancestors) and a GPU to test it on; under a varlen attention ``trie`` falls back
to ``packed``, saying so.

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
from typing import Literal, NamedTuple

import torch

from trainer.batch import Batch

LayoutKind = Literal["padded", "packed", "shared", "trie"]
TREE_KINDS = frozenset({"shared", "trie"})
"""Layouts with a 4D tree mask: only mask attentions (sdpa, eager) take them."""


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


class RowShape(NamedTuple):
    """One sample as the layouts' costs see it: all a layout's size depends on."""

    tokens: int  # prompt + completion
    prompt: int
    group: int
    ids: bytes  # its tokens as big-endian int32 (read by ``trie`` only): byte order puts
    # samples sharing a prefix next to each other, and 4-byte prefixes are token prefixes


Placed = tuple[int, int]
"""(sample, tokens it shares with the previous sample of its row: 0 = a tree of its own)."""


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
    """Each sample's `RowShape`, in batch order."""
    lens = batch.seq_lens.tolist()
    raw = batch.input_ids.numpy().astype(">i4")
    return [RowShape(n, p, g, raw[b, :n].tobytes()) for b, (n, p, g) in enumerate(
        zip(lens, batch.completion_start.tolist(), batch.groups.tolist(), strict=True))]


def layout_cost(batch: Batch, kind: LayoutKind) -> int:
    """Tokens a forward of ``batch`` in layout ``kind`` computes, without building it."""
    return shapes_cost(row_shapes(batch), kind)


def shapes_cost(shapes: list[RowShape], kind: LayoutKind) -> int:
    """`layout_cost` of samples given by their shapes (no tensors)."""
    if kind == "padded":
        return max(s.tokens for s in shapes) * len(shapes)
    plan, capacity = plan_rows(shapes, kind)
    return len(plan) * capacity


def layout_stats(batches: list[Batch], kind: LayoutKind) -> dict[str, float]:
    """What one pass over ``batches`` (the step's micro-batches) forwards, under TRL's
    names: ``batch/forwarded_tokens_per_step`` (positions computed, padding included),
    ``batch/rows``, ``batch/row_tokens_mean`` (non-padding tokens per row; a shared
    prefix counts once per row), ``batch/samples_per_row``, ``batch/row_fill_frac``
    (non-padding share of the positions) and ``sample/forwarded_tokens_mean``
    (non-padding tokens forwarded per sample)."""
    rows = forwarded = real = samples = 0
    for b in batches:
        shapes = row_shapes(b)
        if kind == "padded":
            rows += len(shapes)
            real += sum(s.tokens for s in shapes)
        else:
            plan, _ = plan_rows(shapes, kind)
            rows += len(plan)
            real += sum(_written(shapes, row) for row in plan)
        forwarded += shapes_cost(shapes, kind)
        samples += len(shapes)
    return {"batch/forwarded_tokens_per_step": float(forwarded), "batch/rows": float(rows),
            "batch/row_tokens_mean": real / max(rows, 1),
            "batch/samples_per_row": samples / max(rows, 1),
            "batch/row_fill_frac": real / max(forwarded, 1),
            "sample/forwarded_tokens_mean": real / max(samples, 1)}


def plan_rows(shapes: list[RowShape], kind: LayoutKind) -> tuple[list[list[Placed]], int]:
    """The rows of a packed kind (each a list of `Placed`, in write order) and their
    capacity in columns (module docstring)."""
    if kind == "shared":
        units = _group_units(shapes)
    else:
        units = [[(b, 0)] for b in range(len(shapes))]
    sizes = [_written(shapes, u) for u in units]
    capacity = max(sizes)
    plan = [[p for u in row for p in units[u]] for row in _first_fit(sizes, capacity)]
    if kind == "trie":  # the fewest rows; on a tie the one writing fewest tokens
        plans = [[_shared_in_row(shapes, row) for row in p]
                 for p in (_trie_rows(shapes, capacity), _chain_rows(shapes, capacity), plan)]
        plan = min(plans, key=lambda p: (len(p), sum(_written(shapes, row) for row in p)))
    return plan, capacity


def _shared_in_row(shapes: list[RowShape], row: list[Placed]) -> list[Placed]:
    """``row``'s samples in lexicographic order, each sharing its longest common prefix
    with the one before it: in sorted order that is the longest it shares with any
    earlier sample of the row, so every prefix two samples of a row have in common is
    written once, whichever placement put them together (two chains packed into one row
    by first fit share too). Only sharing grows: the row never gets wider."""
    order = sorted((b for b, _ in row), key=lambda b: shapes[b].ids)
    return [(b, _common_tokens(shapes[order[k - 1]].ids, shapes[b].ids) if k else 0)
            for k, b in enumerate(order)]


def make_layout(batch: Batch, kind: LayoutKind, pad_id: int) -> Layout:
    """``batch`` laid out as ``kind`` (module docstring); packed rows are filled with
    ``pad_id`` past their last sample."""
    if kind == "padded":
        return _padded(batch)
    plan, capacity = plan_rows(row_shapes(batch), kind)
    n_rows, t = len(plan), batch.completion_ids.shape[1]
    ids = torch.full((n_rows, capacity), pad_id, dtype=torch.long)
    pos = torch.zeros((n_rows, capacity), dtype=torch.long)
    tree = torch.zeros((n_rows, capacity, capacity), dtype=torch.bool) \
        if kind in TREE_KINDS else None
    causal = torch.ones(capacity, capacity, dtype=torch.bool).tril()
    rows = torch.zeros((batch.num_rows, t), dtype=torch.long)
    cols = torch.zeros((batch.num_rows, t), dtype=torch.long)
    starts = batch.completion_start.tolist()
    lens = batch.seq_lens.tolist()
    segments: list[int] = []  # lengths, row after row: its samples, then its padding tail
    for r, placed in enumerate(plan):
        col = 0
        path = torch.zeros(0, dtype=torch.long)  # columns of the previous sample's tokens
        for b, share in placed:
            n = lens[b]
            new = n - share  # the tokens it does not share with the previous sample
            path = torch.cat([path[:share], torch.arange(col, col + new)])
            ids[r, col:col + new] = batch.input_ids[b, share:n]
            pos[r, col:col + new] = torch.arange(share, n)
            if tree is not None and new:
                tree[r, col:col + new, path[:share]] = True  # its ancestors
                tree[r, col:col + new, col:col + new] = causal[:new, :new]  # and itself
            c = n - starts[b]
            rows[b, :] = r
            cols[b, :c] = path[starts[b] - 1:n - 1]
            cols[b, c:] = path[n - 1]  # padding: any valid position
            segments.append(new)
            col += new
        pad = capacity - col
        pos[r, col:] = torch.arange(pad)  # a segment of its own: never seen by samples
        if pad:
            segments.append(pad)
    if tree is None:
        cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(segments, dtype=torch.int32).cumsum(0)
        return Layout(ids, pos, None, rows, cols, cu, max(segments))
    tree |= torch.eye(capacity, dtype=torch.bool)  # padding sees itself
    return Layout(ids, pos, tree.unsqueeze(1), rows, cols)


def _padded(batch: Batch) -> Layout:
    b, t = batch.completion_ids.shape
    cols = (torch.arange(t).unsqueeze(0) + batch.completion_start.unsqueeze(1) - 1)
    cols = cols.clamp(max=batch.input_ids.shape[1] - 1)
    rows = torch.arange(b).unsqueeze(1).expand(b, t)
    return Layout(batch.input_ids, None, batch.attention_mask, rows.contiguous(), cols)


def _written(shapes: list[RowShape], placed: list[Placed]) -> int:
    """Tokens ``placed`` write: each sample's own minus what it shares."""
    return sum(shapes[b].tokens - share for b, share in placed)


def _group_units(shapes: list[RowShape]) -> list[list[Placed]]:
    """``shared``'s packing units: each group's samples behind one copy of its prompt
    (the first sample whole, every other from the prompt's end)."""
    by_group: dict[int, list[int]] = {}
    for b, s in enumerate(shapes):
        by_group.setdefault(s.group, []).append(b)
    return [[(b, 0 if k == 0 else shapes[samples[0]].prompt) for k, b in enumerate(samples)]
            for samples in by_group.values()]


def _trie_rows(shapes: list[RowShape], capacity: int) -> list[list[Placed]]:
    """``trie``'s rows: samples in lexicographic order, each into the open row whose last
    sample it shares most with, among the rows it fits (the first on ties), else a new
    row. In that order a row's last sample is the one it shares most with in the row."""
    order = sorted(range(len(shapes)), key=lambda b: shapes[b].ids)
    rows: list[list[Placed]] = []
    free: list[int] = []
    for b in order:
        best, best_share = -1, -1
        for r, row in enumerate(rows):
            share = _common_tokens(shapes[row[-1][0]].ids, shapes[b].ids)
            if shapes[b].tokens - share <= free[r] and share > best_share:
                best, best_share = r, share
        if best < 0:
            rows.append([(b, 0)])
            free.append(capacity - shapes[b].tokens)
        else:
            rows[best].append((b, best_share))
            free[best] -= shapes[b].tokens - best_share
    return rows


def _chain_rows(shapes: list[RowShape], capacity: int) -> list[list[Placed]]:
    """``trie``'s other placement: samples in lexicographic order cut into chains (each
    sample joins the previous one's chain while it shares a prefix with it and the chain
    still fits), then the chains packed into rows by first-fit decreasing, as ``packed``
    packs samples (each chain a tree of its own in its row)."""
    chains: list[list[Placed]] = []
    size: list[int] = []
    for b in sorted(range(len(shapes)), key=lambda b: shapes[b].ids):
        share = _common_tokens(shapes[chains[-1][-1][0]].ids, shapes[b].ids) if chains else 0
        if share and size[-1] + shapes[b].tokens - share <= capacity:
            chains[-1].append((b, share))
            size[-1] += shapes[b].tokens - share
        else:
            chains.append([(b, 0)])
            size.append(shapes[b].tokens)
    return [[p for c in row for p in chains[c]] for row in _first_fit(size, capacity)]


def _common_tokens(a: bytes, b: bytes) -> int:
    """Tokens of the longest common prefix of two `RowShape.ids` (binary search over
    C-level prefix comparisons)."""
    lo, hi = 0, min(len(a), len(b)) // 4
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:4 * mid] == b[:4 * mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


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
