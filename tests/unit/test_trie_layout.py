"""The ``trie`` layout (`trainer.packing`): every prefix that samples share is forwarded
once per row, and logprobs and gradients equal the padded forward's (1e-5, CPU) under
sdpa's boolean tree mask and eager's additive one.

- Property (hypothesis): random batches whose samples branch off earlier ones at random
  depths (inside the prompt, at its end, deep in the completion, identical samples),
  with random prompt/completion boundaries, groups and loss masks: trie logprobs equal
  padded ones; ``input_ids.numel()`` is `layout_cost`; each row writes exactly the
  distinct prefixes of its samples; each position sees exactly its ancestors and itself;
  no row is longer than the longest sample, and there are never more rows than packed.
- Multi-turn episodes (`benchmarks.synthetic.episode_groups`): the trie shares past the
  prompt, forwards fewer positions than packed, and scores fewer attention pairs than
  ``shared`` (whose rows hold whole groups); gradients equal padded ones.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from benchmarks.synthetic import episode_groups
from pipeline.config import ConfigError, load_config
from pipeline.model import init_tiny_model, load_model
from trainer.batch import Batch, build_batch
from trainer.logprobs import CompletionLogprobs
from trainer.packing import layout_cost, layout_stats, make_layout, plan_rows, row_shapes

torch.set_num_threads(1)
TEMPERATURE = 0.9


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.nn.Module]:
    d = init_tiny_model(tmp_path_factory.mktemp("trie") / "tiny", seed=6)
    return {attn: load_model(d, attn_implementation=attn)[0] for attn in ("sdpa", "eager")}


def _batch(seqs: list[list[int]], starts: list[int], groups: list[int],
           masks: list[list[int]]) -> Batch:
    """A padded batch of the given token sequences (completion = seq[start:])."""
    b, width = len(seqs), max(map(len, seqs))
    t = max(len(s) - p for s, p in zip(seqs, starts, strict=True))
    ids = torch.zeros(b, width, dtype=torch.long)
    attn = torch.zeros(b, width, dtype=torch.long)
    comp = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t)
    for i, (s, p, m) in enumerate(zip(seqs, starts, masks, strict=True)):
        ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
        comp[i, :len(s) - p] = torch.tensor(s[p:])
        mask[i, :len(s) - p] = torch.tensor(m, dtype=torch.float32)
    return Batch(ids, attn, torch.tensor(starts), comp, torch.zeros(b, t), mask,
                 torch.ones(b), torch.zeros(b, t, dtype=torch.long),
                 group=torch.tensor(groups))


@st.composite
def shared_prefix_batches(draw: st.DrawFn) -> Batch:
    """Samples that each fork off an earlier one at a random depth (0 = a fresh one),
    then go on with fresh tokens from a small alphabet (more accidental sharing)."""
    token = st.integers(4, 9)
    seqs: list[list[int]] = []
    for _ in range(draw(st.integers(1, 7))):
        base: list[int] = []
        if seqs and draw(st.booleans()):
            parent = seqs[draw(st.integers(0, len(seqs) - 1))]
            base = parent[:draw(st.integers(0, len(parent)))]
        tail = draw(st.lists(token, min_size=max(0, 2 - len(base)), max_size=10))
        seqs.append(base + tail)
    starts = [draw(st.integers(1, len(s) - 1)) for s in seqs]
    groups = [draw(st.integers(0, 2)) for _ in seqs]
    masks = [draw(st.lists(st.integers(0, 1), min_size=len(s) - p, max_size=len(s) - p))
             for s, p in zip(seqs, starts, strict=True)]
    if not any(map(any, masks)):
        masks[0][0] = 1
    return _batch(seqs, starts, groups, masks)


def _logps(model: torch.nn.Module, batch: Batch, kind: str) -> torch.Tensor:
    fwd = CompletionLogprobs(model, TEMPERATURE, chunk_tokens=7)
    return fwd(make_layout(batch, kind, pad_id=0), batch)[0]  # type: ignore[arg-type]


def _sample(batch: Batch, b: int) -> tuple[int, ...]:
    return tuple(batch.input_ids[b, :int(batch.seq_lens[b])].tolist())


def _check_structure(batch: Batch) -> None:
    lay = make_layout(batch, "trie", pad_id=0)
    c = lay.input_ids.shape[1]
    assert lay.input_ids.numel() == layout_cost(batch, "trie")
    assert c == int(batch.seq_lens.max())
    assert layout_cost(batch, "trie") <= layout_cost(batch, "packed")
    plan, _ = plan_rows(row_shapes(batch), "trie")
    assert sorted(b for row in plan for b, _ in row) == list(range(batch.num_rows))
    assert lay.attention_mask is not None and lay.position_ids is not None
    seen = lay.attention_mask[:, 0].sum(-1)  # [R, C]: keys each query sees
    for k, row in enumerate(plan):
        prefixes = {_sample(batch, b)[:n] for b, _ in row
                    for n in range(1, int(batch.seq_lens[b]) + 1)}
        written = sum(int(batch.seq_lens[b]) - share for b, share in row)
        assert written == len(prefixes)  # every shared prefix once, nothing else twice
        assert (seen[k, :written] == lay.position_ids[k, :written] + 1).all()
        assert (seen[k, written:] == 1).all()  # padding sees itself only


# Found by the property below in a full-suite run: two chains that share only (6,) cut
# apart by the row width, then packed into one row by first fit, wrote 6 twice.
TWO_CHAINS_ONE_ROW = _batch(
    [[6, 4, 4], [6, 4, 5, 4, 4, 4, 4, 4, 4, 4, 4, 4], [4, 4], [7, 4, 4, 4], [6, 5],
     [7, 4, 4, 4, 4, 4, 4, 4, 4, 4]], [1, 11, 1, 3, 1, 9], [0] * 6,
    [[1, 0], [0], [0], [0], [0], [0]])


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=shared_prefix_batches())
@example(batch=TWO_CHAINS_ONE_ROW)
def test_trie_equals_padded_on_random_shared_prefixes(models: dict[str, torch.nn.Module],
                                                      batch: Batch) -> None:
    _check_structure(batch)
    m = batch.mask > 0
    with torch.no_grad():
        want = _logps(models["sdpa"], batch, "padded")
        for attn, model in models.items():
            got = _logps(model, batch, "trie")
            torch.testing.assert_close(got[m], want[m], atol=1e-5, rtol=0, msg=attn)


@pytest.fixture(scope="module")
def episodes() -> Batch:
    return build_batch(episode_groups(3, 4, vocab_size=76, prompt_tokens=(3, 10),
                                      turns=(1, 4), turn_tokens=(2, 8),
                                      observation_tokens=(2, 6), repeat=0.6, seed=1),
                       pad_id=0)


def test_multi_turn_episodes_share_past_the_prompt(episodes: Batch) -> None:
    shapes = row_shapes(episodes)
    plan, _ = plan_rows(shapes, "trie")
    assert any(share > shapes[b].prompt for row in plan for b, share in row)
    assert layout_cost(episodes, "trie") < layout_cost(episodes, "packed")
    trie, shared = (layout_stats([episodes], k) for k in ("trie", "shared"))
    assert trie["sample/forwarded_tokens_mean"] < shared["sample/forwarded_tokens_mean"] * 1.2
    pairs = {k: make_layout(episodes, k, 0).input_ids.shape for k in ("trie", "shared")}
    r, c = pairs["trie"]  # what a dense mask scores: rows x columns^2
    assert r * c * c < pairs["shared"][0] * pairs["shared"][1] ** 2
    _check_structure(episodes)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_multi_turn_trie_gradients_equal_the_padded_ones(
        models: dict[str, torch.nn.Module], episodes: Batch, attn: str) -> None:
    grads = {}
    for kind in ("padded", "trie"):
        model = models[attn]
        model.zero_grad()
        (_logps(model, episodes, kind) * episodes.mask).sum().backward()
        grads[kind] = {n: p.grad.clone() for n, p in model.named_parameters()
                       if p.grad is not None}
    model.zero_grad()
    assert grads["padded"].keys() == grads["trie"].keys()
    for name, g in grads["padded"].items():
        torch.testing.assert_close(grads["trie"][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_prefix_sharing_takes_trie_and_refuses_other_names() -> None:
    assert load_config(None, ["trainer.prefix_sharing=trie"]).trainer.prefix_sharing == "trie"
    assert load_config(None, ["trainer.prefix_sharing=true"]).trainer.prefix_sharing is True
    with pytest.raises(ConfigError, match=r"trainer\.prefix_sharing"):
        load_config(None, ["trainer.prefix_sharing=tree"])
