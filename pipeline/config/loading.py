"""Reading a config: a TOML file (or the defaults), then ``--set a.b=c`` overrides, then
validation into `Config`. Overrides are parsed as TOML values (``--set trainer.lr=3e-4``,
``--set run.name='"x"'`` or simply ``--set run.name=x``: a value that is not valid TOML is
taken as a string). Every failure is a `ConfigError` naming the file or the dotted key.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pipeline.config.base import ConfigError
from pipeline.config.root import Config


def _parse_value(text: str) -> Any:
    """An override's value as TOML; text that is not a TOML value is that string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one ``a.b=c`` override to a raw config dict, in place."""
    key, sep, raw = assignment.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {assignment!r}: expected section.key=value")
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {part!r} is not a section")
        node = child
    node[parts[-1]] = _parse_value(raw.strip())


def _format_errors(err: ValidationError, source: str) -> str:
    """One line per error, each naming its dotted key; the offending value is shown
    unless it is a whole table (or an unknown key, whose value is beside the point)."""
    lines = [f"invalid config ({source}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(root)"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        whole = e["type"] == "extra_forbidden" or isinstance(e.get("input"), dict)
        got = "" if whole else f" (got {e.get('input')!r})"
        lines.append(f"  {key}: {msg}{got}")
    return "\n".join(lines)


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a TOML file (or defaults when ``path`` is None), apply overrides, validate.

    Relative ``run.output_dir`` and ``model.path`` are relative to the current directory
    of each process; `sluice up` starts every role in its own directory, so they agree
    (and every role loads the model folder pinned in run.json, `pipeline.rundir`).
    """
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        source = str(p)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {p}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{p}: not UTF-8 text, so not TOML: {e}") from None
        except OSError as e:  # a directory, no permission, …
            raise ConfigError(f"{p}: cannot read the config file: {e.strerror or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
    for assignment in overrides:
        apply_override(data, assignment)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None
