"""The table of docs/configuration.md, generated from the fields' docstrings: one row
per key, with its default written as TOML."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel

from pipeline.config.base import _Section
from pipeline.config.root import Config


def _toml_value(v: Any) -> str:
    """A default as it would be written in TOML (inline tables and arrays)."""
    if isinstance(v, BaseModel):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.model_dump().items()) + "}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)


def reference_rows() -> list[str]:
    """The configuration table of docs/configuration.md (one markdown row per key, from
    the docstrings); a unit test keeps the file equal to it."""
    rows: list[str] = []

    def walk(prefix: str, node: BaseModel) -> None:
        for key, info in type(node).model_fields.items():
            value = getattr(node, key)
            doc = " ".join((info.description or "").split())
            if isinstance(value, _Section):
                walk(f"{prefix}{key}.", value)
                continue
            optional = [a for a in get_args(info.annotation)
                        if isinstance(a, type) and issubclass(a, _Section)]
            if value is None and optional:  # an optional section: its row, then its keys
                rows.append(f"| `{prefix}{key}` | unset | {doc} |")
                walk(f"{prefix}{key}.", optional[0]())
                continue
            rows.append(f"| `{prefix}{key}` | `{_toml_value(value)}` | {doc} |")

    walk("", Config())
    return rows
