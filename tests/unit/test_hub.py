"""Models by hub id or folder (`pipeline.hub`, `pipeline.model`), offline, through a real
Hugging Face cache layout built here, with a BPE tokenizer trained in the test (chat
template, tied embeddings) and a slow (pure Python) tokenizer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from pipeline.config import ConfigError, load_config
from pipeline.hub import cached_commit, is_hub_id, resolve_model
from pipeline.model import load_model, load_policy
from tests.helpers import add_hub_snapshot, build_bpe_model, build_slow_tokenizer_model
from workers.engines import SamplingParams
from workers.engines.transformers import TransformersEngine
from workers.tasks.prompts import render_prompt

torch.set_num_threads(1)
SHA1, SHA2 = "1" * 40, "2" * 40
REPO = "tiny-org/tiny-bpe"


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bpe_model(tmp_path_factory.mktemp("bpe") / "model")


@pytest.fixture(scope="module")
def slow_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_slow_tokenizer_model(tmp_path_factory.mktemp("slow") / "model")


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HF_HOME, offline: nothing may reach the network."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_hub_ids_and_folders_are_told_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("org/name")
    for folder in ("./org/name", "../org/name", "/abs/dir", "~/models/x", "a/b/c", "gpt2",
                   "org/name/", "org/../x", ""):
        assert not is_hub_id(folder), folder
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_hub_id("org/name")  # an existing folder wins over the hub id


def test_hub_id_loads_offline_from_the_cache_at_the_ref_commit(
        bpe_dir: Path, hf_home: Path) -> None:
    snap = add_hub_snapshot(hf_home, REPO, bpe_dir, SHA1)
    got = resolve_model(REPO)
    assert (got.source, got.local_dir, got.revision) == (REPO, str(snap.resolve()), SHA1)
    model, tok = load_model(REPO)
    assert tok.chat_template and tok.is_fast and len(tok) == model.config.vocab_size
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tok.decode(tok("Copy 42= 42").input_ids) == "Copy 42= 42"
    saved = Tokenizer.from_file(str(snap / "tokenizer.json"))  # loaded as it was trained
    assert tok("Copy 42= 42 hello").input_ids == saved.encode("Copy 42= 42 hello").ids


def test_revision_selects_a_tag_or_a_commit(bpe_dir: Path, hf_home: Path) -> None:
    add_hub_snapshot(hf_home, REPO, bpe_dir, SHA1)
    add_hub_snapshot(hf_home, REPO, bpe_dir, SHA2, ref="v2")
    assert resolve_model(REPO, "v2").revision == SHA2
    assert resolve_model(REPO, SHA2).local_dir.endswith(SHA2)
    assert resolve_model(REPO, "main").revision == SHA1
    assert cached_commit(REPO, "v2") == SHA2 and cached_commit(REPO, "nope") is None
    with pytest.raises(ConfigError, match=r"model.path: 'tiny-org/tiny-bpe' \(revision v3\)"):
        resolve_model(REPO, "v3")


def test_unknown_hub_id_offline_fails_naming_the_key_and_revision(hf_home: Path) -> None:
    with pytest.raises(ConfigError) as e:
        resolve_model("no-org/no-model", "main")
    msg = str(e.value)
    assert msg.startswith("model.path: 'no-org/no-model' (revision main) is not in the local "
                          "Hugging Face cache"), msg
    assert "HF_HUB_OFFLINE=1" in msg and str(hf_home / "hub") in msg


def test_missing_folder_fails_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"model.path: no model at {tmp_path / 'none'}"):
        resolve_model(str(tmp_path / "none"))


def test_slow_tokenizer_model_loads_and_generates(slow_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, [f"model.path={slow_dir}", f"run.output_dir={tmp_path}"])
    model, tok = load_policy(cfg)
    assert not tok.is_fast and type(tok).__name__ == "ByT5Tokenizer"
    ids = render_prompt(tok, "abc")
    assert ids == [100, 101, 102]  # bytes + 3, no eos appended to a prompt
    out = _generate(model, tok, ids)
    assert all(0 <= t < len(tok) for t in out)


def _generate(model: torch.nn.Module, tok: object, ids: list[int], n: int = 2) -> list[int]:
    engine = TransformersEngine(model, tok, seed=0)  # type: ignore[arg-type]
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    groups = asyncio.run(engine.generate([ids], n, params))
    assert len(groups) == 1 and len(groups[0]) == n
    return groups[0][0].token_ids.tolist()


def test_every_role_loads_a_hub_model_with_a_chat_template(
        bpe_dir: Path, hf_home: Path, tmp_path: Path) -> None:
    """The code paths of the generator, evaluator and trainer, on ``model.path = org/name``
    (a role started by `sluice` gets the pinned folder; these resolve the hub id)."""
    from trainer.setup import build
    from workers.evaluator import Evaluator
    from workers.generator import Generator

    add_hub_snapshot(hf_home, REPO, bpe_dir, SHA1)
    cfg = load_config(None, [f"model.path={REPO}", f"run.output_dir={tmp_path / 'out'}",
                             "trainer.device=cpu", "trainer.beta=0.1", "task.heldout=4",
                             "task.num_prompts=16"])
    gen = Generator(cfg, "g0")
    ids = render_prompt(gen.tokenizer, "Copy 12=")
    assert ids[0] == gen.tokenizer.convert_tokens_to_ids("<|im_start|>")  # chat template
    assert len(_generate(gen.engine.model, gen.tokenizer, ids)) >= 1  # type: ignore[attr-defined]
    ev = Evaluator(cfg, every_s=60)
    asyncio.run(ev.run_once(version=0, step=0))
    assert ev.last and (tmp_path / "out" / "eval.jsonl").is_file()
    setup = build(cfg)
    assert setup.ref is not None  # beta > 0: the KL reference loaded from the hub id too
    assert setup.pad_id == gen.tokenizer.pad_token_id
