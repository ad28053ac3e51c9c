"""Import what a config names by path: reward functions, environments, hooks.

Everything user-supplied is named ``"package.module:name"`` (``name`` may be dotted, e.g.
``Class.method``) so that every process can load it on its own; nothing is pickled.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def load_callable(path: str, what: str) -> Callable[..., Any]:
    """The callable ``path`` names; ``ValueError`` starting with ``what`` (e.g.
    ``"reward 'm:f'"``) when the path is malformed, does not import, or names something
    that cannot be called."""
    module_name, sep, attr = path.partition(":")
    if (
        not sep
        or ":" in attr
        or not all(p.isidentifier() for p in module_name.split("."))
        or not all(p.isidentifier() for p in attr.split("."))
    ):
        raise ValueError(f"{what}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what}: cannot import module {module_name!r}: {e}") from e
    except Exception as e:
        raise ValueError(f"{what}: importing {module_name!r} failed: {e!r}") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what}: {attr!r} is {type(obj).__name__}, not callable")
    return obj  # type: ignore[no-any-return]
