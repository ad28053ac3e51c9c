"""docs/layout.md is the map a newcomer reads first: it must name everything that is in
the tree. Each package (a folder with ``__init__.py``), each module of the product and
each script under benchmarks/ is listed there; a file added without a line in the map
fails here. (The converse, a name in the map whose file is gone, is checked too for
packages and benchmarks, whose names are written as paths.)
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("pipeline", "workers", "trainer", "sluice")
LAYOUT = (ROOT / "docs" / "layout.md").read_text()


def words(text: str) -> set[str]:
    """The identifiers in ``text`` (module names are matched whole: ``up`` is not found
    inside ``update``)."""
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))


def packages() -> list[Path]:
    return sorted(p.parent.relative_to(ROOT) for top in PRODUCT
                  for p in (ROOT / top).rglob("__init__.py"))


def test_every_package_is_on_the_map() -> None:
    missing = [str(p) for p in packages() if f"{p.name}/" not in LAYOUT]
    assert missing == [], f"docs/layout.md does not list these packages: {missing}"


def test_every_product_module_is_on_the_map() -> None:
    named = words(LAYOUT)
    missing = sorted(str(p.relative_to(ROOT)) for top in PRODUCT
                     for p in (ROOT / top).rglob("*.py")
                     if p.stem != "__init__" and p.stem not in named)
    assert missing == [], f"docs/layout.md does not name these modules: {missing}"


def test_every_benchmark_is_on_the_map() -> None:
    named = words(LAYOUT)
    missing = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")
                     if p.stem != "__init__" and p.stem not in named)
    assert missing == [], f"docs/layout.md does not list these benchmarks: {missing}"


def test_every_benchmark_on_the_map_exists() -> None:
    listed = set(re.findall(r"\b([a-z_]+)\.py\b", LAYOUT.split("benchmarks/", 1)[1]
                            .split("\ndeploy/", 1)[0]))
    gone = sorted(n for n in listed if not (ROOT / "benchmarks" / f"{n}.py").exists())
    assert gone == [], f"docs/layout.md lists benchmarks that do not exist: {gone}"


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """The word match is whole-word: a module ``up`` is not found in ``update``."""
    assert "up" not in words("update the supervisor")
    assert "up" in words("up (`sluice up`: supervisor)")
