"""The layering rule of DESIGN §10, checked on the import statements of every module.

- `pipeline/bus/` (keys, schema, codec, client, scripts, control, ledger, audit,
  security) is the bottom layer: it imports nothing of sluice outside itself.
- the rest of `pipeline/` (config, runtime, model loading, transports, GRPO maths…)
  imports neither the roles (`workers`, `trainer`) nor the operator's tools
  (`pipeline/ops/`).
- `pipeline/ops/` (the CLI, `sluice up`, monitor, report, acl, embedded Redis, export) is
  the operator's face: it starts roles and servers, so it alone may import `workers` and
  `trainer`.
- `workers/` and `trainer/` never import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def sluice_imports(path: Path) -> set[str]:
    """Every absolute module name imported anywhere in the file (functions included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if n.split(".")[0] in ("pipeline", "workers", "trainer")}


def modules(folder: str) -> list[Path]:
    found = sorted((ROOT / folder).rglob("*.py"))
    assert found, folder
    return found


def offenders(folder: str, allowed: tuple[str, ...], skip: str | None = None) -> list[str]:
    bad = []
    for path in modules(folder):
        rel = path.relative_to(ROOT).as_posix()
        if skip and rel.startswith(skip):
            continue
        for name in sluice_imports(path):
            # `from pipeline.bus import codec` names the package `pipeline.bus` too
            if not any(name == a or name.startswith(a + ".") for a in allowed) \
                    and not any(a.startswith(name + ".") for a in allowed):
                bad.append(f"{rel} imports {name}")
    return bad


def test_the_bus_imports_only_itself() -> None:
    assert offenders("pipeline/bus", ("pipeline.bus",)) == []


def test_the_foundation_imports_no_role_and_no_operator_tool() -> None:
    bad = offenders("pipeline", ("pipeline.bus", "pipeline.config", "pipeline.runtime",
                                 "pipeline.rundir", "pipeline.model", "pipeline.hub",
                                 "pipeline.devices", "pipeline.rl.advantages",
                                 "pipeline.evaluation", "pipeline.tracking",
                                 "pipeline.weights", "pipeline.metrics"),
                        skip="pipeline/ops/")
    assert bad == []


def test_workers_and_trainer_never_import_each_other() -> None:
    assert [b for b in offenders("workers", ("pipeline", "workers"))] == []
    assert [b for b in offenders("trainer", ("pipeline", "trainer"))] == []


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The rule above could not pass vacuously: a role importing the other is found."""
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from trainer.trainer import x\n")
    assert "trainer.trainer" in sluice_imports(bad)
