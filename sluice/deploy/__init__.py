"""`sluice deploy render`: a run's config as the files of a Slurm job, a Kubernetes
kustomization or a compose project (docs/deploying.md).

`plan.make_plan` computes the deployment once (roles, counts, names, credentials,
resources); one small module per target (`slurm`, `k8s`, `compose`) turns the plan into
files (`containers`: what the k8s and compose targets share); `files.write_tree` writes
them. Every target ships the run's config as ``run.toml`` (the given TOML with the
``--set`` overrides applied and the keys the target decides, such as ``bus.redis_url``,
replaced), so every role of the deployment reads one file, and per-role credentials under
``secrets/`` (mode 0600), never in argv or in clear in a manifest.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.config import load_config
from sluice.deploy.files import Rendered, write_tree
from sluice.deploy.plan import TARGETS, Plan, make_plan
from sluice.deploy.runconfig import raw_config, run_config

__all__ = ["TARGETS", "make_plan", "render", "render_files", "run_config"]


def render_files(plan: Plan, data: Mapping[str, Any]) -> Rendered:
    """Every file of ``plan``'s target, in memory."""
    if plan.target == "slurm":
        from sluice.deploy import slurm as target
    elif plan.target == "k8s":
        from sluice.deploy import k8s as target  # type: ignore[no-redef]
    else:
        from sluice.deploy import compose as target  # type: ignore[no-redef]
    return target.render(plan, data)


def render(config: str | Path, overrides: Sequence[str], target: str, out: str | Path, *,
           force: bool = False) -> list[Path]:
    """Check, render and write; nothing is written when any check fails. The render's
    notes go to stderr."""
    cfg = load_config(config, list(overrides))
    plan = make_plan(cfg, target)
    rendered = render_files(plan, raw_config(config, overrides))
    written = write_tree(out, rendered, force=force)
    for note in rendered.notes:
        print(f"sluice: note: {note}", file=sys.stderr)
    return written
