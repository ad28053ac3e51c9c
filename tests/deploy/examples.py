"""The rendered examples under deploy/examples/<target>/<example>/, and how they are made.

Each is `sluice deploy render EXAMPLE --target TARGET` with per-role credentials from a
fresh `sluice acl` (passwords differ on every render, so ``secrets/`` is never committed
and never compared; nothing else depends on them). Regenerate all of them with

    .venv/bin/python -m tests.deploy.examples

and `test_render.py` fails while a committed example differs from a fresh render.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from sluice.acl import make_acl
from sluice.deploy import render
from sluice.deploy.files import SECRETS_DIR
from sluice.deploy.plan import TARGETS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {"copy": ROOT / "examples" / "copy.toml",
            "gsm8k": ROOT / "examples" / "gsm8k_qwen2.5_0.5b.toml"}
RUNS = {"copy": "copy", "gsm8k": "gsm8k"}  # each example's run.name
COMMITTED = ROOT / "deploy" / "examples"


def credentials(run: str, where: Path) -> Path:
    """A fresh `sluice acl` for ``run`` in ``where``; returns the credentials file."""
    return make_acl(where, run).credentials_file


def render_example(example: str, target: str, out: Path, creds: Path) -> None:
    render(EXAMPLES[example], [f"bus.credentials_file={creds}"], target, out)


def files(root: Path) -> dict[str, str]:
    """Every rendered file under ``root`` but the secrets, by relative path."""
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*"))
            if p.is_file() and p.relative_to(root).parts[0] != SECRETS_DIR}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for example, run in RUNS.items():
            creds = credentials(run, Path(tmp) / f"acl-{example}")
            for target in TARGETS:
                out = COMMITTED / target / example
                shutil.rmtree(out, ignore_errors=True)
                render_example(example, target, out, creds)
                shutil.rmtree(out / SECRETS_DIR)
                print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
