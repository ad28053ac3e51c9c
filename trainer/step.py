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

A step is split into micro-batches under ``micro_batch_tokens`` (`trainer.batch`), each
laid out padded or packed (`trainer.packing`) and forwarded through the memory-lean path
(`trainer.logprobs`); gradients accumulate over them. The loss normaliser is the whole
step's (`LossNorm`: every rank's trained tokens and rows), so the accumulated gradient
equals one full-batch backward (tested for every loss_type). A data-parallel job passes a
`DataParallel` whose ``grad_scale`` undoes the wrapper's averaging over ranks and whose
``all_reduce`` makes the normaliser global.

A step whose loss or gradient norm is not finite is skipped: gradients are dropped, the
optimizer does not step, and the result says ``skipped = 1`` (the trainer then never
publishes it). `token_logps` / `reference_logps` are the plain full-logits reference
implementation the tests compare the lean path with.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from pipeline.model import is_peft
from pipeline.rl.logprobs import candidate_log_softmax, selective_log_softmax
from pipeline.rl.losses import LossConfig, LossNorm, grpo_loss
from trainer.batch import Batch, completion_logits, split_micro_batches
from trainer.logprobs import CompletionLogprobs
from trainer.packing import LayoutKind, layout_stats, make_layout, row_shapes, shapes_cost


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
    micro_batch_tokens: int = 0
    """Forwarded-token budget of one micro-batch; 0 = the whole step at once."""
    layout: LayoutKind = "padded"
    chunk_tokens: int = 256
    """Completion tokens whose vocabulary logits exist at once (`trainer.logprobs`)."""
    pad_id: int = 0
    compute_dtype: torch.dtype | None = None
    """Autocast dtype (mixed precision over float32 parameters); None = no autocast."""
    fp32_head: bool = True
    """The LM head in float32 under autocast (`trainer.fp32_lm_head`), for a model that
    is not already wrapped in `CompletionLogprobs`."""

    def __post_init__(self) -> None:
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations must be >= 1, got {self.num_iterations}")
        if self.micro_batch_tokens < 0:
            raise ValueError(f"micro_batch_tokens must be >= 0, got {self.micro_batch_tokens}")


@dataclass
class DataParallel:
    """How a data-parallel job combines ranks: ``all_reduce`` sums a float64 tensor over
    ranks in place; ``grad_scale`` multiplies each rank's loss (FSDP/DDP average
    gradients over ranks, the GRPO normaliser already divides by the global count)."""

    all_reduce: Callable[[torch.Tensor], None] = field(default=lambda t: None)
    grad_scale: float = 1.0
    all_max: Callable[[int], int] = field(default=lambda n: n)
    """The largest of every rank's ``n``: each rank runs that many micro-batches (FSDP's
    collectives need the same number of forwards and backwards on every rank)."""


def micro_batches(batch: Batch, st: StepSettings) -> list[Batch]:
    shapes = row_shapes(batch)
    return split_micro_batches(batch, st.micro_batch_tokens,
                               lambda rows: shapes_cost([shapes[i] for i in rows], st.layout))


def step_norm(batch: Batch, dp: DataParallel | None = None) -> LossNorm:
    """The whole step's normaliser: trained tokens and rows, summed over ranks."""
    t = torch.tensor([float(batch.mask.sum()), float(batch.num_rows)], dtype=torch.float64)
    if dp is not None:
        dp.all_reduce(t)
    return LossNorm(tokens=float(t[0]), rows=int(t[1]))


def gradient_rows(batch: Batch, loss: LossConfig, every_row: bool = False) -> torch.Tensor:
    """Indices of the rows whose gradient can be non-zero. With ``beta`` = 0 a row at
    advantage exactly 0 (a zero-variance group, trained as TRL does with
    ``scoring.zero_variance = "train"``) has per-token loss ``-min(r·0, clip(r)·0)·w = 0``
    and zero gradient under every loss type, so it is not forwarded: its tokens and row
    still count in the step's normaliser (`step_norm`), which is all it contributes.
    Per-step metrics (entropy, clip and IS ratios) are then over the forwarded rows.
    ``every_row``: all rows (an entropy bonus has a gradient at advantage 0 too)."""
    if loss.beta > 0 or every_row:
        return torch.arange(batch.num_rows)
    return torch.nonzero(_advantage_rows(batch.advantages, batch.mask)).flatten()


def _advantage_rows(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool: rows with a non-zero advantage (per-token advantages: any non-zero
    one on a trained token)."""
    nonzero = advantages != 0
    if nonzero.dim() == 2:
        nonzero = (nonzero & (mask > 0)).any(dim=1)
    return nonzero


def lean_logps(model: torch.nn.Module, mb: Batch, st: StepSettings, with_entropy: bool = False,
               entropy_grad: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(logps [B, T], entropy [B, T] | None, top [B, T, k] | None)`` of a micro-batch
    through the memory-lean path (``top``: at the sampler's top ids, when carried);
    ``model`` is a policy or its `CompletionLogprobs` wrapper (the FSDP root)."""
    fwd = model if isinstance(model, CompletionLogprobs) else CompletionLogprobs(
        model, st.temperature, st.chunk_tokens, st.fp32_head)
    layout = make_layout(mb, st.layout, st.pad_id)
    with _autocast(fwd, st.compute_dtype):
        return fwd(layout, mb, with_entropy, entropy_grad)


def compute_loss(model: torch.nn.Module, batch: Batch, st: StepSettings,
                 old_logps: torch.Tensor | None = None,
                 ref_logps: torch.Tensor | None = None, norm: LossNorm | None = None,
                 with_entropy: bool = True, entropy_coef: float = 0.0
                 ) -> tuple[torch.Tensor, dict[str, float]]:
    """Differentiable loss of ``model`` on (micro-)batch ``batch`` plus metrics (incl.
    entropy). ``norm`` is the whole step's normaliser; None = this batch's own.
    ``entropy_coef`` > 0 subtracts that times this batch's share of the step's mean
    token entropy (Σ entropy / the step's trained tokens; `pipeline.rl.entropy_control`),
    so the micro-batches' terms add up to ``entropy_coef · H̄``.

    ``entropy`` is over the batch's rows (the forwarded ones, `gradient_rows`);
    ``entropy/adv_nonzero`` over its rows with a non-zero advantage only: the tokens
    whose entropy TRL's and sluice's runs can be compared on whatever each forwards
    (TRL's ``entropy`` covers every completion, sluice's at β = 0 only these). Across
    micro-batches both are weighted by the micro-batch's tokens (`_Metrics`)."""
    bonus = entropy_coef > 0
    logps, ent, top = lean_logps(model, batch, st, with_entropy or bonus, entropy_grad=bonus)
    dev = logps.device
    loss, metrics = grpo_loss(logps, _on(old_logps, dev), batch.behaviour_logps.to(dev),
                              batch.advantages.to(dev), batch.mask.to(dev), st.loss,
                              ref_logps=_on(ref_logps, dev), norm=norm,
                              policy_top_logps=top,
                              sampler_top_logps=_on(batch.sampler_top_logps, dev))
    if ent is not None:
        m = batch.mask.to(dev)
        ent_sum = (ent * m).sum()
        metrics["entropy"] = float(ent_sum.detach() / m.sum().clamp(min=1))
        nz = _advantage_rows(batch.advantages.to(dev), m)
        if bool(nz.any()):  # the rows TRL's and sluice's entropy figures share
            m_nz = m * nz[:, None]
            metrics["entropy/adv_nonzero"] = float((ent * m_nz).sum().detach()
                                                   / m_nz.sum().clamp(min=1))
        if bonus:
            tokens = norm.tokens if norm is not None else float(m.sum())
            loss = loss - entropy_coef * ent_sum / max(tokens, 1.0)
    return loss, metrics


@torch.no_grad()
def lean_reference_logps(model: torch.nn.Module, mb: Batch, st: StepSettings,
                         ref_model: torch.nn.Module | None) -> torch.Tensor | None:
    """`reference_logps` through the lean path (one micro-batch)."""
    if ref_model is not None:
        return lean_logps(ref_model, mb, st)[0]
    policy = model.policy if isinstance(model, CompletionLogprobs) else model
    if not is_peft(policy):
        return None
    with policy.disable_adapter():  # type: ignore[operator]
        return lean_logps(model, mb, st)[0]


def optimize(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch,
             settings: StepSettings, ref_model: torch.nn.Module | None = None, *,
             data_parallel: DataParallel | None = None,
             scaler: torch.amp.GradScaler | None = None, entropy_coef: float = 0.0,
             every_row: bool = False) -> dict[str, float]:
    """``num_iterations`` optimizer steps on ``batch``, gradients accumulated over its
    micro-batches; metrics averaged over the passes (token-weighted within one).

    ``loss`` and ``entropy`` are of the first pass (the policy that the batch met);
    ``grad_norm`` is the mean pre-clip norm (a LoRA policy's frozen base has no
    gradient, so it counts only the adapter). ``skipped`` is 1 when a pass met a
    non-finite loss or gradient norm: that pass did not step and later passes were not
    run. ``micro_batches`` counts the micro-batches of the step.

    In a data-parallel job a rank with fewer micro-batches than the busiest rank repeats
    its first one at weight 0 (same collectives, zero gradient).

    ``entropy_coef`` > 0 adds the entropy bonus to every pass; ``every_row`` (the bonus
    enabled, `EntropyControl.enabled`) forwards rows at advantage 0 too and makes
    ``entropy`` the mean over every rank's trained tokens, which adaptive control reads.
    """
    # every row counts in the normaliser, forwarded or not
    loss_norm = step_norm(batch, data_parallel)
    step_batches, weights = _weighted_micro_batches(batch, settings, data_parallel,
                                                    every_row)
    ref_logps: list[torch.Tensor | None] = [None] * len(step_batches)
    old_logps: list[torch.Tensor | None] = [None] * len(step_batches)
    if settings.loss.beta > 0:
        ref_logps = [lean_reference_logps(model, micro_batch, settings, ref_model)
                     for micro_batch in step_batches]
    if settings.num_iterations > 1:
        with torch.no_grad():
            old_logps = [lean_logps(model, micro_batch, settings)[0]
                         for micro_batch in step_batches]
    trainable_params = [p for p in model.parameters() if p.requires_grad]
    grad_scale = data_parallel.grad_scale if data_parallel is not None else 1.0
    passes: list[dict[str, float]] = []
    skipped = 0.0
    for pass_index in range(settings.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        pass_loss = 0.0  # sum of the micro-batches' losses: the pass's loss (global norm)
        pass_metrics = _Metrics()
        for index, micro_batch in enumerate(step_batches):
            loss, metrics = compute_loss(model, micro_batch, settings, old_logps[index],
                                         ref_logps[index], loss_norm,
                                         with_entropy=pass_index == 0,
                                         entropy_coef=entropy_coef * weights[index])
            scaled = loss * (grad_scale * weights[index])
            (scaler.scale(scaled) if scaler is not None else scaled).backward()
            if weights[index]:
                pass_loss += float(loss.detach())
                pass_metrics.add(metrics, float(micro_batch.mask.sum()))
        if scaler is not None:
            scaler.unscale_(optimizer)
        grad_norm = _clipped_grad_norm(trainable_params, settings.max_grad_norm)
        non_finite = not (math.isfinite(pass_loss) and math.isfinite(grad_norm))
        if data_parallel is not None:  # every rank: the global loss, and one skip decision
            pass_loss, non_finite = _agree_on_skip(data_parallel, pass_loss, non_finite)
        if non_finite:
            optimizer.zero_grad(set_to_none=True)
            if scaler is not None:  # let the scaler lower its scale for the next step
                scaler.update()
            skipped = 1.0
            passes.append({**pass_metrics.result(), "loss": pass_loss, "grad_norm": grad_norm})
            break
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        passes.append({**pass_metrics.result(), "loss": pass_loss, "grad_norm": grad_norm})
    out = {k: _mean([p.get(k, math.nan) for p in passes]) for k in passes[0]}
    out["loss"], out["entropy"] = passes[0]["loss"], passes[0].get("entropy", math.nan)
    if every_row and data_parallel is not None:  # one figure on every rank: all tokens'
        h = out["entropy"]
        tokens = float(sum(float(b.mask.sum()) * w for b, w in zip(step_batches, weights,
                                                                   strict=True)))
        sums = torch.tensor([0.0 if math.isnan(h) else h * tokens,
                             0.0 if math.isnan(h) else tokens], dtype=torch.float64)
        data_parallel.all_reduce(sums)
        out["entropy"] = float(sums[0] / sums[1]) if sums[1] > 0 else math.nan
    out["skipped"] = skipped
    out["micro_batches"] = float(sum(w > 0 for w in weights))
    out.update(layout_stats([b for b, w in zip(step_batches, weights, strict=True) if w],
                            settings.layout))
    return out


def _weighted_micro_batches(batch: Batch, settings: StepSettings,
                            data_parallel: DataParallel | None, every_row: bool = False
                            ) -> tuple[list[Batch], list[float]]:
    """The step's micro-batches and each one's gradient weight (1.0, or 0.0 for a
    stand-in that only keeps the collectives in step). Only `gradient_rows` are
    forwarded; with none, one zero-weight row keeps the step (zero gradients, so AdamW
    still steps). With ``data_parallel``, the first micro-batch is repeated at weight 0
    until every rank runs as many as the busiest."""
    gradient_row_ids = gradient_rows(batch, settings.loss, every_row)
    if len(gradient_row_ids) == 0:
        step_batches, weights = [batch.rows([0])], [0.0]
    else:
        forwarded = (batch if len(gradient_row_ids) == batch.num_rows
                     else batch.rows(gradient_row_ids))
        step_batches = micro_batches(forwarded, settings)
        weights = [1.0] * len(step_batches)
    if data_parallel is not None:
        repeats = data_parallel.all_max(len(step_batches)) - len(step_batches)
        step_batches = step_batches + [step_batches[0]] * repeats
        weights = weights + [0.0] * repeats
    return step_batches, weights


def _clipped_grad_norm(params: list[torch.Tensor], max_grad_norm: float) -> float:
    """The pre-clip gradient norm of ``params`` (global under FSDP2), after clipping
    them to ``max_grad_norm``."""
    norm_tensor = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    if hasattr(norm_tensor, "full_tensor"):  # FSDP2: a DTensor of the global norm
        norm_tensor = norm_tensor.full_tensor()
    return float(norm_tensor)


def _agree_on_skip(data_parallel: DataParallel, pass_loss: float,
                   non_finite: bool) -> tuple[float, bool]:
    """``(global loss, skip)`` the same on every rank: the losses summed over ranks, and
    a skip (with a NaN loss) when any rank met a non-finite loss or gradient norm."""
    loss_and_skips = torch.tensor([pass_loss if not non_finite else 0.0, float(non_finite)],
                                  dtype=torch.float64)
    data_parallel.all_reduce(loss_and_skips)
    any_skip = bool(loss_and_skips[1] > 0)
    return (math.nan if any_skip else float(loss_and_skips[0])), any_skip


class _Metrics:
    """Token-weighted means of per-micro-batch metrics; min/max kept as min/max."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.extrema: dict[str, float] = {}

    def add(self, metrics: dict[str, float], tokens: float) -> None:
        for k, v in metrics.items():
            if math.isnan(v):
                continue
            if k.endswith("/min") or k.endswith("/max"):
                pick = min if k.endswith("/min") else max
                self.extrema[k] = pick(self.extrema.get(k, v), v)
            else:
                self.sums[k] = self.sums.get(k, 0.0) + v * tokens
                self.weights[k] = self.weights.get(k, 0.0) + tokens

    def result(self) -> dict[str, float]:
        out = {k: self.sums[k] / w if (w := self.weights[k]) > 0 else math.nan
               for k in self.sums}
        return {**out, **self.extrema}


@contextlib.contextmanager
def _autocast(model: torch.nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    device = next(model.parameters()).device
    with torch.autocast(device.type, dtype=dtype):
        yield


def _on(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def _mean(xs: list[float]) -> float:
    finite = [x for x in xs if not math.isnan(x)]
    return sum(finite) / len(finite) if finite else math.nan
