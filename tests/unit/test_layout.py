"""The layering of docs/design.md ("Layers"), checked on every import statement of every
module (top-level, inside functions, and under ``TYPE_CHECKING``: a type hint is no
licence for an arrow that points up).

Bottom to top:
1. `pipeline/bus/`: imports nothing of sluice outside itself;
2. the rest of `pipeline/` (config, runtime, weights, RL maths, model loading, ...):
   the bus and itself only; never a role, never `sluice/`;
3. the roles, `workers/` and `trainer/`: `pipeline/` below them and their own package;
   never `sluice/`, never each other; within `workers/` no module imports a role
   module (the generator, the scorer, the evaluator) other than itself;
4. `sluice/` (the CLI, `sluice up`, monitor, report, export): anything; it alone
   starts roles.
And no import circle anywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pipeline", "workers", "trainer", "sluice")
WORKER_ROLES = ("workers.generator", "workers.scorer", "workers.evaluator")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    mods = {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}
    assert "pipeline.bus.client" in mods and "trainer.trainer" in mods
    return mods


def imports_of(path: Path, known: set[str]) -> set[str]:
    """Every sluice module ``path`` imports anywhere: ``from a.b import c`` is the module
    ``a.b.c`` when that is a module, else ``a.b``."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] in PACKAGES)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] in PACKAGES:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                out.add(full if full in known else node.module)
    return out


def graph() -> dict[str, set[str]]:
    mods = all_modules()
    return {m: imports_of(p, set(mods)) for m, p in mods.items()}


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer(name: str) -> str:
    if within(name, "pipeline.bus"):
        return "bus"
    if within(name, "sluice"):
        return "ops"
    if within(name, "pipeline"):
        return "foundation"
    return "role"


ALLOWED = {"bus": {"bus"}, "foundation": {"bus", "foundation"},
           "role": {"bus", "foundation", "role"}, "ops": {"bus", "foundation", "role", "ops"}}


def violations(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in g.items():
        for dep in deps:
            if layer(dep) not in ALLOWED[layer(mod)]:
                bad.append(f"{mod} ({layer(mod)}) imports {dep} ({layer(dep)})")
            elif layer(mod) == "role" and mod.split(".")[0] != dep.split(".")[0] \
                    and layer(dep) == "role":
                bad.append(f"{mod} imports the other role package: {dep}")
            elif within(mod, "workers") and any(within(dep, r) for r in WORKER_ROLES) \
                    and not any(within(mod, r) for r in WORKER_ROLES if within(dep, r)):
                bad.append(f"{mod} imports the role module {dep}")
    return sorted(bad)


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_every_arrow_points_down() -> None:
    assert violations(graph()) == []


def test_no_import_circle() -> None:
    assert cycles(graph()) == []


def test_the_checks_see_each_kind_of_violation() -> None:
    """The rules could not pass vacuously: each forbidden arrow is found, and a circle."""
    bad = violations({
        "pipeline.bus.client": {"pipeline.config"},
        "pipeline.runtime": {"sluice.cli"},
        "pipeline.weights.file": {"trainer.step"},
        "workers.engines.vllm": {"sluice.embedded"},
        "trainer.trainer": {"workers.tasks.catalog"},
        "workers.evaluator": {"workers.scorer"},
        "workers.tasks.rewards": {"workers.generator"},
        "workers.scorer": {"workers.tasks.rewards", "pipeline.bus.client"},
        "sluice.cli": {"workers.generator", "trainer.trainer"},
    })
    assert bad == [
        "pipeline.bus.client (bus) imports pipeline.config (foundation)",
        "pipeline.runtime (foundation) imports sluice.cli (ops)",
        "pipeline.weights.file (foundation) imports trainer.step (role)",
        "trainer.trainer imports the other role package: workers.tasks.catalog",
        "workers.engines.vllm (role) imports sluice.embedded (ops)",
        "workers.evaluator imports the role module workers.scorer",
        "workers.tasks.rewards imports the role module workers.generator",
    ]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_are_read_from_functions_and_type_checking_blocks(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                   "    from sluice.up import Supervisor\n"
                   "def f():\n    from trainer import trainer\n")
    assert imports_of(src, {"trainer.trainer"}) == {"sluice.up", "trainer.trainer"}
