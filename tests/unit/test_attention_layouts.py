"""Packed and prefix-shared layouts give the padded logprobs under every kind of attention.

- A varlen (flash-like) attention: a recording function registered through transformers'
  ``AttentionInterface`` under its own name (wired to flash's mask function, as a `kernels`
  hub kernel is) computes attention the way ``_flash_attention_forward`` would: over the
  ``cu_seq_lens_q`` segments when it gets them, over the position-id segments when there
  is one row, and plain causal attention across each row otherwise. The packed layout must
  hand it one row or explicit segment boundaries matching the samples (each row's padding
  tail a segment of its own), never R > 1 rows without them; logprobs and gradients equal
  the padded forward's (1e-5). Such an attention is never given the ``shared`` or ``trie``
  layout: configured for a trie, it gets ``packed`` (each sample's path in full), and what
  reaches the kernel for multi-turn episodes sharing prefixes is pinned: one segment per
  sample (its whole length) and per padding tail, positions restarting per segment.
- ``eager`` adds its mask to the scores, so the tree mask must reach it as 0 / dtype-min:
  packed, shared and trie logprobs equal the padded forward's (1e-5).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_flash_attention_utils import (
    _is_packed_sequence,
    prepare_fa_kwargs_from_position_ids,
)

from benchmarks.synthetic import episode_groups, scored_groups
from pipeline.model import init_tiny_model, load_model
from trainer.batch import Batch, build_batch
from trainer.logprobs import CompletionLogprobs
from trainer.packing import layout_cost, make_layout
from trainer.setup import layout_kind

torch.set_num_threads(1)
VARLEN = "sluice_recording_varlen"  # registered like a hub kernel: neither sdpa nor eager
TEMPERATURE = 0.9


@dataclass
class Call:
    """What one attention call received (shapes as Qwen2Attention hands them over)."""

    batch_size: int
    seq_len: int
    mask: bool
    cu_seq_lens_q: list[int] | None
    cu_seq_lens_k: list[int] | None
    max_length_q: int | None
    max_length_k: int | None
    max_lengths_are_ints: bool  # flash's varlen functions want Python ints, not tensors


CALLS: list[Call] = []


def _as_list(t: Any) -> list[int] | None:
    return None if t is None else [int(x) for x in torch.as_tensor(t).tolist()]


def _recording_varlen(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Record the call, then attend as ``_flash_attention_forward`` dispatches: explicit
    varlen kwargs, else position-id packing (batch size 1 only), else causal per row."""
    b, h, s, d = query.shape
    cu = kwargs.get("cu_seq_lens_q")
    varlen = [cu, kwargs.get("cu_seq_lens_k"), kwargs.get("max_length_q"),
              kwargs.get("max_length_k")]
    CALLS.append(Call(b, s, attention_mask is not None, _as_list(varlen[0]),
                      _as_list(varlen[1]), None if varlen[2] is None else int(varlen[2]),
                      None if varlen[3] is None else int(varlen[3]),
                      all(type(x) is int for x in varlen[2:])))
    assert attention_mask is None, "a packed/padding-free forward hands flash no mask"
    position_ids = kwargs.get("position_ids")
    if all(x is not None for x in varlen):
        bounds = _as_list(cu)
    elif _is_packed_sequence(position_ids, b):
        (cu_q, _), _ = prepare_fa_kwargs_from_position_ids(position_ids)
        bounds = _as_list(cu_q)
    else:  # what flash does with several rows and no boundaries: causal across each row
        bounds = list(range(0, b * s + 1, s))
    assert bounds is not None and bounds[0] == 0 and bounds[-1] == b * s
    q, k, v = (x.transpose(1, 2).reshape(b * s, x.shape[1], d) for x in (query, key, value))
    parts = []
    for start, end in pairwise(bounds):
        seg = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k[start:end].transpose(0, 1),
            v[start:end].transpose(0, 1), is_causal=True, scale=scaling, enable_gqa=True)
        parts.append(seg.transpose(0, 1))
    out = torch.cat(parts)
    return out.reshape(b, s, h, d), None


@pytest.fixture(scope="module", autouse=True)
def _register_varlen() -> Iterator[None]:
    AttentionInterface.register(VARLEN, _recording_varlen)
    AttentionMaskInterface.register(VARLEN, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    yield
    AttentionInterface._global_mapping.pop(VARLEN, None)
    AttentionMaskInterface._global_mapping.pop(VARLEN, None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("attn") / "tiny", seed=4)


@pytest.fixture(scope="module")
def batch() -> Batch:
    groups = scored_groups(3, 4, vocab_size=76, prompt_tokens=(2, 9),
                           completion_tokens=(1, 12), seed=7)
    b = build_batch(groups, pad_id=0)
    b.mask[1, 0] = 0  # a context token (mask 0) inside a completion
    return b


def _model(model_dir: Path, attn: str) -> torch.nn.Module:
    model, _ = load_model(model_dir, attn_implementation=attn)
    assert model.config._attn_implementation == attn
    return model


def _logps(model: torch.nn.Module, batch: Batch, kind: str) -> torch.Tensor:
    fwd = CompletionLogprobs(model, TEMPERATURE, chunk_tokens=7)
    logps = fwd(make_layout(batch, kind, pad_id=0), batch)[0]  # type: ignore[arg-type]
    return logps


def _padded_logps(model_dir: Path, batch: Batch) -> torch.Tensor:
    with torch.no_grad():
        return _logps(_model(model_dir, "sdpa"), batch, "padded")


def test_the_packed_layout_has_several_rows_and_padding_tails(batch: Batch) -> None:
    """Guards the tests below: the case a flash kernel gets wrong is really exercised."""
    lay = make_layout(batch, "packed", pad_id=0)
    r, c = lay.input_ids.shape
    assert r > 1
    per_row = torch.bincount(lay.rows[:, 0], minlength=r)
    assert (per_row > 1).any()
    used = torch.zeros(r, dtype=torch.long).index_add_(0, lay.rows[:, 0], batch.seq_lens)
    assert (used < c).any()


def test_packed_segments_are_the_samples_and_each_padding_tail(batch: Batch) -> None:
    lay = make_layout(batch, "packed", pad_id=0)
    r, c = lay.input_ids.shape
    assert lay.cu_seqlens is not None and lay.cu_seqlens.dtype == torch.int32
    cu = lay.cu_seqlens.tolist()
    assert cu[0] == 0 and cu[-1] == r * c and all(a < b for a, b in pairwise(cu))
    assert set(range(0, r * c + 1, c)) <= set(cu)  # no segment crosses a row
    lens = [b - a for a, b in pairwise(cu)]
    assert lay.max_seqlen == max(lens) == int(batch.seq_lens.max())
    used = torch.zeros(r, dtype=torch.long).index_add_(0, lay.rows[:, 0], batch.seq_lens)
    tails = [c - int(u) for u in used if u < c]
    assert sorted(lens) == sorted(batch.seq_lens.tolist() + tails)
    # the same boundaries transformers would read from the position ids of one flat row
    (want, _), _ = prepare_fa_kwargs_from_position_ids(lay.position_ids.reshape(1, -1))
    assert cu == want.tolist()
    for kind in ("padded", "shared", "trie"):
        assert make_layout(batch, kind, pad_id=0).cu_seqlens is None  # type: ignore[arg-type]


def test_a_varlen_attention_gets_the_sample_boundaries(model_dir: Path, batch: Batch) -> None:
    want = _padded_logps(model_dir, batch)
    model = _model(model_dir, VARLEN)
    lay = make_layout(batch, "packed", pad_id=0)
    r, c = lay.input_ids.shape
    CALLS.clear()
    with torch.no_grad():
        got = _logps(model, batch, "packed")
    assert len(CALLS) == model.config.num_hidden_layers
    (want_cu, _), _ = prepare_fa_kwargs_from_position_ids(lay.position_ids.reshape(1, -1))
    cu = want_cu.tolist()  # the samples' and padding tails' boundaries in the flat rows
    for call in CALLS:
        assert call.batch_size * call.seq_len == r * c
        if call.batch_size > 1:  # several rows: only right with explicit boundaries
            assert call.cu_seq_lens_q is not None, "R > 1 packed rows without cu_seqlens"
            assert call.cu_seq_lens_q == call.cu_seq_lens_k == cu
            assert call.max_length_q == call.max_length_k == int(batch.seq_lens.max())
            assert call.max_lengths_are_ints
    m = batch.mask > 0
    torch.testing.assert_close(got[m], want[m], atol=1e-5, rtol=0)


def test_varlen_packed_gradients_equal_the_padded_ones(model_dir: Path, batch: Batch) -> None:
    grads = {}
    for attn, kind in (("sdpa", "padded"), (VARLEN, "packed")):
        model = _model(model_dir, attn)
        model.train()
        (_logps(model, batch, kind) * batch.mask).sum().backward()
        grads[kind] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads["padded"].keys() == grads["packed"].keys()
    for name, g in grads["padded"].items():
        torch.testing.assert_close(grads["packed"][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_a_varlen_attention_never_gets_the_tree_mask(model_dir: Path, batch: Batch) -> None:
    model = _model(model_dir, VARLEN)
    cfg = SimpleNamespace(trainer=SimpleNamespace(packing=True, prefix_sharing=True))
    assert layout_kind(cfg, model) == "packed"  # type: ignore[arg-type]
    assert layout_kind(cfg, _model(model_dir, "eager")) == "shared"  # type: ignore[arg-type]
    with torch.no_grad(), pytest.raises(ValueError, match="4D"):
        _logps(model, batch, "shared")


def test_a_varlen_attention_configured_for_a_trie_gets_each_sample_in_full(
        model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``prefix_sharing = "trie"`` on a varlen kernel: `layout_kind` falls back to
    ``packed`` and says why; the kernel gets every sample as one segment of its full
    length (shared prefixes written again), positions 0..n-1 in each, and the logprobs
    of the padded forward."""
    episodes = build_batch(episode_groups(2, 4, vocab_size=76, prompt_tokens=(3, 8),
                                          turns=(2, 3), turn_tokens=(2, 6),
                                          observation_tokens=(2, 4), repeat=0.7, seed=2),
                           pad_id=0)
    assert layout_cost(episodes, "trie") < layout_cost(episodes, "packed")  # it shares
    model = _model(model_dir, VARLEN)
    cfg = SimpleNamespace(trainer=SimpleNamespace(packing=True, prefix_sharing="trie"))
    with caplog.at_level(logging.INFO, logger="sluice.trainer"):
        kind = layout_kind(cfg, model)  # type: ignore[arg-type]
    assert kind == "packed" and "takes no tree mask" in caplog.text
    assert layout_kind(cfg, _model(model_dir, "sdpa")) == "trie"  # type: ignore[arg-type]
    want = _padded_logps(model_dir, episodes)
    lay = make_layout(episodes, kind, pad_id=0)
    r, c = lay.input_ids.shape
    assert r > 1 and lay.cu_seqlens is not None and lay.position_ids is not None
    CALLS.clear()
    with torch.no_grad():
        got = _logps(model, episodes, kind)
    cu = lay.cu_seqlens.tolist()
    lens = [b - a for a, b in pairwise(cu)]
    used = torch.zeros(r, dtype=torch.long).index_add_(0, lay.rows[:, 0], episodes.seq_lens)
    assert sorted(lens) == sorted(episodes.seq_lens.tolist() + [c - int(u) for u in used
                                                                if u < c])
    flat = lay.position_ids.reshape(-1)
    for a, b in pairwise(cu):
        assert flat[a:b].tolist() == list(range(b - a))
    assert len(CALLS) == model.config.num_hidden_layers
    for call in CALLS:
        assert not call.mask and call.batch_size == r
        assert call.cu_seq_lens_q == call.cu_seq_lens_k == cu
        assert call.max_length_q == call.max_length_k == int(episodes.seq_lens.max())
        assert call.max_lengths_are_ints
    m = episodes.mask > 0
    torch.testing.assert_close(got[m], want[m], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["packed", "shared", "trie"])
def test_eager_layouts_equal_the_padded_logprobs(model_dir: Path, batch: Batch,
                                                 kind: str) -> None:
    want = _padded_logps(model_dir, batch)
    model = _model(model_dir, "eager")
    with torch.no_grad():
        got = _logps(model, batch, kind)
        eager_padded = _logps(model, batch, "padded")
    m = batch.mask > 0
    torch.testing.assert_close(eager_padded[m], want[m], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[m], want[m], atol=1e-5, rtol=0, msg=kind)


def test_eager_shared_under_bf16_autocast_is_close_to_padded(model_dir: Path,
                                                             batch: Batch) -> None:
    """The additive mask in the autocast dtype still masks (bf16 noise only)."""
    model = _model(model_dir, "eager")
    out = {}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for kind in ("padded", "shared"):
            out[kind] = _logps(model, batch, kind)
    m = batch.mask > 0
    torch.testing.assert_close(out["shared"][m], out["padded"][m], atol=0.1, rtol=0)
