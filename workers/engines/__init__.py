"""Rollout engines: the `Engine` contract (base.py) and its implementations."""

from workers.engines.base import Completion, Engine, EngineError, SamplingParams

__all__ = ["Completion", "Engine", "EngineError", "SamplingParams"]
