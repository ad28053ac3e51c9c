"""Experiment tracking: metrics, evaluations and the resolved config sent to trackio,
wandb, tensorboard or mlflow (``run.report_to``).

What goes where:

- the trainer's per-step row (the line it appends to ``metrics.jsonl``) under TRL's
  ``GRPOTrainer`` metric names where one exists (`TRL_NAMES`; ``reward/<fn>`` becomes
  ``rewards/<fn>/mean``) and under ``sluice/<key>`` otherwise (`trainer_metrics`);
- the evaluator's results (``eval.jsonl``) under ``eval/<metric>`` (`eval_metrics`);
- the resolved config, once, when the tracker opens (`open_tracker`).

Invariants, and why:

- Only trainer rank 0 and the evaluator open a tracker; no other role imports a tracking
  library (their metrics are already in these two rows, and N writers would duplicate).
- The step axis is the trainer step, for both roles (an evaluation is logged at the step
  of the version it evaluated), so train and eval curves line up.
- The trainer logs to the run ``run.name``, the evaluator to ``<run.name>-eval``; both in
  project ``run.tracking_project`` and group ``run.name``. Two processes never write one
  tracker run (wandb and mlflow cannot share a run between processes safely).
- ``metrics.jsonl`` and ``eval.jsonl`` stay the record; a tracker gets a copy. Values
  that are not finite numbers are left out of the copy (NaN: nothing to measure).
- Tracking never takes a role down: a library missing is refused at start
  (`check_report_to`, naming ``run.report_to`` and the pip extra); a backend that raises
  later is warned about once and disabled for the rest of the process (`Trackers`).
- A role that resumes (trainer from a checkpoint, evaluator with an ``eval.jsonl``)
  continues its tracker run: trackio by name, wandb and mlflow by the run id kept in
  ``<output_dir>/tracking/``; `sluice up --fresh` deletes both, so it starts new runs.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from pipeline.config import Config, ConfigError

log = logging.getLogger("sluice.tracking")

BACKENDS: dict[str, str] = {"trackio": "trackio", "wandb": "wandb",
                            "tensorboard": "tensorboard", "mlflow": "mlflow"}
"""``run.report_to`` value -> the module it needs (installed by ``sluice[<value>]``)."""

TRL_NAMES: dict[str, str] = {
    "reward": "reward",
    "reward_std": "reward_std",
    "frac_reward_zero_std": "frac_reward_zero_std",
    "loss": "loss",
    "grad_norm": "grad_norm",
    "lr": "learning_rate",
    "kl": "kl",
    "entropy": "entropy",
    "clip_ratio/low_mean": "clip_ratio/low_mean",
    "clip_ratio/high_mean": "clip_ratio/high_mean",
    "clip_ratio/region_mean": "clip_ratio/region_mean",
    "is_ratio/min": "sampling/importance_sampling_ratio/min",
    "is_ratio/mean": "sampling/importance_sampling_ratio/mean",
    "is_ratio/max": "sampling/importance_sampling_ratio/max",
    "logprob_diff/mean_abs": "sampling/sampling_logp_difference/mean",
    "num_tokens": "num_tokens",
    "completions/mean_length": "completions/mean_length",
    "completions/min_length": "completions/min_length",
    "completions/max_length": "completions/max_length",
    "completions/clipped_ratio": "completions/clipped_ratio",
    "entropy_coef": "entropy_coef",
}
"""sluice's ``metrics.jsonl`` key -> TRL 1.16 ``GRPOTrainer``'s logged name for the same
quantity (``reward/<fn>`` -> ``rewards/<fn>/mean`` and ``reward/<fn>/<stat>`` ->
``rewards/<fn>/<stat>`` are the patterns). Differences:
sluice's ``reward_std`` is the population std over the step's samples (TRL: unbiased);
``is_ratio/*`` is exp(trainer old logp - behaviour logp), TRL's
``sampling/importance_sampling_ratio`` with the behaviour policy as the sampler; with
loss_type ``cispo`` the capped fraction is ``clip_ratio/high_mean`` (TRL:
``cispo_clip_ratio``). Every other key is sluice's own and goes to ``sluice/<key>``."""

TRL_PREFIXES = ("perf/", "batch/", "sample/", "sampling/", "rollout/", "tools/")
"""Keys the trainer already writes under TRL's names (MFU, forward/backward time, the
forwarded layout, score centering's ``sampling/*``, the generators' ``rollout/*`` and
``tools/*``: TRL's ``tools/call_frequency``, ``tools/failure_frequency``, and the
per-tool ``tools/<name>/*`` beside them):
logged as they are (docs/metrics.md), and shown on ``batch_figure`` in /metrics."""

SLUICE_PREFIX = "sluice/"
EVAL_PREFIX = "eval/"


def _number(v: Any) -> float | None:
    """A finite int/float (bools count) as a float; None for anything else."""
    if isinstance(v, bool | int | float) and math.isfinite(float(v)):
        return float(v) if isinstance(v, float) else int(v)
    return None


def trainer_metrics(row: dict[str, Any]) -> dict[str, float]:
    """The trainer's ``metrics.jsonl`` row under tracker names (pure; ``step`` is the axis,
    not a metric). TRL's name where `TRL_NAMES` has one, ``rewards/<fn>/mean`` for a
    reward function's mean, ``sluice/<key>`` for the rest; non-numbers left out."""
    out: dict[str, float] = {}
    for key, value in row.items():
        v = _number(value)
        if key == "step" or v is None:
            continue
        if key in TRL_NAMES:
            name = TRL_NAMES[key]
        elif key.startswith(TRL_PREFIXES):
            name = key
        elif key.startswith("reward/"):
            part, _, stat = key.removeprefix("reward/").partition("/")
            name = f"rewards/{part}/{stat or 'mean'}"
        else:
            name = SLUICE_PREFIX + key
        out[name] = v
    return out


def eval_metrics(row: dict[str, Any]) -> dict[str, float]:
    """An ``eval.jsonl`` row's scores under ``eval/<metric>`` (pure); its version under
    ``sluice/version``; bookkeeping (step, times, prompt count) left out."""
    skip = {"step", "version", "t", "ts", "n"}
    out = {EVAL_PREFIX + k: v for k, x in row.items()
           if k not in skip and (v := _number(x)) is not None}
    if (v := _number(row.get("version"))) is not None:
        out[SLUICE_PREFIX + "version"] = v
    return out


def check_report_to(cfg: Config) -> None:
    """Refuse at start a ``run.report_to`` whose library is not installed (a role would
    otherwise train for hours and report nothing), naming the key and the pip extra."""
    for name in cfg.run.report_to:
        if not _installed(BACKENDS[name]):
            raise ConfigError(f"run.report_to: {name!r} needs the {BACKENDS[name]} package, "
                              f"which is not installed; pip install 'sluice[{name}]', or "
                              f"remove {name!r} from run.report_to")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules[module] is None
        return False


# --------------------------------------------------------------------------- contract


class Tracker:
    """What a role logs to: a step's metrics, the config once, and the end. The base is a
    no-op (``run.report_to`` empty); a backend overrides all three and may raise."""

    name = "none"

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` at trainer step ``step`` (non-decreasing within a run)."""

    def log_config(self, config: dict[str, Any]) -> None:
        """Record the resolved config (called once, before the first `log`)."""

    def finish(self) -> None:
        """Flush and close; the tracker is not used afterwards."""


class Trackers(Tracker):
    """Fan-out to every backend; a backend that raises is warned about once and dropped,
    so a tracker outage never stops the trainer (its metrics stay in metrics.jsonl)."""

    name = "all"

    def __init__(self, backends: list[Tracker]):
        self.backends = list(backends)

    def _each(self, what: str, *args: Any) -> None:
        for b in list(self.backends):
            try:
                getattr(b, what)(*args)
            except Exception as e:
                self.backends.remove(b)
                log.warning("tracking: %s raised in %s (%s: %s); %s is disabled for the "
                            "rest of this process (metrics stay in the run's jsonl files)",
                            b.name, what, type(e).__name__, e, b.name)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if metrics:
            self._each("log", metrics, step)

    def log_config(self, config: dict[str, Any]) -> None:
        self._each("log_config", config)

    def finish(self) -> None:
        self._each("finish")
        self.backends.clear()


# --------------------------------------------------------------------------- backends


class TrackioTracker(Tracker):
    """trackio, local-first: a SQLite file per project under ``TRACKIO_DIR`` (default
    ``~/.cache/huggingface/trackio``), shown by ``trackio show``. Continues the run of
    the same name when ``resume``."""

    name = "trackio"

    def __init__(self, project: str, run: str, group: str, resume: bool, out: Path):
        import trackio

        self.run = trackio.init(project=project, name=run, group=group, embed=False,
                                resume="allow" if resume else "never")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config)  # stored with the first log

    def finish(self) -> None:
        self.run.finish()


class WandbTracker(Tracker):
    """Weights & Biases (online unless ``WANDB_MODE=offline``); the run id is kept in
    ``tracking/wandb-<run>.id`` so a resumed role continues its run."""

    name = "wandb"

    def __init__(self, project: str, run: str, group: str, resume: bool, out: Path):
        import wandb

        run_id = _run_id(out / f"wandb-{run}.id", resume, wandb.util.generate_id)
        self.run = wandb.init(project=project, name=run, group=group, id=run_id,
                              resume="allow")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_config(self, config: dict[str, Any]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def finish(self) -> None:
        self.run.finish()


class TensorBoardTracker(Tracker):
    """TensorBoard event files under ``<output_dir>/tensorboard/<run>`` (``tensorboard
    --logdir <output_dir>/tensorboard``); the config as a text summary."""

    name = "tensorboard"

    def __init__(self, project: str, run: str, group: str, resume: bool, out: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out.parent / "tensorboard" / run))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def log_config(self, config: dict[str, Any]) -> None:
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```")

    def finish(self) -> None:
        self.writer.close()


class MlflowTracker(Tracker):
    """MLflow through an explicit client (thread-agnostic: no active-run global), the
    experiment named ``run.tracking_project``; params are the flattened config."""

    name = "mlflow"

    def __init__(self, project: str, run: str, group: str, resume: bool, out: Path):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        exp = self.client.get_experiment_by_name(project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(project)
        path = out / f"mlflow-{run}.id"
        if resume and path.is_file():
            self.run_id = path.read_text().strip()
        else:
            self.run_id = self.client.create_run(exp_id, run_name=run,
                                                 tags={"sluice.group": group}).info.run_id
            _write_id(path, self.run_id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        batch = [Metric(k, v, ts, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # log_batch's limit
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:500]) for k, v in _flatten(config).items()]
        for i in range(0, len(params), 100):  # log_batch's limit
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


BACKEND_CLASSES: dict[str, type[Tracker]] = {
    "trackio": TrackioTracker, "wandb": WandbTracker,
    "tensorboard": TensorBoardTracker, "mlflow": MlflowTracker}


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _run_id(path: Path, resume: bool, make: Any) -> str:
    """The run id kept at ``path`` when resuming, else a fresh one (written there)."""
    if resume and path.is_file():
        return path.read_text().strip()
    run_id = str(make())
    _write_id(path, run_id)
    return run_id


def _write_id(path: Path, run_id: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")


def run_name(cfg: Config, role: str) -> str:
    """The tracker run of a role: ``run.name`` for the trainer, ``<run.name>-eval`` for
    the evaluator (one writer per tracker run)."""
    return cfg.run.name if role == "trainer" else f"{cfg.run.name}-eval"


def open_tracker(cfg: Config, role: str, resume: bool = False) -> Tracker:
    """Open every ``run.report_to`` backend for ``role`` (trainer | evaluator) and log the
    resolved config. Blocking (a backend may reach a server): call it in a worker thread
    from an event loop. A backend that fails to open is warned about and left out."""
    if not cfg.run.report_to:
        return Tracker()
    name, out = run_name(cfg, role), cfg.output_path / "tracking"
    backends: list[Tracker] = []
    for key in dict.fromkeys(cfg.run.report_to):
        try:
            backends.append(BACKEND_CLASSES[key](cfg.run.tracking_project, name, cfg.run.name,
                                                 resume, out))
        except Exception as e:
            log.warning("tracking: cannot open %s (%s: %s); the run goes on without it",
                        key, type(e).__name__, e)
    trackers = Trackers(backends)
    trackers.log_config(cfg.model_dump(mode="json"))
    return trackers
