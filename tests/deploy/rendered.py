"""Reading a k8s or compose render in the tests: render an example with fresh
credentials, every object of its YAML files, the pod templates and their containers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from sluice.deploy import render
from tests.deploy.examples import EXAMPLES, RUNS, credentials

GIB_MI = 1024


def fresh_credentials(root: Path) -> dict[str, Path]:
    """A fresh `sluice acl` per example run, by example."""
    return {ex: credentials(run, root / ex) for ex, run in RUNS.items()}


def render_into(out: Path, target: str, creds: dict[str, Path], example: str = "gsm8k",
                   *sets: str) -> Path:
    render(EXAMPLES[example], [f"bus.credentials_file={creds[example]}", *sets], target, out)
    return out


def docs(out: Path) -> list[dict[str, Any]]:
    """Every object of every YAML file of a render (no kustomize)."""
    return [d for p in sorted(out.rglob("*.yaml")) if p.name != "kustomization.yaml"
            for d in yaml.safe_load_all(p.read_text()) if d]


def pod_templates(objects: list[dict[str, Any]]
                  ) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, its pod template spec) for every object that makes pods."""
    for o in objects:
        tpl = o.get("spec", {}).get("template")
        if isinstance(tpl, dict) and "spec" in tpl:
            yield o, tpl["spec"]


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def jobs_by_name(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "Job"}


def mem_mi(q: str) -> int:
    """A quantity the render writes in Mi, as an int."""
    assert q.endswith("Mi"), q
    return int(q[:-2])
