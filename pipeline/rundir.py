"""The run directory's identity: ``<output_dir>/run.json``, the config and model pin of a run.

Contract (read by `sluice export` too; bump ``format`` on any incompatible change)::

    {"format": 1,
     "config": <Config.model_dump(mode="json"), model.path as the user gave it>,
     "model": {"source": <model.path as given>,
               "local_dir": <absolute folder the roles load>,
               "revision": <commit sha of a hub snapshot, or null for a plain folder>}}

Invariants:

- **One model per run.** The model is resolved once (`pipeline.hub`) by the first role or
  `sluice up`, and pinned here; every later role and every resume loads ``local_dir`` (or,
  if that folder is gone, the pinned commit again), never what a branch points to now.
- **First writer wins.** run.json appears atomically (a temp file hard-linked into place,
  which fails if one exists), so roles starting together agree on one pin; the loser
  reads and checks against the winner's.
- **Same config on resume.** A role or `sluice up` on a directory with a run.json must
  bring the same config, except for `RESUMABLE` keys. Otherwise it is refused, listing
  each changed key old → new, unless ``--allow-config-change``: then its config becomes
  the run's (the previous file kept as ``run.json.prev-<UTC time>``) and, if the model
  keys changed, the model is resolved and pinned anew.
- Allowed changes are recorded only by `sluice up` (the whole run moves to them); a single
  role that differs only in allowed keys (its own threads, device, URLs) leaves run.json
  alone, so the roles of one run do not rewrite it in turn.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import Config, ConfigError
from pipeline.hub import ResolvedModel, cached_commit, is_hub_id, resolve_model

RUN_FILE = "run.json"
FORMAT = 1
RESUMABLE: tuple[str, ...] = (
    "run.max_time_s", "trainer.max_steps", "trainer.save_steps", "trainer.keep_checkpoints",
    "trainer.threads", "trainer.device", "generation.threads", "generation.device",
    "generation.vllm.urls", "generation.vllm.launch", "generation.vllm.python",
    "generation.vllm.start_timeout_s", "scoring.teacher_urls", "scoring.teacher_device",
    "up.*", "bus.*", "eval.*", "metrics.*", "deploy.*", "run.report_to",
    "run.tracking_project", "run.output_dir", "archive.path", "archive.file_mb",
    "archive.file_s", "archive.max_backlog")
"""Keys that may change on resume without ``--allow-config-change``: time and step
budgets, checkpoint cadence, threads, devices, where servers and Redis are (connection
details), how `sluice up` or a deployment lays the roles out, where roles serve metrics,
how the run is evaluated and tracked (never what it trains on), where and how it is
archived (not whether: ``archive.enabled`` changes what the audit demands), and
``run.output_dir`` (the
directory the run.json was found in, however it is spelled). ``trainer.max_steps`` also stretches a
decaying learning-rate schedule, which is what raising the budget of a run means."""
MARKERS: tuple[str, ...] = (RUN_FILE, "state.json", "ledger", "checkpoints", "weights",
                            "metrics.jsonl")
"""Any of these makes a directory a sluice run directory (`--fresh` may delete it)."""


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key}: {self.old!r} → {self.new!r}"


def run_file(output_dir: Path) -> Path:
    return output_dir / RUN_FILE


def is_resumable(key: str) -> bool:
    return any(key == k or (k.endswith(".*") and key.startswith(k[:-1])) for k in RESUMABLE)


def config_changes(old: Any, new: Any, prefix: str = "") -> list[Change]:
    """Every dotted key whose value differs between two ``model_dump(mode="json")``s,
    sorted by key: tables are compared key by key, anything else (a list, an optional
    table set on one side only, a key on one side only: None on the other) as a whole."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[Change] = []
        for k in sorted(set(old) | set(new)):
            out += config_changes(old.get(k), new.get(k), f"{prefix}{k}.")
        return out
    return [] if old == new else [Change(prefix[:-1], old, new)]


def check_fresh(out: Path) -> None:
    """Refuse ``--fresh`` on a non-empty directory that is not a sluice run directory
    (none of `MARKERS`): a mistyped ``run.output_dir`` must not delete someone's data."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"run.output_dir: {out} is a file, not a run directory")
    if any(out.iterdir()) and not any((out / m).exists() for m in MARKERS):
        raise ConfigError(f"run.output_dir: --fresh refuses to delete {out}: it is not "
                          f"empty and not a sluice run directory (none of "
                          f"{', '.join(MARKERS)}); remove it yourself or pick another dir")


def read_run(out: Path) -> dict[str, Any] | None:
    """The run.json of ``out``, or None if there is none; a broken or foreign one raises
    ConfigError (a run whose pin cannot be read must not silently re-pin)."""
    path = run_file(out)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"run.output_dir: cannot read {path}: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or \
            not {"config", "model"} <= set(data):
        raise ConfigError(f"run.output_dir: {path} is not a format-{FORMAT} sluice run file")
    return data


def run_record(cfg: Config, model: ResolvedModel) -> dict[str, Any]:
    return {"format": FORMAT, "config": cfg.model_dump(mode="json"),
            "model": {"source": model.source, "local_dir": model.local_dir,
                      "revision": model.revision}}


def _write_tmp(out: Path, record: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".run.json.", dir=out)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    return Path(tmp)


def write_first(out: Path, record: dict[str, Any]) -> bool:
    """Create run.json atomically unless it exists; True when this call created it."""
    tmp = _write_tmp(out, record)
    try:
        os.link(tmp, run_file(out))
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def replace(out: Path, record: dict[str, Any], previous: dict[str, Any]) -> Path:
    """Make ``record`` the run's; ``previous`` is kept as ``run.json.prev-<UTC time>``."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f".{time.time_ns() % 10**9:09d}Z"
    prev = out / f"{RUN_FILE}.prev-{stamp}"
    prev.write_text(json.dumps(previous, indent=1) + "\n")
    os.replace(_write_tmp(out, record), run_file(out))
    return prev


def _model_changes(cfg: Config, saved: dict[str, Any]) -> list[Change]:
    """model.path and model.revision against the pin. A folder counts as unchanged when
    it is the pinned folder however it is spelled (relative paths depend on the cwd);
    model.revision is compared only for hub ids (it is ignored for folders)."""
    pin = saved["model"]
    old_cfg = saved["config"].get("model", {})
    path, changes = cfg.model.path, []
    same = path == pin["source"] or (
        not is_hub_id(path) and pin["revision"] is None
        and str(Path(path).expanduser().resolve()) == pin["local_dir"])
    if not same:
        changes.append(Change("model.path", pin["source"], path))
    if is_hub_id(path) and cfg.model.revision != old_cfg.get("revision", "main"):
        changes.append(Change("model.revision", old_cfg.get("revision", "main"),
                              cfg.model.revision))
    return changes


def _pinned_model(saved: dict[str, Any]) -> ResolvedModel:
    """The pinned model: its folder if still there, else the pinned commit fetched again
    (a cleaned cache; another machine sharing the run directory)."""
    pin = saved["model"]
    if (Path(pin["local_dir"]) / "config.json").is_file():
        model = ResolvedModel(pin["source"], pin["local_dir"], pin["revision"])
    elif pin["revision"] is None:
        raise ConfigError(f"model.path: the run's pinned folder {pin['local_dir']} "
                          f"({RUN_FILE}) has no config.json any more")
    else:
        model = resolve_model(pin["source"], pin["revision"])
    if model.revision is not None:
        wanted = saved["config"].get("model", {}).get("revision", "main")
        now = cached_commit(model.source, wanted)
        if now is not None and now != model.revision:
            print(f"sluice: model.path {model.source!r} revision {wanted} now points to "
                  f"{now[:12]} in the cache; this run keeps its pinned commit "
                  f"{model.revision[:12]} (run.json)", file=sys.stderr)
    return model


def pin_run(cfg: Config, *, allow_config_change: bool = False, record_allowed: bool = False,
            resolve: bool = True) -> ResolvedModel | None:
    """Check ``cfg`` against the run directory's run.json and return the model to load.

    No run.json: resolve the model and write it (first writer wins; a loser checks against
    the winner's). With one: refuse changed keys outside `RESUMABLE` unless
    ``allow_config_change``; ``record_allowed`` (`sluice up`) also records allowed
    changes. ``resolve=False`` (the scorer, which loads no model) never resolves or
    writes a pin: it only checks against an existing run.json (None without one).
    """
    out = cfg.output_path
    for _ in range(2):  # a lost creation race is retried once, against the winner's file
        saved = read_run(out)
        if saved is None:
            if not resolve:
                return None
            model = resolve_model(cfg.model.path, cfg.model.revision)
            if write_first(out, run_record(cfg, model)):
                return model
            continue
        return _resume(cfg, saved, allow_config_change, record_allowed)
    raise ConfigError(f"run.output_dir: {run_file(out)} appeared and vanished while starting")


def _resume(cfg: Config, saved: dict[str, Any], allow: bool, record_allowed: bool
            ) -> ResolvedModel:
    out = cfg.output_path
    model_changes = _model_changes(cfg, saved)
    model_keys = {"model.path", "model.revision"}
    changes = [c for c in config_changes(saved["config"], cfg.model_dump(mode="json"))
               if c.key not in model_keys] + model_changes
    changes.sort(key=lambda c: c.key)
    refused = [c for c in changes if not is_resumable(c.key)]
    if refused and not allow:
        lines = "\n".join(f"  {c}" for c in refused)
        raise ConfigError(f"run.output_dir: {out} holds a run started with another config "
                          f"({RUN_FILE}); changed:\n{lines}\nresume with the saved config, "
                          "pass --allow-config-change to make this the run's config, or "
                          "use another run.output_dir (sluice up --fresh starts over)")
    # `sluice up` reports (and records) the changes of the run; a role it started differs
    # from run.json only in connection details it was given (bus.redis_url, its servers,
    # its metrics port) and would repeat the line in every role's log, so a single role
    # reports only changes to keys outside bus.* and metrics.*
    shown = changes if record_allowed else [
        c for c in changes if not c.key.startswith(("bus.", "metrics."))]
    if shown:
        print("sluice: resuming with changed config: " + "; ".join(map(str, shown)),
              file=sys.stderr)
    model = resolve_model(cfg.model.path, cfg.model.revision) if model_changes and allow \
        else _pinned_model(saved)
    if (refused and allow) or (changes and record_allowed):
        prev = replace(out, run_record(cfg, model), saved)
        print(f"sluice: {run_file(out)} now holds this config (previous: {prev.name})",
              file=sys.stderr)
    return model


def with_model(cfg: Config, model: ResolvedModel) -> Config:
    """``cfg`` as the roles run it: ``model.path`` is the pinned local folder, so the
    trainer, engines, weight stores and vLLM servers all load the same files from disk
    and nothing downstream resolves a hub id again."""
    return cfg.model_copy(update={"model": cfg.model.model_copy(
        update={"path": model.local_dir})})


def pinned_config(cfg: Config, **kwargs: Any) -> Config:
    """`pin_run` then `with_model` (``cfg`` unchanged when nothing is pinned)."""
    model = pin_run(cfg, **kwargs)
    return cfg if model is None else with_model(cfg, model)

