"""What every config section shares: the error type, the base model and the patterns
that more than one section validates with.

Every section derives from `_Section`, so the rules stated on it (unknown keys are
errors, no float is ``inf`` or ``nan``, assignments are validated, each field's
docstring is its description) hold for the whole config tree; `pipeline.config.reference`
relies on the descriptions to write docs/configuration.md.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"
"""Device names a role accepts (`pipeline.devices.resolve_device`)."""

OPTIONAL_IMPORT_PATH = r"^$|^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
"""An optional hook, ``package.module:name``; empty = no hook."""


class ConfigError(ValueError):
    """A config file, key or value is wrong; the message names the key."""


class _Section(BaseModel):
    """Every section: unknown keys are errors, and no float anywhere may be ``inf``,
    ``-inf`` or ``nan`` (TOML spells all three, and ``gt=0`` lets ``inf`` through: an
    infinite timeout or learning rate is never meant). A field that needs "no limit" uses
    0, documented on the field."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True,
                              use_attribute_docstrings=True, allow_inf_nan=False)
