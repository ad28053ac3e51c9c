"""The entropy bonus and Skywork-OR1's adaptive entropy control, as TRL 1.16 has them.

The loss gains ``- c · H̄``, with H̄ the mean per-token entropy (nats) of the policy at the
training temperature over the step's trained tokens, whatever ``loss_type`` normalises
the policy term by (so ``c`` means the same for every loss type; TRL's
``GRPOConfig.entropy_coef``). Its gradient is ``- c · ∇H̄``: it pushes every trained
position toward a flatter distribution, which keeps a policy from collapsing to
near-deterministic outputs (Skywork-OR1, arXiv 2505.22312, §3.2).

`EntropyControl` decides ``c`` for each step (TRL's ``use_adaptive_entropy``):

- static (``adaptive`` false): ``c`` = ``entropy_coef`` every step;
- adaptive: the coefficient ``coef`` starts at ``entropy_coef``; after every optimizer
  step whose entropy (over the step's trained tokens, every rank's: the caller reduces)
  was ``H``, ``coef`` ← min(coef + δ, max) if ``H ≤ target`` else max(coef − δ, min),
  and ``H`` is remembered; the *next* step applies ``coef`` only if that remembered
  ``H ≤ target``, else 0 (TRL: ``apply_coef``, ``_last_world_entropy``, initially +∞,
  so the first step applies none).

``enabled`` is fixed at construction, as TRL's ``_entropy_bonus_enabled``: a non-zero
initial coefficient or adaptive control. While enabled the trainer forwards every row,
rows at advantage 0 included: the bonus and the controller's measurement are over every
trained token, and such a row has entropy though its policy term is 0.

One difference from TRL: TRL takes the mean entropy per micro-batch and divides by the
accumulation steps (a mean of micro-batch means); sluice takes the token mean over the
whole step (the same when the step is one micro-batch, and independent of how the step
is split).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipeline.config.training import TrainerConfig


@dataclass
class EntropyControl:
    coef: float = 0.0
    adaptive: bool = False
    target: float = 0.2
    delta: float = 0.005
    coef_min: float = 0.0
    coef_max: float = 1.0
    last_entropy: float = math.inf
    """The entropy of the previous step (TRL's ``_last_world_entropy``)."""
    enabled: bool = field(init=False)

    def __post_init__(self) -> None:
        self.enabled = self.coef != 0.0 or self.adaptive

    @classmethod
    def of(cls, t: TrainerConfig) -> EntropyControl:
        """From the trainer section (entropy_coef, adaptive_entropy, entropy_target, …)."""
        return cls(coef=t.entropy_coef, adaptive=t.adaptive_entropy, target=t.entropy_target,
                   delta=t.entropy_coef_delta, coef_min=t.entropy_coef_min,
                   coef_max=t.entropy_coef_max)

    def applied(self) -> float:
        """The coefficient this step's loss uses."""
        if not self.adaptive:
            return self.coef
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, entropy: float) -> None:
        """After an optimizer step whose trained tokens had mean entropy ``entropy``
        (a skipped step, or one with no trained token (NaN), changes nothing)."""
        if not self.adaptive or not math.isfinite(entropy):
            return
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_entropy = entropy

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps (TRL saves the same two numbers)."""
        return {"entropy_coef": self.coef, "last_entropy": self.last_entropy}

    def restore(self, coef: float | None, last_entropy: float | None) -> None:
        if coef is not None:
            self.coef = coef
        if last_entropy is not None:
            self.last_entropy = last_entropy
