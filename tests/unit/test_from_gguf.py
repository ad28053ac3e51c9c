"""`model.from_gguf`: `sluice up` converts a GGUF file into a missing model folder; the
paths that need no conversion, and a wrong setting, are decided before any work."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import Config, ConfigError
from sluice.up import ensure_model


def _cfg(**model: object) -> Config:
    return Config.model_validate({"model": model})


def test_hub_id_with_from_gguf_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"model.from_gguf: .*hub id .*\./org/name"):
        ensure_model(_cfg(path="org/name", from_gguf="/x/model.gguf"))


def test_existing_folder_is_not_converted_again(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    ensure_model(_cfg(path=str(tmp_path), from_gguf=str(tmp_path / "missing.gguf")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_missing_gguf_file_fails_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ConfigError, match=r"model.from_gguf: no such file: .*nope\.gguf"):
        ensure_model(_cfg(path=str(tmp_path / "model"), from_gguf=str(missing)))
    assert not (tmp_path / "model").exists()
