"""A run's ledger audit, as `sluice audit RUN_DIR` and the end of `sluice up` run it.

With a config the audit asks the run's Redis (as the ``monitor`` role) for the counters
and for where each unfinished group is (`pipeline.bus.audit.live_view`), which also
resolves the ``intent`` lines of calls whose outcome the ledger lacks. Without one it
falls back on ``state.json``: the counters `sluice up` saved when it stopped, checked
against the ledgers, with nothing in flight resolved (Redis may be long gone).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from pipeline.bus.audit import AuditReport, LiveView, audit, live_view, pending_intents
from pipeline.bus.ledger import read_ledgers
from pipeline.config import Config, load_config
from pipeline.runtime import connected

STATE_FILE = "state.json"
"""The run's final Redis ``state`` hash and ``num_generations``, in ``output_dir``:
written by `sluice up` once every role has stopped, read by a later `sluice audit`
given no config."""


def save_state(run_dir: Path, live: LiveView, num_generations: int) -> None:
    (run_dir / STATE_FILE).write_text(json.dumps(
        {"state": live.state, "num_generations": num_generations}))


def saved_state(run_dir: Path) -> tuple[dict[str, Any], int | None] | None:
    """The counters and ``num_generations`` `save_state` wrote, or None without a file."""
    path = run_dir / STATE_FILE
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    return saved["state"], saved.get("num_generations")


async def audit_run(run_dir: Path, cfg: Config | None, *, drained: bool = False,
                    keep_state: bool = False) -> tuple[AuditReport, bool]:
    """Audit ``run_dir``'s ledgers, against ``cfg``'s live Redis when given (and with
    ``keep_state`` save its counters to `STATE_FILE` first), else against `STATE_FILE`
    when there is one. Returns the report and whether the counters were checked (False:
    no config and no `STATE_FILE`)."""
    rows = read_ledgers(run_dir)
    state, num_generations, live = None, None, None
    if cfg is not None:
        num_generations = cfg.generation.num_generations
        async with connected(cfg, role="monitor") as bus:
            live = await live_view(bus, pending_intents(rows))
        if keep_state:
            save_state(run_dir, live, num_generations)
    elif (saved := saved_state(run_dir)) is not None:
        state, num_generations = saved
    report = audit(run_dir, state, num_generations=num_generations, drained=drained,
                   live=live, rows=rows, archive=cfg is not None and cfg.archive.enabled)
    return report, live is not None or state is not None


async def audit_at_end(cfg: Config) -> bool:
    """The end of `sluice up`: save the final counters next to the ledgers (for a later
    `sluice audit`) and check the run's whole history, with where its unfinished groups
    are; prints one line, and returns False on any violation (True without ledgers)."""
    if not cfg.run.ledger:
        return True
    out = cfg.output_path
    report, _ = await audit_run(out, cfg, keep_state=True)
    print(f"ledger audit ({out}/ledger): {report.summary()}", file=sys.stderr)
    return report.ok


def audit_command(run_dir: str, config: str | None, overrides: list[str],
                  drained: bool) -> int:
    """`sluice audit`: exit 0 if the history is clean, 1 with the violations listed
    otherwise (a directory without ``ledger/`` is a ValueError: the CLI exits 2)."""
    path = Path(run_dir)
    if not (path / "ledger").is_dir():
        raise ValueError(f"{path} has no ledger/ directory (run.ledger = false, or not a "
                         "run's output_dir)")
    cfg = load_config(config, overrides) if config else None
    report, counters_checked = asyncio.run(audit_run(path, cfg, drained=drained))
    print(report.summary())
    if not counters_checked:
        print("(counters not checked: give --config, or run_dir/state.json)")
    return 0 if report.ok else 1
