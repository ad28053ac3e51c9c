"""One training step's maths on a model: logprobs, the GRPO loss, the optimizer passes.

Kept apart from the trainer role (Redis, publishing, checkpoints) so the equality tests
against TRL run exactly this code on a hand-built batch.

``num_iterations`` (TRL's μ) > 1 takes several optimizer steps on one batch. As in TRL,
the "old" logprobs are computed once, with no gradient, by the weights that start the
batch, and every pass clips ``exp(logps - old)``; the importance weights against the
behaviour logprobs use those same old logprobs, so they are fixed for the batch. With
μ = 1 no extra forward is done (old = detached logps: same values, ratio exactly 1).

The KL reference (``beta > 0``) is a frozen ``ref_model`` for full-weight runs; for a
LoRA (peft) policy it is the policy itself with its adapter disabled, i.e. the frozen
base, so no second copy of the model is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pipeline.model import is_peft
from trainer.batch import Batch, completion_logits
from trainer.loss import (
    LossConfig,
    candidate_log_softmax,
    entropy_from_logits,
    grpo_loss,
    selective_log_softmax,
)


def token_logps(model: torch.nn.Module, batch: Batch,
                temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logps [B, T], completion logits [B, T, V])`` of the sampled completion tokens.

    Over each token's candidate set when the batch carries them, else the full vocabulary;
    both at ``temperature``.
    """
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    comp = completion_logits(logits.float(), batch)
    if batch.candidates is not None:
        return candidate_log_softmax(comp, batch.completion_ids, batch.candidates,
                                     temperature), comp
    return selective_log_softmax(comp, batch.completion_ids, temperature), comp


@torch.no_grad()
def reference_logps(model: torch.nn.Module, batch: Batch, temperature: float,
                    ref_model: torch.nn.Module | None = None) -> torch.Tensor | None:
    """Reference logprobs ``[B, T]`` for the KL term, without gradient.

    From ``ref_model`` when given; else, for a peft policy, from ``model`` with its
    adapter disabled (the frozen base: exactly what the adapter started from); else None.
    """
    if ref_model is not None:
        return token_logps(ref_model, batch, temperature)[0]
    if not is_peft(model):
        return None
    with model.disable_adapter():  # type: ignore[operator]
        return token_logps(model, batch, temperature)[0]


@dataclass
class StepSettings:
    loss: LossConfig
    temperature: float
    num_iterations: int = 1
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations must be >= 1, got {self.num_iterations}")


def compute_loss(model: torch.nn.Module, batch: Batch, st: StepSettings,
                 old_logps: torch.Tensor | None = None,
                 ref_logps: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Differentiable loss of ``model`` on ``batch`` plus metrics (incl. entropy)."""
    logps, comp = token_logps(model, batch, st.temperature)
    loss, metrics = grpo_loss(logps, old_logps, batch.behaviour_logps, batch.advantages,
                              batch.mask, st.loss, ref_logps=ref_logps)
    with torch.no_grad():
        ent = entropy_from_logits(comp.detach() / st.temperature)
        m = batch.mask
        metrics["entropy"] = float((ent * m).sum() / m.sum().clamp(min=1))
    return loss, metrics


def optimize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch,
             st: StepSettings, ref_model: torch.nn.Module | None = None) -> dict[str, float]:
    """``num_iterations`` optimizer steps on ``batch``; metrics averaged over the passes.

    ``loss`` and ``entropy`` are of the first pass (the policy that the batch met);
    ``grad_norm`` is the mean pre-clip norm (a LoRA policy's frozen base has no
    gradient, so it counts only the adapter). The reference is `reference_logps`.
    """
    ref = old = None
    if st.loss.beta > 0:
        ref = reference_logps(model, batch, st.temperature, ref_model)
    if st.num_iterations > 1:
        with torch.no_grad():
            old, _ = token_logps(model, batch, st.temperature)
    passes: list[dict[str, float]] = []
    for _ in range(st.num_iterations):
        loss, metrics = compute_loss(model, batch, st, old_logps=old, ref_logps=ref)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), st.max_grad_norm)
        optimizer.step()
        passes.append({**metrics, "loss": float(loss.item()), "grad_norm": float(norm)})
    out = {k: _mean([p[k] for p in passes]) for k in passes[0]}
    out["loss"], out["entropy"] = passes[0]["loss"], passes[0]["entropy"]
    return out


def _mean(xs: list[float]) -> float:
    finite = [x for x in xs if not math.isnan(x)]
    return sum(finite) / len(finite) if finite else math.nan
