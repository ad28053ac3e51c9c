"""Rendered files: the TOML and YAML writers, and writing a render to disk atomically.

A render is computed whole in memory (`Rendered`: relative path -> text and mode) before
a byte is written, so a refused config writes nothing. `write_tree` then writes each file
under a temporary name in its folder and renames it into place (a reader sees the old
file or the new one, never half of one), secrets created mode 0600 in a 0700 folder. An
``--out`` that holds anything is refused unless ``force``; with ``force`` the files of
the previous render (listed in `MANIFEST`) that this one no longer writes are removed,
and nothing else in the folder is touched.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

MANIFEST = ".sluice-render"
"""The list of files a render wrote, one relative path per line (with --force, the next
render removes those it does not write again)."""

SECRETS_DIR = "secrets"
"""Folder of a render that holds passwords (mode 0700, files 0600); never committed, and
left out of the rendered examples' comparison."""


@dataclass(frozen=True)
class File:
    text: str
    mode: int = 0o644


@dataclass
class Rendered:
    """Everything one render writes, by path relative to ``--out``, and the notes the
    user should read (what the render cannot check, such as whether an image can be
    pulled), which `sluice deploy render` prints."""

    files: dict[str, File] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def add(self, path: str, text: str, mode: int = 0o644) -> None:
        if path in self.files:
            raise ValueError(f"rendered twice: {path}")
        if Path(path).is_absolute() or ".." in Path(path).parts:
            raise ValueError(f"a rendered path must stay inside --out: {path}")
        self.files[path] = File(text, mode)

    def secret(self, name: str, text: str, mode: int = 0o600) -> str:
        """Add ``secrets/<name>`` (mode 0600 unless it holds no secret) and return its
        relative path."""
        path = f"{SECRETS_DIR}/{name}"
        self.add(path, text, mode)
        return path


def write_tree(out: str | Path, rendered: Rendered, *, force: bool = False) -> list[Path]:
    """Write ``rendered`` under ``out`` (module docstring); returns the paths written.
    Raises `FileExistsError` for a non-empty ``out`` without ``force``."""
    root = Path(out)
    if root.exists() and not root.is_dir():
        raise FileExistsError(f"--out {root} exists and is not a directory")
    if root.is_dir() and any(root.iterdir()) and not force:
        raise FileExistsError(f"--out {root} is not empty; pass --force to render over it")
    previous = _manifest(root)
    written: list[Path] = []
    for rel, f in sorted(rendered.files.items()):
        path = root / rel
        secret = Path(rel).parts[0] == SECRETS_DIR
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700 if secret else 0o755)
        if secret:
            path.parent.chmod(0o700)
        _write_atomic(path, f.text, f.mode)
        written.append(path)
    for rel in previous - set(rendered.files):
        (root / rel).unlink(missing_ok=True)
    _write_atomic(root / MANIFEST, "".join(f"{p}\n" for p in sorted(rendered.files)), 0o644)
    return written


def _manifest(root: Path) -> set[str]:
    try:
        lines = (root / MANIFEST).read_text().splitlines()
    except OSError:
        return set()
    return {ln for ln in lines if ln and not Path(ln).is_absolute() and ".." not in ln}


def _write_atomic(path: Path, text: str, mode: int) -> None:
    """Created with ``mode`` before any byte is written, then renamed over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def toml_value(v: Any) -> str:
    """One TOML value: JSON's string escapes are TOML's, floats keep their repr."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{_toml_key(k)} = {toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {type(v).__name__}: {v!r}")


def dump_toml(data: Mapping[str, Any], header: Iterable[str] = ()) -> str:
    """A TOML document of ``data``: plain values first, then one ``[table]`` per nested
    mapping (recursively); mappings inside lists stay inline. ``tomllib.loads`` of the
    result equals ``data``."""
    lines = [f"# {h}".rstrip() for h in header]

    def table(prefix: str, node: Mapping[str, Any]) -> None:
        plain = [(k, v) for k, v in node.items() if not isinstance(v, Mapping)]
        nested = [(k, v) for k, v in node.items() if isinstance(v, Mapping)]
        if prefix and (plain or not nested):
            lines.extend(["", f"[{prefix}]"])
        lines.extend(f"{_toml_key(k)} = {toml_value(v)}" for k, v in plain)
        for k, v in nested:
            table(f"{prefix}.{_toml_key(k)}" if prefix else _toml_key(k), v)

    table("", data)
    return "\n".join(lines).lstrip("\n") + "\n"


class _Dumper(yaml.SafeDumper):
    """Block style, no anchors (each object written out whole), multi-line strings
    (scripts) as literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, s: str) -> yaml.Node:
    style = "|" if "\n" in s else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style=style)


_Dumper.add_representer(str, _str)


def dump_yaml(*docs: Mapping[str, Any], header: Iterable[str] = ()) -> str:
    """One or more YAML documents (``---`` between them), keys in insertion order."""
    head = "".join(f"# {h}".rstrip() + "\n" for h in header)
    body = "---\n".join(yaml.dump(dict(d), Dumper=_Dumper, sort_keys=False,
                                  default_flow_style=False, width=100) for d in docs)
    return head + body
