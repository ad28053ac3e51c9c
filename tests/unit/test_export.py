"""`sluice export`: run directories made by the real weight transports and checkpointer,
exported, loaded back with transformers / peft, and compared logit for logit.

A run directory here is what a run leaves: ``run.json`` (written by the test following
its contract), versions published through `pipeline.weights.make_transport` (what
the trainer publishes with) and checkpoints written by `trainer.checkpoint.Checkpointer`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from pipeline.config import Config
from pipeline.model import apply_lora, init_tiny_model, load_model, load_tokenizer
from pipeline.weights import MANIFEST, WeightError, make_transport
from sluice.cli import main as cli_main
from sluice.export import ExportError, export_run
from trainer.checkpoint import Checkpointer, TrainerState

ROOT = Path(__file__).resolve().parents[2]
X = torch.tensor([[10, 11, 12, 13, 66, 20, 21, 22, 5, 7]])
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def make_config(run_dir: Path, model_dir: Path, lora: dict[str, Any] | None = None) -> Config:
    return Config.model_validate({"run": {"output_dir": str(run_dir)},
                                  "model": {"path": str(model_dir), "lora": lora}})


def write_run_json(cfg: Config, model_dir: Path) -> None:
    """run.json as the run writes it at start (the contract in sluice/export.py)."""
    cfg.output_path.mkdir(parents=True, exist_ok=True)
    (cfg.output_path / "run.json").write_text(json.dumps(
        {"format": 1, "config": cfg.model_dump(mode="json"),
         "model": {"source": str(model_dir), "local_dir": str(model_dir.resolve()),
                   "revision": None}}))


def perturbed(model: torch.nn.Module, seed: int, scale: float = 0.05) -> torch.nn.Module:
    """Every parameter moved in place (a tied lm_head stays tied)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model


def lora_trained(model_dir: Path, seed: int) -> torch.nn.Module:
    """The base wrapped with the run's adapter, A and B random (B non-zero)."""
    base, _ = load_model(model_dir)
    model = apply_lora(base, make_config(Path("."), model_dir, LORA).model.lora, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def make_run(tmp: Path, *, tied: bool = False, lora: bool = False, versions: int = 2,
             run_json: bool = True, base: Path | None = None
             ) -> tuple[Config, Path, dict[int, torch.nn.Module]]:
    """A run directory on ``base`` (default: a new tiny model) with ``versions``
    published versions (v1.., step 10*v) of perturbed weights; returns (config, base
    folder, {version: the published model})."""
    model_dir = base or init_tiny_model(tmp / "base", seed=0, tie_word_embeddings=tied)
    cfg = make_config(tmp / "run", model_dir, LORA if lora else None)
    if run_json:
        write_run_json(cfg, model_dir)
    transport = make_transport(cfg)
    published = {}
    for v in range(1, versions + 1):
        model = lora_trained(model_dir, v) if lora else perturbed(load_model(model_dir)[0], v)
        transport.write(model, version=v, step=10 * v)
        published[v] = model
    return cfg, model_dir, published


@torch.no_grad()
def logits(model: torch.nn.Module) -> torch.Tensor:
    return model(X).logits


def load_export(out: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(out, local_files_only=True,
                                                dtype=torch.float32).eval()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_exported_folder_loads_and_computes_the_published_logits(tmp_path: Path,
                                                                 tied: bool) -> None:
    cfg, model_dir, published = make_run(tmp_path, tied=tied)
    lines: list[str] = []
    done = export_run(cfg.output_path, tmp_path / "out", log=lines.append)
    assert (done.source.kind, done.source.version, done.source.step) == ("version", 2, 20)
    out = tmp_path / "out"
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "model.safetensors"):
        assert (out / name).is_file(), name
    assert done.files == {p.name: p.stat().st_size for p in out.iterdir()}
    assert not list(tmp_path.glob(".out.tmp-*"))  # the temporary folder was renamed
    model = load_export(out)
    assert torch.equal(logits(model), logits(published[2]))
    assert not torch.equal(logits(model), logits(load_model(model_dir)[0]))  # not the base
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert ("lm_head.weight" in names) is not tied  # no duplicated lm_head when tied
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the base's, byte for byte
        assert (out / name).read_bytes() == (model_dir / name).read_bytes()
    assert load_tokenizer(out)("ab 1+2").input_ids == [14, 15, 66, 5, 68, 6]


def test_version_picks_a_published_version_and_a_corrupt_newest_is_skipped(
        tmp_path: Path) -> None:
    cfg, _, published = make_run(tmp_path, versions=3)
    run = cfg.output_path
    done = export_run(run, tmp_path / "v1", version=1)
    assert (done.source.version, done.source.step) == (1, 10)
    assert torch.equal(logits(load_export(tmp_path / "v1")), logits(published[1]))

    shard = next((run / "weights" / "v00000003").glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the newest version's weights
    shard.write_bytes(bytes(data))
    lines: list[str] = []
    done = export_run(run, tmp_path / "newest", log=lines.append)
    assert done.source.version == 2
    assert any("skipping published v3" in s and "sha256" in s for s in lines), lines
    with pytest.raises(WeightError, match="sha256"):
        export_run(run, tmp_path / "v3", version=3)
    assert not (tmp_path / "v3").exists()
    with pytest.raises(ExportError, match=r"no published version 7 .*v1, v2, v3"):
        export_run(run, tmp_path / "v7", version=7)


def test_without_published_versions_the_newest_checkpoint_is_exported(tmp_path: Path) -> None:
    cfg, model_dir, _ = make_run(tmp_path, versions=0)
    ckpt = Checkpointer(cfg.output_path / "checkpoints")
    for step in (3, 5):
        model = perturbed(load_model(model_dir)[0], step)
        ckpt.save(model, torch.optim.AdamW(model.parameters()),
                  TrainerState(step=step, version=step - 1))
    done = export_run(cfg.output_path, tmp_path / "out")
    assert (done.source.kind, done.source.step, done.source.version) == ("checkpoint", 5, 4)
    assert torch.equal(logits(load_export(tmp_path / "out")), logits(model))


def test_lora_run_exports_its_adapter_or_the_merged_weights(tmp_path: Path) -> None:
    from peft import AutoPeftModelForCausalLM

    cfg, model_dir, published = make_run(tmp_path, lora=True)
    want = logits(published[2])
    assert not torch.allclose(want, logits(load_model(model_dir)[0]), atol=1e-3)

    done = export_run(cfg.output_path, tmp_path / "adapter")
    assert done.what == "LoRA adapter"
    adapter = tmp_path / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(
        done.files)
    acfg = json.loads((adapter / "adapter_config.json").read_text())
    assert acfg["base_model_name_or_path"] == str(model_dir.resolve())
    assert (acfg["r"], acfg["lora_alpha"]) == (4, 8.0)
    peft_model = AutoPeftModelForCausalLM.from_pretrained(adapter, local_files_only=True).eval()
    torch.testing.assert_close(logits(peft_model), want, rtol=0, atol=1e-6)

    done = export_run(cfg.output_path, tmp_path / "merged", merge_lora=True)
    assert done.what == "merged LoRA" and "model.safetensors" in done.files
    merged = load_export(tmp_path / "merged")
    assert not any("lora" in k for k in merged.state_dict())
    torch.testing.assert_close(logits(merged), want, rtol=0, atol=1e-4)


def test_lora_checkpoint_exports_and_a_hub_base_is_named_by_its_id(tmp_path: Path) -> None:
    cfg, model_dir, _ = make_run(tmp_path, lora=True, versions=0)
    model = lora_trained(model_dir, 5)
    Checkpointer(cfg.output_path / "checkpoints").save(
        model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]),
        TrainerState(step=5, version=2))
    done = export_run(cfg.output_path, tmp_path / "merged", merge_lora=True)
    assert (done.source.kind, done.source.step) == ("checkpoint", 5)
    torch.testing.assert_close(logits(load_export(tmp_path / "merged")), logits(model),
                               rtol=0, atol=1e-4)

    run_json = cfg.output_path / "run.json"  # as if model.path had been a hub id
    doc = json.loads(run_json.read_text())
    doc["model"].update(source="someone/tiny-char", revision="0" * 40)
    run_json.write_text(json.dumps(doc))
    export_run(cfg.output_path, tmp_path / "adapter")
    acfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert acfg["base_model_name_or_path"] == "someone/tiny-char"


def test_lora_settings_that_disagree_with_the_published_adapter_are_refused(
        tmp_path: Path) -> None:
    cfg, model_dir, _ = make_run(tmp_path, lora=True, versions=1)
    wrong = make_config(cfg.output_path, model_dir, {**LORA, "alpha": 16.0})
    write_run_json(wrong, model_dir)
    with pytest.raises(ExportError, match="lora_alpha"):
        export_run(cfg.output_path, tmp_path / "out", merge_lora=True)


def test_bad_inputs_fail_with_a_message(tmp_path: Path) -> None:
    cfg, model_dir, _ = make_run(tmp_path, versions=1)
    run = cfg.output_path
    empty = tmp_path / "empty-run"
    write_run_json(make_config(empty, model_dir), model_dir)
    with pytest.raises(ExportError, match="no weights to export"):
        export_run(empty, tmp_path / "x")
    with pytest.raises(ExportError, match="--merge-lora: this run trained full weights"):
        export_run(run, tmp_path / "x", merge_lora=True)
    assert not (tmp_path / "x").exists()

    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty; give --force"):
        export_run(run, out)
    assert (out / "keep.txt").read_text() == "mine"
    export_run(run, out, force=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    with pytest.raises(ExportError, match="refusing to replace it"):
        export_run(run, tmp_path, force=True)  # would delete the run itself

    (run / "run.json").unlink()
    with pytest.raises(ExportError, match=r"no run.json .*--config RUN_TOML"):
        export_run(run, tmp_path / "y")
    toml = tmp_path / "run.toml"
    toml.write_text(f'[run]\noutput_dir = "{run}"\n[model]\npath = "{model_dir}"\n')
    assert export_run(run, tmp_path / "y", config=toml).source.version == 1


def test_cli_prints_what_it_wrote_and_reports_errors(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    cfg, _, _ = make_run(tmp_path, versions=1)
    out = tmp_path / "out"
    assert cli_main(["export", str(cfg.output_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "exported v1, step 10: full weights" in printed and str(out) in printed
    total = sum(p.stat().st_size for p in out.iterdir())
    assert f"{total:,} bytes" in printed
    assert cli_main(["export", str(cfg.output_path), "--out", str(out)]) == 2
    assert "is not empty; give --force" in capsys.readouterr().err
    assert cli_main(["export", str(cfg.output_path), "--out", str(tmp_path / "o"),
                     "--version", "9"]) == 2
    assert "published versions: v1" in capsys.readouterr().err


@pytest.mark.parametrize("env, message", [
    ({"HF_HUB_OFFLINE": "1", "HF_TOKEN": "hf_not_a_real_token"}, "HF_HUB_OFFLINE is set"),
    ({"HF_HUB_OFFLINE": "0"}, "no Hugging Face token"),
], ids=["offline", "no-token"])
def test_push_to_hub_fails_with_a_message_before_exporting(
        tmp_path: Path, env: dict[str, str], message: str) -> None:
    """Only the wiring: no test reaches the Hub. A fresh process, so that the hub
    library reads this environment (HF_HOME empty: no stored token)."""
    cfg, _, _ = make_run(tmp_path, versions=1)
    clean = {k: v for k, v in os.environ.items()
             if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE",
                          "TRANSFORMERS_OFFLINE")}
    proc = subprocess.run(
        [sys.executable, "-m", "sluice.cli", "export", str(cfg.output_path), "--out",
         str(tmp_path / "out"), "--push-to-hub", "someone/tiny"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**clean, "HF_HOME": str(tmp_path / "hf"), **env})
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_manifest_of_another_version_is_refused(tmp_path: Path) -> None:
    cfg, _, _ = make_run(tmp_path, versions=2)
    weights = cfg.output_path / "weights"
    man = json.loads((weights / "v00000002" / MANIFEST).read_text())
    man["version"] = 1
    (weights / "v00000002" / MANIFEST).write_text(json.dumps(man))
    with pytest.raises(WeightError, match="the manifest is for v1"):
        export_run(cfg.output_path, tmp_path / "out", version=2)
