"""The one config type: a run described by one TOML file, read by every role.

Every field has bounds and a docstring; unknown keys are errors, so a typo fails at
start with the dotted key named instead of being silently ignored. ``--set a.b=c``
overrides are parsed as TOML values (``--set trainer.lr=3e-4``, ``--set run.name='"x"'``
or simply ``--set run.name=x``: a value that is not valid TOML is taken as a string).

This package's public face; importers use ``from pipeline.config import ...``. Inside:
base (the section base class, `ConfigError`), one module per group of sections (run,
model, generation, scoring, training, observers; operator: the sections no role
reads), root (`Config` and its cross-section rules), loading (`load_config`,
`apply_override`) and reference (the docs/configuration.md table).
"""

from pipeline.config.base import ConfigError
from pipeline.config.generation import EnvironmentConfig, GenerationConfig, VLLMConfig
from pipeline.config.loading import apply_override, load_config
from pipeline.config.model import LoraConfig, ModelConfig, TaskConfig
from pipeline.config.observers import ArchiveConfig, EvalConfig, MetricsConfig
from pipeline.config.operator import DeployConfig, UpConfig
from pipeline.config.reference import reference_rows
from pipeline.config.root import Config
from pipeline.config.run import BusConfig, RunConfig
from pipeline.config.scoring import RewardSpec, ScoringConfig
from pipeline.config.training import TrainerConfig, WeightsConfig

__all__ = [
    "ArchiveConfig",
    "BusConfig",
    "Config",
    "ConfigError",
    "DeployConfig",
    "EnvironmentConfig",
    "EvalConfig",
    "GenerationConfig",
    "LoraConfig",
    "MetricsConfig",
    "ModelConfig",
    "RewardSpec",
    "RunConfig",
    "ScoringConfig",
    "TaskConfig",
    "TrainerConfig",
    "UpConfig",
    "VLLMConfig",
    "WeightsConfig",
    "apply_override",
    "load_config",
    "reference_rows",
]
