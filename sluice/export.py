"""`sluice export`: a run's weights as a Hugging Face model folder.

What is exported (`choose_source`): ``--version N`` picks published version N
(``<run>/weights/vNNNNNNNN/``); by default the newest published version that passes the
weight store's verification (`WeightStore.verify`: every file's sha256 and size against
the manifest, no unlisted file, the format's layout), else the newest trainer checkpoint
(``<run>/checkpoints/step-NNNNNNNN/``, which has no manifest to check). A published
version that fails verification is never exported: the default skips it (saying so) and
``--version`` refuses it.

Where the base model comes from (`read_base`): ``<run>/run.json``, written at run start::

    {"format": 1, "config": <Config.model_dump(mode="json")>,
     "model": {"source": <model.path as given>, "local_dir": <the loaded folder>,
               "revision": <sha or null>}}

gives the base folder (config.json, tokenizer, generation_config.json), the compute dtype
(``config.model.dtype``, the dtype the run served; the export's dtype) and the LoRA
settings (``config.model.lora``). Runs older than run.json need ``--config RUN_TOML``
(base = ``model.path``); an explicit ``--config`` also wins over run.json (a base folder
that moved).

What is written (`export_run`), always through ``save_pretrained`` so that transformers
handles tied embeddings (no duplicated ``lm_head``) and sharding:
- full weights: a model built from the base's config with the weights loaded (every
  tensor of the model must be given; a tied ``lm_head`` copy must equal the embedding);
- LoRA, default: the peft adapter folder (``adapter_config.json`` with
  ``base_model_name_or_path`` = the hub id the run was started from, else the base
  folder's absolute path; ``adapter_model.safetensors``), plus the tokenizer;
- LoRA with ``merge_lora``: the base with the adapter merged in (full weights).
The folder appears whole (written beside ``out`` under a temporary name, then renamed);
a non-empty ``out`` is refused unless ``force``, and ``force`` never deletes the run
directory, the base folder or a folder holding either.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from pipeline.bus.schema import WeightsPublished
from pipeline.config import LoraConfig, load_config
from pipeline.devices import DTYPES
from pipeline.weights import ADAPTER_FILE, MANIFEST, WeightError, WeightStore, table_sha256
from pipeline.weights.file import SINGLE_FILE, aliases, read_full
from pipeline.weights.lora import read_adapter

RUN_JSON = "run.json"
RUN_JSON_FORMAT = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "chat_template.jinja", "chat_template.json")
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


class ExportError(ValueError):
    """The export cannot be done as asked (the message says why and what to do)."""


@dataclass(frozen=True)
class Base:
    """The run's base model: its folder, how an adapter names it, dtype, LoRA settings."""

    local_dir: Path
    ref: str  # base_model_name_or_path of an exported adapter
    dtype: str
    lora: LoraConfig | None
    frozen_prefixes: tuple[str, ...] = ()  # model.frozen_prefixes: never published


@dataclass(frozen=True)
class Source:
    """One exportable state of the run: a published version or a trainer checkpoint."""

    kind: Literal["version", "checkpoint"]
    path: Path
    version: int
    step: int
    lora: bool  # an adapter (LoRA run), else full weights


@dataclass(frozen=True)
class Exported:
    out: Path
    source: Source
    what: str  # "full weights" | "LoRA adapter" | "merged LoRA"
    files: dict[str, int]  # name -> bytes

    def summary(self) -> str:
        name = (f"v{self.source.version}" if self.source.kind == "version"
                else f"checkpoint {self.source.path.name} (version {self.source.version})")
        total = sum(self.files.values())
        lines = [f"exported {name}, step {self.source.step}: {self.what}, "
                 f"{len(self.files)} files, {total:,} bytes -> {self.out}"]
        lines += [f"  {n}  {b:,} bytes" for n, b in sorted(self.files.items())]
        return "\n".join(lines)


# ----------------------------------------------------------------------- the base model


def read_base(run_dir: Path, config: str | Path | None = None) -> Base:
    """The base model of the run in ``run_dir``: from ``config`` (a run TOML) when given,
    else from ``run_dir/run.json`` (see the module docstring for its contract)."""
    if config is not None:
        cfg = load_config(config)
        path = Path(cfg.model.path).resolve()
        return _checked(Base(path, str(path), cfg.model.dtype, cfg.model.lora,
                             tuple(cfg.model.frozen_prefixes)), str(config))
    path = run_dir / RUN_JSON
    if not path.is_file():
        raise ExportError(f"{run_dir} has no {RUN_JSON} (a run started before sluice wrote "
                          "it): give the run's config with --config RUN_TOML")
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != RUN_JSON_FORMAT:
            raise ExportError(f"{path}: format {doc.get('format')!r}, this sluice reads "
                              f"format {RUN_JSON_FORMAT}")
        model, cfg_model = doc["model"], doc["config"]["model"]
        source, local_dir = str(model["source"]), Path(model["local_dir"])
        dtype = cfg_model.get("dtype", "float32")
        lora = cfg_model.get("lora")
        lora = LoraConfig.model_validate(lora) if lora is not None else None
        frozen = tuple(str(p) for p in cfg_model.get("frozen_prefixes") or ())
    except ExportError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ExportError(f"{path}: unreadable run description: {e!r}") from None
    # an adapter names the hub id the run started from (portable), else the local folder;
    # a hub download has a revision (a folder has none) and lives in a snapshots/ dir
    hub = bool(_HUB_ID.match(source)) and (model.get("revision") is not None
                                           or "snapshots" in local_dir.parts)
    ref = source if hub else str(local_dir.resolve())
    return _checked(Base(local_dir.resolve(), ref, dtype, lora, frozen), str(path))


def _checked(base: Base, origin: str) -> Base:
    if not (base.local_dir / "config.json").is_file():
        raise ExportError(f"the base model folder {base.local_dir} (from {origin}) has no "
                          "config.json; give --config RUN_TOML with model.path set to it")
    if base.dtype not in DTYPES:
        raise ExportError(f"{origin}: unknown dtype {base.dtype!r}")
    return base


# --------------------------------------------------------------- what to export


def published_versions(run_dir: Path) -> list[int]:
    """Version numbers of the run's published directories (complete ones: with a
    manifest; the store renames a version into place only once written), ascending."""
    found = []
    for d in (run_dir / "weights").glob("v*"):
        if d.name[1:].isdigit() and (d / MANIFEST).is_file():
            found.append(int(d.name[1:]))
    return sorted(found)


def verify_version(run_dir: Path, version: int) -> Source:
    """Published ``version``, checked by the weight store's own `WeightStore.verify`.

    There is no announcement to compare with, so one is rebuilt from the manifest (its
    file table's sha256, the directory's version): what is checked is that every file
    hashes to its manifest entry, nothing unlisted is present, the manifest is for this
    version, and the layout is the format's. Raises `WeightError`."""
    store = WeightStore(run_dir / "weights")
    directory = store.dir_for(version)
    try:
        man = json.loads((directory / MANIFEST).read_bytes())
        msg = WeightsPublished(version=version, step=int(man["step"]), uri=directory.as_uri(),
                               format=str(man["format"]), sha256=table_sha256(man["files"]),
                               nbytes=0, t=0.0)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightError(f"weights v{version}: unreadable {MANIFEST}: {e!r}") from None
    if msg.format == "delta":  # the changed elements only (weights.full_every > 1)
        raise WeightError(f"weights v{version}: a delta version, not loadable alone")
    path = store.verify(msg)
    return Source("version", path, version, msg.step, msg.format == "lora")


def checkpoints(run_dir: Path) -> list[Path]:
    """The trainer's complete checkpoints (``meta.json`` is written last), oldest first."""
    root = run_dir / "checkpoints"
    return sorted(p for p in root.glob("step-*") if (p / "meta.json").is_file())


def read_checkpoint(path: Path) -> Source:
    meta = json.loads((path / "meta.json").read_text())
    lora = (path / ADAPTER_FILE).is_file()
    if not lora and not (path / SINGLE_FILE).is_file():
        raise ExportError(f"checkpoint {path} has neither {SINGLE_FILE} nor {ADAPTER_FILE}")
    return Source("checkpoint", path, int(meta.get("version", 0)), int(meta["step"]), lora)


def choose_source(run_dir: Path, version: int | None = None,
                  log: Callable[[str], None] = print) -> Source:
    """``version`` if given (verified); else the newest published version that verifies
    (a failing one is skipped, and ``log`` says so); else the newest checkpoint."""
    versions = published_versions(run_dir)
    if version is not None:
        if version not in versions:
            have = ", ".join(f"v{v}" for v in versions) or "none"
            raise ExportError(f"{run_dir} has no published version {version} "
                              f"(published versions: {have})")
        return verify_version(run_dir, version)
    for v in reversed(versions):
        try:
            return verify_version(run_dir, v)
        except WeightError as e:
            log(f"skipping published v{v}: {e}")
    ckpts = checkpoints(run_dir)
    if ckpts:
        return read_checkpoint(ckpts[-1])
    raise ExportError(f"{run_dir} holds no weights to export: no verified version under "
                      "weights/ and no checkpoint under checkpoints/ (is it a run's "
                      "run.output_dir?)")


# --------------------------------------------------------------- building the model


def load_full(base: Base, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A model of the base's architecture (config.json) holding ``state``, in the run's
    dtype. Every tensor of the model must be in ``state`` (a tied ``lm_head.weight`` may
    be absent, or present and equal to the embedding) and nothing else, except the
    frozen ones (`pipeline.vlm.frozen_keys`: a vision-language model's tower and
    projector, ``model.frozen_prefixes``), which no version carries: those are the base
    folder's own, as every engine of the run served them."""
    from transformers import AutoConfig

    from pipeline.vlm import auto_class, frozen_keys

    config = AutoConfig.from_pretrained(base.local_dir, local_files_only=True)
    cls = auto_class(config)
    model = cls.from_config(config, dtype=DTYPES[base.dtype])
    own = model.state_dict()
    frozen = frozen_keys(model, base.frozen_prefixes)
    if frozen - set(state):  # never published: start from the base's weights
        model = cls.from_pretrained(base.local_dir, dtype=DTYPES[base.dtype],
                                    local_files_only=True)
        own = model.state_dict()
    tied = aliases(own)  # {lm_head.weight: model.embed_tokens.weight} when tied
    missing = sorted(set(own) - set(state) - set(tied) - frozen)
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ExportError(f"the weights do not fit the base model {base.local_dir}: "
                          f"missing {missing[:3]} ({len(missing)}), unexpected "
                          f"{unexpected[:3]} ({len(unexpected)})")
    for k, twin in tied.items():  # the transport publishes a tied alias as its own copy
        if k in state and twin in state and not torch.equal(state[k], state[twin]):
            raise ExportError(f"{k} differs from {twin}, but the base model ties them "
                              "(tie_word_embeddings): refusing to drop one")
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise ExportError(f"{k} has shape {tuple(v.shape)}, the base model's "
                              f"{tuple(own[k].shape)}")
    model.load_state_dict(state, strict=False)
    return model.eval()


def load_lora(base: Base, adapter: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The base model (float32) wrapped by the run's LoRA settings, holding ``adapter``
    (peft's saved keys; checked against the adapter's keys and shapes)."""
    from pipeline.model import adapter_to_model_keys, apply_lora, load_model

    if base.lora is None:
        raise ExportError("these weights are a LoRA adapter, but the run's config has no "
                          "[model.lora] (give --config with the run's LoRA settings)")
    model, _ = load_model(base.local_dir, dtype="float32")
    peft_model = apply_lora(model, base.lora, seed=0)
    try:
        peft_model.load_state_dict(adapter_to_model_keys(peft_model, adapter), strict=False)
    except ValueError as e:
        raise ExportError(str(e)) from None
    return peft_model.eval()


def check_adapter_config(source: Source, lora: LoraConfig) -> None:
    """A published adapter's own config agrees with the run's LoRA settings (rank,
    alpha, target modules): otherwise the merge would scale it wrongly."""
    path = source.path / "adapter_config.json"
    if source.kind != "version" or not path.is_file():
        return
    pub = json.loads(path.read_text())
    want = {"r": lora.rank, "lora_alpha": lora.alpha,
            "target_modules": sorted(lora.target_modules)}
    got = {"r": pub.get("r"), "lora_alpha": pub.get("lora_alpha"),
           "target_modules": sorted(pub.get("target_modules") or [])}
    if got != want:
        raise ExportError(f"{path} says {got}, the run's [model.lora] {want}")


def build(base: Base, source: Source, merge_lora: bool) -> tuple[torch.nn.Module, str]:
    """(model to ``save_pretrained``, what it is)."""
    if not source.lora:
        if merge_lora and base.lora is None:
            raise ExportError("--merge-lora: this run trained full weights, not a LoRA "
                              "adapter; drop the flag")
        if base.lora is not None and (source.kind != "version" or base.lora.sync == "adapter"):
            raise ExportError(f"{source.path} holds full weights, but the run's config "
                              "has [model.lora] (a run with lora.sync = \"merged\" publishes "
                              "full versions; its checkpoints hold the adapter)")
        # a version: shards behind an index; a checkpoint: one model.safetensors
        what = "merged LoRA" if base.lora is not None else "full weights"
        return load_full(base, read_full(source.path)), what
    if base.lora is not None:
        check_adapter_config(source, base.lora)
    model = load_lora(base, read_adapter(source.path))
    if not merge_lora:
        cfg = model.peft_config[model.active_adapter]
        cfg.base_model_name_or_path = base.ref
        cfg.inference_mode = True
        return model, "LoRA adapter"
    merged = model.merge_and_unload()
    return merged.to(DTYPES[base.dtype]).eval(), "merged LoRA"


# --------------------------------------------------------------- writing the folder


def check_out(out: Path, *, force: bool, protected: list[Path]) -> None:
    """Refuse an ``out`` that is a file, non-empty without ``force``, or (with
    ``force``) the run's or base's folder or one holding them."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ExportError(f"--out {out} is not empty; give --force to replace it")
        real = out.resolve()
        for p in protected:
            if p.resolve() == real or p.resolve().is_relative_to(real):
                raise ExportError(f"--out {out} holds {p}; refusing to replace it")


def write_folder(model: torch.nn.Module, base: Base, out: Path) -> dict[str, int]:
    """``save_pretrained`` (+ the base's tokenizer files, byte for byte, and generation
    config) into a temporary sibling of ``out``, then rename it into place, replacing
    what `check_out` allowed. Returns {file: bytes}."""
    from transformers import GenerationConfig

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if (base.local_dir / "generation_config.json").is_file() and hasattr(
                model, "generation_config"):
            model.generation_config = GenerationConfig.from_pretrained(
                base.local_dir, local_files_only=True)
        model.save_pretrained(tmp, safe_serialization=True)
        for name in TOKENIZER_FILES:
            if (base.local_dir / name).is_file():
                shutil.copyfile(base.local_dir / name, tmp / name)
        files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return files


def export_run(run_dir: str | Path, out: str | Path, *, version: int | None = None,
               merge_lora: bool = False, force: bool = False,
               config: str | Path | None = None,
               log: Callable[[str], None] = print) -> Exported:
    """Export the run in ``run_dir`` to ``out`` (see the module docstring)."""
    run, dest = Path(run_dir), Path(out)
    if not run.is_dir():
        raise ExportError(f"no run directory at {run}")
    base = read_base(run, config)
    check_out(dest, force=force, protected=[run, base.local_dir])
    source = choose_source(run, version, log)
    model, what = build(base, source, merge_lora)
    files = write_folder(model, base, dest)
    return Exported(dest.resolve(), source, what, files)


def main(args: argparse.Namespace) -> int:
    """The CLI's `export` branch: export, print what was written, push if asked."""
    from sluice.export_hub import check_hub_ready, push_to_hub

    token = check_hub_ready() if args.push_to_hub else None
    done = export_run(args.run_dir, args.out, version=args.version,
                      merge_lora=args.merge_lora, force=args.force, config=args.config)
    print(done.summary())
    if token is not None:
        print(f"pushed to {push_to_hub(done.out, args.push_to_hub, token)}")
    return 0
