"""Held-out reward of a trained checkpoint, with the evaluator's own code (greedy, the
run's eval rewards): what `churn.py` and `ab_replay.py` report for each run they compare."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from pipeline.config import Config
from pipeline.model import load_model
from workers.engines.transformers import TransformersEngine
from workers.evaluator import evaluate
from workers.tasks.catalog import task_from_config
from workers.tasks.rewards import load_rewards


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest ``checkpoints/step-*/model.safetensors`` of a run directory."""
    found = sorted((run_dir / "checkpoints").glob("step-*/model.safetensors"))
    return found[-1] if found else None


def heldout(cfg: Config, weights: Path | None, n: int = 128) -> dict[str, Any]:
    """Greedy held-out figures (``reward``, ``pass@1``, ``rewards/<fn>``) of the model in
    ``cfg.model.path`` with ``weights`` (a full ``model.safetensors``; None: the initial
    weights), on the task's first ``n`` held-out prompts."""
    model, tok = load_model(cfg.model.path)
    if weights is not None:
        with torch.no_grad():
            model.load_state_dict(load_file(str(weights)))
    prompts = task_from_config(cfg, tok).heldout(n)
    res = asyncio.run(evaluate(TransformersEngine(model, tok, seed=0), tok, prompts,
                               cfg.generation.max_new_tokens, load_rewards(cfg, "eval.rewards"),
                               pass_threshold=cfg.eval.pass_threshold,
                               system_prompt=cfg.task.system_prompt))
    return {"n": len(prompts), **res}
