"""The version pins agree with what the installed libraries accept.

transformers loads hub attention kernels only when the installed `kernels` lies in its
[KERNELS_MIN_VERSION, KERNELS_MAX_VERSION) (``is_kernels_available``); outside it, the
``gpu`` extra would install a `kernels` transformers reports as unavailable, and no
flash kernel would ever load. The range moves with transformers' releases, hence the
transformers pin and this check of the two together."""

from __future__ import annotations

import tomllib
from pathlib import Path

import transformers
from packaging.requirements import Requirement
from packaging.version import Version
from transformers.utils import import_utils

ROOT = Path(__file__).resolve().parents[2]


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _req(lines: list[str], name: str) -> Requirement:
    return next(r for r in map(Requirement, lines) if r.name == name)


def test_the_installed_transformers_is_the_pinned_one() -> None:
    pin = _req(_project()["dependencies"], "transformers")
    assert pin.specifier.contains(transformers.__version__), (pin, transformers.__version__)


def test_the_gpu_extras_kernels_range_is_inside_what_transformers_accepts() -> None:
    lo = Version(import_utils.KERNELS_MIN_VERSION)
    hi = Version(import_utils.KERNELS_MAX_VERSION)  # exclusive
    spec = _req(_project()["optional-dependencies"]["gpu"], "kernels").specifier
    assert spec.contains(lo), f"gpu extra {spec} refuses transformers' minimum {lo}"
    assert not spec.contains(hi), f"gpu extra {spec} admits {hi}, which transformers refuses"
    below = Version(f"{lo.major}.{lo.minor}.{max(lo.micro - 1, 0)}") if lo.micro else \
        Version(f"{lo.major}.{max(lo.minor - 1, 0)}.99")
    assert not spec.contains(below), f"gpu extra {spec} admits {below} < transformers' {lo}"
