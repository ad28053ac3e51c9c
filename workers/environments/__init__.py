"""Multi-turn environments: the contract (`base`), the episode runner (`runner`) and the
built-in environments (`builtin`). Adapters for other libraries' environments live in
their own modules (imported only when configured)."""

from workers.environments.base import (
    Action,
    Environment,
    EpisodeFailure,
    Observation,
    StepResult,
    load_environment,
)

__all__ = ["Action", "Environment", "EpisodeFailure", "Observation", "StepResult",
           "load_environment"]
