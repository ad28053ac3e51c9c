"""``run.toml``: the one config file every role of a deployment reads.

It is the given TOML with the ``--set`` overrides applied and the keys a target decides
(where Redis is, where metrics are served) replaced; ``bus.credentials_file`` is always
removed, since each role gets its own credentials from the target.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.config import Config, ConfigError, apply_override
from sluice.deploy.files import dump_toml
from sluice.deploy.plan import Plan


def raw_config(config: str | Path, overrides: Sequence[str]) -> dict[str, Any]:
    """The config file's TOML table with ``overrides`` applied (what `load_config`
    validates)."""
    data = tomllib.loads(Path(config).read_text())
    for o in overrides:
        apply_override(data, o)
    return data


def run_config(plan: Plan, data: Mapping[str, Any], replace: Mapping[str, Any]) -> str:
    """``run.toml``: ``data`` with each dotted key of ``replace`` set (None removes it),
    and ``bus.credentials_file`` removed (each role gets its own credentials from the
    target). Validated like any config, so a render never ships one a role refuses."""
    out: dict[str, Any] = _copy(data)
    for key, value in {"bus.credentials_file": None, **replace}.items():
        *parents, last = key.split(".")
        node: dict[str, Any] | None = out
        for p in parents:
            if node is not None and (p in node or value is not None):
                node = node.setdefault(p, {})
            else:
                node = None
        if node is None:
            continue
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    # a table emptied by the removals above goes too
    out = {k: v for k, v in out.items() if not (v == {} and data.get(k))}
    text = dump_toml(out, header=[
        f"Run {plan.run!r} as deployed on {plan.target}: rendered by `sluice deploy render`",
        "from its config and --set overrides; every role of the deployment reads this file.",
        "Re-render instead of editing (docs/deploying.md)."])
    try:
        Config.model_validate(tomllib.loads(text))
    except Exception as e:  # a replacement the config type refuses: a bug of the target
        raise ConfigError(f"the rendered run.toml is not a valid config: {e}") from None
    return text


def _copy(node: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _copy(v) if isinstance(v, Mapping) else v for k, v in node.items()}
