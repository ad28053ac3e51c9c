"""run.json (`pipeline.rundir`): the model pinned once per run, the config a resume must
bring, and what ``--fresh`` may delete; through a real HF cache layout, offline."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from pipeline.config import Config, ConfigError, load_config
from pipeline.rundir import (
    RUN_FILE,
    check_fresh,
    config_changes,
    is_resumable,
    pin_run,
    pinned_config,
    read_run,
    write_first,
)
from sluice.cli import main as sluice
from tests.helpers import add_hub_snapshot, build_bpe_model

SHA1, SHA2 = "a" * 40, "b" * 40
REPO = "tiny-org/tiny-bpe"


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bpe_model(tmp_path_factory.mktemp("bpe") / "model")


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bpe_dir: Path) -> Path:
    """HF_HOME offline with REPO at SHA1 on refs/main."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    add_hub_snapshot(home, REPO, bpe_dir, SHA1)
    return home


def _cfg(out: Path, *sets: str, model: str = REPO) -> Config:
    return load_config(None, [f"run.output_dir={out}", f"model.path={model}", *sets])


def test_run_json_pins_the_hub_commit_with_the_config_as_given(hf_home: Path,
                                                              tmp_path: Path) -> None:
    cfg = _cfg(tmp_path / "run")
    used = pinned_config(cfg)
    saved = json.loads((tmp_path / "run" / RUN_FILE).read_text())
    snap = hf_home / "hub" / "models--tiny-org--tiny-bpe" / "snapshots" / SHA1
    assert saved == {"format": 1, "config": cfg.model_dump(mode="json"),
                     "model": {"source": REPO, "local_dir": str(snap.resolve()),
                               "revision": SHA1}}
    assert saved["config"]["model"]["path"] == REPO  # as given, not the snapshot
    assert used.model.path == str(snap.resolve())  # roles load the pinned folder


def test_resume_keeps_the_pinned_commit_after_the_branch_moves(
        hf_home: Path, bpe_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _cfg(tmp_path / "run")
    assert pin_run(cfg).revision == SHA1  # type: ignore[union-attr]
    add_hub_snapshot(hf_home, REPO, bpe_dir, SHA2)  # a new commit; refs/main moves to it
    again = pin_run(cfg)
    assert again is not None and again.revision == SHA1 and again.local_dir.endswith(SHA1)
    err = capsys.readouterr().err
    assert f"now points to {SHA2[:12]}" in err and f"keeps its pinned commit {SHA1[:12]}" in err
    other = pin_run(_cfg(tmp_path / "other"))  # a new run takes the new commit
    assert other is not None and other.revision == SHA2
    assert read_run(tmp_path / "run")["model"]["revision"] == SHA1  # type: ignore[index]


def test_a_folder_is_pinned_by_path_however_it_is_spelled(
        bpe_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    model = pin_run(_cfg(out, model=str(bpe_dir)))
    assert model is not None and model.revision is None
    assert read_run(out)["model"] == {  # type: ignore[index]
        "source": str(bpe_dir), "local_dir": str(bpe_dir.resolve()), "revision": None}
    monkeypatch.chdir(bpe_dir.parent)
    assert pin_run(_cfg(out, model="./model")) == model  # same folder: no change


def test_first_writer_wins_when_roles_start_together(hf_home: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert write_first(out, {"format": 1, "n": 1}) and not write_first(out, {"format": 1})
    assert json.loads((out / RUN_FILE).read_text())["n"] == 1
    out2 = tmp_path / "run2"
    cfg = _cfg(out2)
    results, errors = [], []

    def start() -> None:
        try:
            results.append(pin_run(cfg))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=start) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 6 and len(set(results)) == 1
    assert [p.name for p in out2.iterdir()] == [RUN_FILE]  # no temp file left behind


def test_changed_config_is_refused_naming_each_key_old_and_new(hf_home: Path,
                                                               tmp_path: Path) -> None:
    out = tmp_path / "run"
    pin_run(_cfg(out))
    before = (out / RUN_FILE).read_text()
    with pytest.raises(ConfigError) as e:
        pin_run(_cfg(out, "trainer.lr=3e-4", "generation.num_generations=4",
                     "trainer.max_steps=999"))
    msg = str(e.value)
    assert "trainer.lr: 0.0001 → 0.0003" in msg
    assert "generation.num_generations: 8 → 4" in msg
    assert "trainer.max_steps" not in msg  # allowed: not listed among the refusals
    assert "--allow-config-change" in msg
    assert (out / RUN_FILE).read_text() == before


def test_allowed_keys_change_without_the_flag_and_only_up_records_them(
        hf_home: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    pin_run(_cfg(out))
    before = (out / RUN_FILE).read_text()
    resumed = _cfg(out, "trainer.max_steps=500", "bus.block_ms=50", "up.generators=3",
                   "trainer.threads=4", "generation.vllm.urls=['http://h:1']",
                   "run.max_time_s=60")
    assert pin_run(resumed) is not None
    assert (out / RUN_FILE).read_text() == before  # a single role leaves run.json alone
    pin_run(resumed, record_allowed=True)  # `sluice up`: the whole run moves
    assert read_run(out)["config"]["trainer"]["max_steps"] == 500  # type: ignore[index]
    assert len(list(out.glob(f"{RUN_FILE}.prev-*"))) == 1


def test_allow_config_change_replaces_the_config_and_keeps_the_previous(
        hf_home: Path, bpe_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    pin_run(_cfg(out))
    model = pin_run(_cfg(out, "trainer.lr=3e-4", model=str(bpe_dir)),
                    allow_config_change=True)
    assert model is not None and model.revision is None  # the model changed: pinned anew
    saved = read_run(out)
    assert saved["config"]["trainer"]["lr"] == 3e-4  # type: ignore[index]
    assert saved["model"]["local_dir"] == str(bpe_dir.resolve())  # type: ignore[index]
    (prev,) = out.glob(f"{RUN_FILE}.prev-*")
    assert json.loads(prev.read_text())["model"]["revision"] == SHA1
    pin_run(_cfg(out, "trainer.lr=3e-4", model=str(bpe_dir)))  # now the run's config


def test_the_scorer_never_creates_a_pin(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path / "run", model="no-org/not-needed")
    assert pin_run(cfg, resolve=False) is None and not (tmp_path / "run").exists()


def test_resumable_keys() -> None:
    for key in ("trainer.max_steps", "up.scorers", "bus.redis_url", "generation.vllm.urls",
                "trainer.device", "run.max_time_s"):
        assert is_resumable(key), key
    for key in ("trainer.lr", "model.path", "generation.vllm.max_model_len", "run.seed",
                "upx.a", "scoring.rewards"):
        assert not is_resumable(key), key
    old = Config().model_dump(mode="json")
    new = load_config(None, ["model.lora={rank=4}"]).model_dump(mode="json")
    (change,) = config_changes(old, new)  # an optional table set: one change, whole
    assert change.key == "model.lora" and change.old is None and change.new["rank"] == 4
    changed = load_config(None, ["model.lora={rank=8}"]).model_dump(mode="json")
    assert [str(c) for c in config_changes(new, changed)] == ["model.lora.rank: 4 → 8"]


def test_fresh_deletes_only_a_run_directory(tmp_path: Path) -> None:
    check_fresh(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    check_fresh(tmp_path / "empty")
    data = tmp_path / "data"
    data.mkdir()
    (data / "thesis.tex").write_text("years of work")
    with pytest.raises(ConfigError, match="--fresh refuses to delete"):
        check_fresh(data)
    (data / "metrics.jsonl").write_text("")
    check_fresh(data)


def test_cli_refuses_a_changed_resume_and_a_foreign_fresh_before_starting(
        hf_home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    pin_run(_cfg(out))
    base = ["--set", f"run.output_dir={out}", "--set", f"model.path={REPO}",
            "--set", "trainer.device=cpu"]
    cfg = tmp_path / "run.toml"
    cfg.write_text("")
    assert sluice(["train", str(cfg), *base, "--set", "trainer.lr=0.01"]) == 2
    assert "trainer.lr: 0.0001 → 0.01" in capsys.readouterr().err
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    assert sluice(["up", str(cfg), "--fresh", "--set", f"run.output_dir={foreign}"]) == 2
    assert "--fresh refuses to delete" in capsys.readouterr().err
    assert (foreign / "keep.txt").read_text() == "mine"
