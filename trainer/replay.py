"""`sluice replay`: train again on an archive, step for step as the original trainer did.

No generator, scorer or Redis: the groups come from the archive (`pipeline.archive`), the
step composition from the original trainer's ledger (`pipeline.archive.history.
step_plan`: the surviving history, in order, each step's groups in the order they were
trained) or, for an archive alone, from its ``dispositions.parquet``. Each step runs
through the `Trainer`'s own code (`Trainer.step_all` → `Trainer.train_step`, `publish`,
`record`, `checkpoint`) at the version the original step trained at, so that:

- **with the original config** the replay publishes the original's weight versions bit
  for bit (same initial weights, same groups in the same order, same float32 arrays,
  same versions and so the same safetensors metadata; the trainer's CPU maths has no
  randomness, and ``trainer.threads`` is the original's); `compare_weights` checks every
  version both weight stores hold;
- **with another loss or correction** (any ``trainer.*`` key) it is an A/B test on
  identical data.

Refused, naming the key (`check_config`): a config that changes the data, i.e. the task,
the seed that orders it, the model (and so its tokenizer), the environment, the group size
or the scoring (whose rewards and advantages the archive holds). Bad input: an archive
file that cannot be read is reported with its path and the groups the ledger says it
held; the replay trains the steps before the first step with a missing group and stops
there (`ReplayResult.gap`), never training on a gap.

Output: a directory of its own (``--out``, else ``run.output_dir`` unless that holds a run,
else ``<it>/replay``) with the run's layout: ``weights/``, ``checkpoints/``,
``metrics.jsonl`` and ``replay.json``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from pipeline.archive.format import scored_group
from pipeline.archive.history import Step, plan_from_dispositions, step_plan
from pipeline.archive.store import DISPOSITIONS, ArchiveReadError, ArchiveStore
from pipeline.bus.ledger import read_ledgers
from pipeline.config import Config, ConfigError
from pipeline.rundir import Change, config_changes, read_run
from pipeline.runtime import set_threads
from trainer.distributed import STEP, StepHeader

log = logging.getLogger("sluice.replay")

DATA_KEYS = ("task.", "model.path", "model.revision", "environment.", "scoring.",
             "generation.num_generations", "run.seed")
"""Keys whose change would change the data a replay trains on (prefixes end in '.')."""


class ReplayDiverged(RuntimeError):
    """The replay could not take a step the original took (a non-finite loss)."""


@dataclass
class Source:
    """What a replay reads: the archive, the original run's record (config + model pin)
    and its surviving steps; ``files_of``: the archive file of each group, when known."""

    store: ArchiveStore
    original: dict[str, Any]
    plan: list[Step]
    run_dir: Path | None
    files_of: dict[str, str] = field(default_factory=dict)


@dataclass
class ReplayResult:
    out: Path
    steps: int = 0
    planned: int = 0
    gap: str | None = None  # why the replay stopped early (a missing group)
    bad_files: dict[str, list[str]] = field(default_factory=dict)  # path -> groups it held
    # ``v<N>`` / ``step-<N>`` -> "bytes" | "tensors" | None (`compare_weights`)
    compared: dict[str, str | None] = field(default_factory=dict)

    @property
    def bit_exact(self) -> bool | None:
        """Every version and checkpoint both hold has bit-identical tensors (None: none
        to compare)."""
        return all(v is not None for v in self.compared.values()) if self.compared else None


def open_source(where: str) -> Source:
    """A run directory (its run.json, ledger and archive) or an archive alone (its
    run.json copy and dispositions)."""
    p = Path(where)
    if (p / "run.json").is_file() and (p / "ledger").is_dir():
        record = read_run(p)
        assert record is not None
        rows = read_ledgers(p)
        url = record["config"].get("archive", {}).get("path") or str(p / "archive")
        return Source(ArchiveStore(url), record, step_plan(rows), p,
                      {r["gid"]: r["file"] for r in rows if r["ev"] == "archived"})
    store = ArchiveStore(where)
    record = store.read_run()
    if record is None:
        raise ConfigError(f"{where}: neither a run directory (run.json and ledger/) nor an "
                          "archive (run.json, groups/)")
    if not store.exists(DISPOSITIONS):
        raise ConfigError(f"{where}: the archive has no {DISPOSITIONS} yet (its run has "
                          "not finished): replay the run directory, whose ledger has the "
                          "steps")
    with store.fs.open(store.path(DISPOSITIONS), "rb") as f:
        disp = pq.read_table(f)
    files = {r["gid"]: r["file"] for r in disp.select(["gid", "file"]).to_pylist() if r["file"]}
    return Source(store, record, plan_from_dispositions(disp), None, files)


def check_config(original: dict[str, Any], cfg: Config) -> None:
    """Refuse a replay config that changes the data (`DATA_KEYS`), naming each key."""
    pin = original["model"]
    old = original["config"]
    new = cfg.model_dump(mode="json")
    changes = [c for c in config_changes(old, new)
               if c.key.startswith(DATA_KEYS) and c.key not in ("model.path",)]
    path = cfg.model.path
    if path not in (pin["source"], pin["local_dir"]) and \
            str(Path(path).expanduser().resolve()) != pin["local_dir"]:
        changes.append(Change("model.path", pin["source"], path))
    if changes:
        lines = "\n".join(f"  {c}" for c in sorted(changes, key=lambda c: c.key))
        raise ConfigError("the replay's config changes the data the archive was made "
                          f"with (task, model, tokenizer, scoring); changed:\n{lines}\n"
                          "replay with the run's own values of these keys")


def replay_config(cfg: Config, original: dict[str, Any], out: Path) -> Config:
    """``cfg`` as the replay's trainer runs it: in ``out``, on the run's pinned model, with
    no ledger, tracker, metrics endpoint, archive or remote weight store."""
    data = cfg.model_dump(mode="json")
    data["run"].update(output_dir=str(out), ledger=False, report_to=[])
    data["metrics"]["port"] = 0
    data["archive"]["enabled"] = False
    data["model"]["path"] = original["model"]["local_dir"]
    if isinstance(data.get("weights"), dict):  # versions go to out/weights, never the run's
        data["weights"].update({k: "" for k in ("store", "cache_dir") if k in data["weights"]})
    return Config.model_validate(data)


def output_dir(cfg: Config, out: str | None, run_dir: Path | None) -> Path:
    """``out``; else ``run.output_dir`` unless it holds a run (then ``<it>/replay``)."""
    if out:
        return Path(out).resolve()
    base = cfg.output_path
    if (run_dir is not None and base == run_dir.resolve()) or (base / "ledger").exists() \
            or (base / "run.json").exists():
        return base / "replay"
    return base


def prepare(out: Path) -> None:
    """An empty directory, or a previous replay's (emptied); anything else is refused."""
    if out.exists() and any(out.iterdir()):
        if not (out / "replay.json").is_file():
            raise ConfigError(f"--out: {out} is not empty and not a replay's directory")
        for name in ("weights", "checkpoints", "metrics.jsonl", "replay.json"):
            target = out / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    out.mkdir(parents=True, exist_ok=True)


def load_groups(src: Source, result: ReplayResult, say: Callable[[str], None]
                ) -> dict[str, dict[str, Any]]:
    """Every readable archive row by group id; each unreadable file is reported with the
    groups it held (`Source.files_of`)."""
    rows: dict[str, dict[str, Any]] = {}
    held: dict[str, list[str]] = {}
    for gid, name in src.files_of.items():
        held.setdefault(name, []).append(gid)
    for name in src.store.files():
        try:
            table = src.store.read(name)
        except ArchiveReadError as e:
            result.bad_files[e.path] = sorted(held.get(name, []))
            say(f"unreadable archive file {e.path} ({e.reason}); it held "
                f"{len(held.get(name, []))} groups: {sorted(held.get(name, []))[:20]}")
            continue
        for row in table.to_pylist():
            rows.setdefault(row["gid"], row)
    return rows


def first_gap(plan: list[Step], rows: dict[str, Any], src: Source) -> tuple[int, str | None]:
    """How many steps can be replayed before one misses a group, and why it stops."""
    for i, st in enumerate(plan):
        missing = [g for g in st.gids if g not in rows]
        if missing:
            where = {g: src.files_of.get(g, "no archive file recorded") for g in missing}
            return i, (f"step {st.step} needs {len(missing)} groups the archive does not "
                       f"have: {where}")
    return len(plan), None


async def _run(cfg: Config, src: Source, out: Path, max_steps: int | None,
               say: Callable[[str], None]) -> ReplayResult:
    from trainer.trainer import Trainer

    result = ReplayResult(out, planned=len(src.plan))
    rows = load_groups(src, result, say)
    n, result.gap = first_gap(src.plan, rows, src)
    if result.gap:
        say(f"replay stops before {result.gap}")
    plan = src.plan[:n][:max_steps]
    set_threads(cfg.trainer.threads)
    trainer = Trainer(cfg)
    if getattr(trainer.store, "name", "") == "nccl":  # no servers to push to: the files
        trainer.store = trainer.store.fallback  # type: ignore[attr-defined]
    t = cfg.trainer
    try:
        trainer.state.version = plan[0].version if plan else 0
        await trainer.publish(None)  # the initial weights, as the original's start did
        for st in plan:
            if st.step != trainer.state.step + 1:
                raise ReplayDiverged(f"the plan jumps from step {trainer.state.step} to "
                                     f"{st.step}")
            trainer.state.version = st.version
            groups = [scored_group(rows[g]) for g in st.gids]
            header = StepHeader(STEP, st.version, publish=st.step % t.weight_sync_steps == 0,
                                save=st.step % t.save_steps == 0)
            t0 = time.time()
            metrics, source = await trainer.compute(trainer.step_all, header, groups)
            if metrics["skipped"]:
                raise ReplayDiverged(f"step {st.step}: loss or gradient not finite, which "
                                     "the original trainer took")
            trainer.state.step = st.step
            if source is not None:
                trainer.state.version += 1
                await trainer.publish(None, source)
            trainer.record(groups, metrics, t0, t0, trained_at=st.version)
            if header.save:
                await trainer.compute(trainer.checkpoint)
            result.steps += 1
        await trainer.compute(trainer.checkpoint)
    finally:
        trainer._compute.shutdown(wait=False)
    return result


def same_file(a: Path, b: Path) -> str | None:
    """``"bytes"`` when two files are byte-identical; for safetensors files whose bytes
    differ, ``"tensors"`` when every tensor is bit-identical and the metadata is the same
    mapping (runs published before the weight store wrote a one-key header: safetensors
    writes ``__metadata__`` from a hash map whose order changes from one process to the
    next, so two keys gave other bytes for the same tensors); None otherwise."""
    if a.read_bytes() == b.read_bytes():
        return "bytes"
    if a.suffix != ".safetensors":
        return None
    import torch
    from safetensors import safe_open

    with safe_open(str(a), "pt") as x, safe_open(str(b), "pt") as y:
        if x.metadata() != y.metadata() or set(x.keys()) != set(y.keys()):
            return None
        for k in x.keys():
            t, u = x.get_tensor(k), y.get_tensor(k)
            if t.dtype != u.dtype or t.shape != u.shape or not torch.equal(
                    t.reshape(-1).view(torch.uint8), u.reshape(-1).view(torch.uint8)):
                return None  # compared as bytes: NaN payloads and -0.0 count
    return "tensors"


def compare_weights(original: Path, replayed: Path) -> dict[str, str | None]:
    """For every weight version and checkpoint both runs hold (``v<N>``, ``step-<N>``):
    ``"bytes"`` if all its files are byte-identical, ``"tensors"`` if the only difference
    is the safetensors header (`same_file`), None if they differ."""
    out: dict[str, str | None] = {}
    pairs = [(d, original / "weights" / d.name, "manifest.json")
             for d in sorted((replayed / "weights").glob("v*"))]
    pairs += [(d, original / "checkpoints" / d.name, "meta.json")
              for d in sorted((replayed / "checkpoints").glob("step-*"))]
    for mine, twin, marker in pairs:
        if not ((mine / marker).is_file() and (twin / marker).is_file()):
            continue
        names = sorted(p.name for p in mine.iterdir()
                       if p.suffix in (".safetensors", ".json") and p.name not in
                       ("manifest.json", "meta.json"))
        verdicts = [same_file(mine / n, twin / n) if (twin / n).is_file() else None
                    for n in names]
        out[mine.name] = None if None in verdicts or not verdicts else \
            "bytes" if all(v == "bytes" for v in verdicts) else "tensors"
    return out


def replay(cfg: Config, where: str, *, out: str | None = None, max_steps: int | None = None,
           say: Callable[[str], None] = print) -> ReplayResult:
    """Replay the archive at ``where`` (a run directory or an archive) with ``cfg``."""
    src = open_source(where)
    check_config(src.original, cfg)
    target = output_dir(cfg, out, src.run_dir)
    prepare(target)
    rcfg = replay_config(cfg, src.original, target)
    (target / "replay.json").write_text(json.dumps(
        {"source": where, "steps": len(src.plan), "config": rcfg.model_dump(mode="json")},
        indent=1))
    say(f"replaying {len(src.plan)} steps of {where} into {target}")
    result = asyncio.run(_run(rcfg, src, target, max_steps, say))
    if src.run_dir is not None:
        result.compared = compare_weights(src.run_dir, target)
    return result
