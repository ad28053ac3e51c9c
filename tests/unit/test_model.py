"""Tokenizer and tiny-model construction/loading (pipeline/model.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.model import (
    build_char_tokenizer,
    init_tiny_model,
    load_model,
    model_state_for_publish,
)

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0)


def test_tokenizer_vocab_and_special_ids() -> None:
    tok = build_char_tokenizer()
    assert len(tok) == 76
    assert len(tok.get_vocab()) == 76
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.chat_template is None
    regular = [t for t, i in tok.get_vocab().items() if i >= 4]
    assert all(len(t) == 1 for t in regular)
    for ch in "0123456789azAZ =+-*,.:?!":
        assert ch in tok.get_vocab()


def test_encode_adds_no_specials_and_splits_per_char() -> None:
    tok = build_char_tokenizer()
    ids = tok("12345=")["input_ids"]
    assert len(ids) == 6
    assert not set(ids) & {0, 1, 2, 3}
    assert tok.encode("a b", add_special_tokens=True) == [
        tok.convert_tokens_to_ids(c) for c in "a b"
    ]
    assert tok("~")["input_ids"] == [tok.unk_token_id]  # unknown char -> unk, not dropped


def test_decode_round_trip() -> None:
    tok = build_char_tokenizer()
    text = "Q: 12*3+4 = ? A: 40, yes! x-y.z"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids, skip_special_tokens=True) == text
    wrapped = [tok.bos_token_id, *ids, tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(wrapped, skip_special_tokens=True) == text


def test_tokenizer_survives_save_and_load(model_dir: Path) -> None:
    _, tok = load_model(model_dir)
    assert len(tok) == 76 and tok.eos_token_id == 1 and tok.pad_token_id == 0
    ref = build_char_tokenizer()
    text = "7+8=15 ok"
    assert tok(text)["input_ids"] == ref(text)["input_ids"]
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text


def test_load_model_config(model_dir: Path) -> None:
    model, _ = load_model(model_dir)
    assert not model.training
    cfg = model.config
    assert cfg.model_type == "qwen2"
    assert cfg.vocab_size == 76 and not cfg.tie_word_embeddings
    assert (cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id) == (1, 0, 2)
    gen = model.generation_config
    assert (gen.eos_token_id, gen.pad_token_id, gen.bos_token_id) == (1, 0, 2)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert emb.data_ptr() != head.data_ptr()
    assert model(torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, 76)


def test_init_is_deterministic_per_seed(tmp_path: Path) -> None:
    a = load_model(init_tiny_model(tmp_path / "a", seed=7))[0].state_dict()
    b = load_model(init_tiny_model(tmp_path / "b", seed=7))[0].state_dict()
    c = load_model(init_tiny_model(tmp_path / "c", seed=8))[0].state_dict()
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    # Atomic write: only the final directories remain, no temp leftovers.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]


def test_init_refuses_non_empty_dir_but_accepts_empty(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="non-empty"):
        init_tiny_model(tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "x"
    (tmp_path / "empty").mkdir()
    out = init_tiny_model(tmp_path / "empty", hidden_size=32, intermediate_size=64)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


def test_publish_and_reload_state_dict(model_dir: Path, tmp_path: Path) -> None:
    src, _ = load_model(model_dir)
    sd = model_state_for_publish(src)
    assert list(sd) == list(src.state_dict())
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in sd.values())
    # Snapshot is a copy: later in-place training updates must not leak into it.
    before = sd["lm_head.weight"].clone()
    with torch.no_grad():
        src.lm_head.weight.add_(1.0)
    assert torch.equal(sd["lm_head.weight"], before)

    save_file(sd, str(tmp_path / "w.safetensors"))
    loaded = load_file(str(tmp_path / "w.safetensors"), device="cpu")
    dst = load_model(init_tiny_model(tmp_path / "other", seed=1))[0]
    dst.load_state_dict(loaded)
    ref = load_model(model_dir)[0]
    x = torch.tensor([[10, 11, 12, 67]])
    with torch.no_grad():
        assert torch.equal(dst(x).logits, ref(x).logits)
