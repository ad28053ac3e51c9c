"""TRL's GRPOTrainer on sluice's ``copy`` task: the baseline half of ``vs_trl.py``.

Run by ``vs_trl.py`` in its own process; writes ``eval.jsonl`` rows in the evaluator's
format (``t``, ``ts``, ``step``, ``samples``, ``pass@1``, ``reward``, ``rewards/<fn>``) and
``profile.json`` (seconds in generation+scoring vs the rest of each step).

Same model files, prompts, held-out set, reward and evaluation code as sluice; the
hyperparameters come from the command line. Evaluation pauses TRL's clock (it would
otherwise be charged to TRL's training time); sluice's evaluator runs concurrently on
the same cores, so this favours TRL slightly.

What ``trl_real.py`` (the real-model baseline) shares from here: `HeldoutEval` (greedy
held-out evaluation through sluice's evaluator code on a copy of the model),
`EvalClock` (evaluation at fixed marks of TRL's training clock) and `train_profiled`.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import numpy as np
import torch
from transformers import TrainerCallback

from pipeline.model import load_model
from trainer.stats import zero_std_split
from workers.engines.transformers import TransformersEngine
from workers.evaluator import evaluate
from workers.tasks.catalog import make_task
from workers.tasks.rewards import RewardFn, load_reward, match_reward

# what sluice's evaluator uses with examples/copy.toml: pass@1 = greedy exact match
EVAL_REWARDS = [load_reward("workers.tasks.rewards:copy_reward"),
                load_reward("workers.tasks.rewards:exact_match", 0.0)]


def copy_reward(prompts: list, completions: list, completion_ids: list, answer: list,
                **_: Any) -> list[float | None]:
    """sluice's copy reward under TRL's call convention (eos kept in completion_ids)."""
    eos = copy_reward.eos_id  # type: ignore[attr-defined]
    fin = ["stop" if ids and ids[-1] == eos else "length" for ids in completion_ids]
    out = match_reward(completions=completions, answer=answer, finish_reason=fin)
    copy_reward.last = out  # type: ignore[attr-defined]  # MeasuredGRPO's zero-std split
    return out


class HeldoutEval:
    """Greedy held-out evaluation of given weights with sluice's evaluator code
    (`workers.evaluator.evaluate` on a `TransformersEngine`: prompts rendered as the
    generators render them, rewards in a reward process, `summarize_scores`), on a copy
    of the model at ``model_dir`` that this object owns. Calling it with a state dict
    (TRL's live model's, or a weight-store version's) loads that first; with None it
    evaluates the weights it holds (the model folder's, at first)."""

    def __init__(self, model_dir: Path, prompts: list[dict[str, Any]], max_new_tokens: int,
                 rewards: list[RewardFn], system_prompt: str = "",
                 pass_threshold: float = 1.0) -> None:
        self.model, self.tok = load_model(model_dir)
        self.model.eval()
        self.engine = TransformersEngine(self.model, self.tok)
        self.prompts, self.max_new, self.rewards = prompts, max_new_tokens, rewards
        self.system_prompt, self.pass_threshold = system_prompt, pass_threshold

    def __call__(self, state: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
        if state is not None:
            with torch.no_grad():
                self.model.load_state_dict(state, strict=False)  # tied aliases may be absent
        return asyncio.run(evaluate(self.engine, self.tok, self.prompts, self.max_new,
                                    self.rewards, system_prompt=self.system_prompt,
                                    pass_threshold=self.pass_threshold))


class EvalClock(TrainerCallback):
    """Held-out eval (``evaluate(model) -> row``) at fixed marks of TRL's training clock,
    0, ``every_s``, 2 ``every_s``, ...: at the first step end at or after each mark (marks
    a long step skipped are not made up), the clock paused while it runs (its time is not
    TRL's); the last at ``budget_s``, which stops training, as does ``key`` >= ``target``.
    A row's ``t`` is the clock when the evaluated weights existed (that step's end)."""

    def __init__(self, out: Path, evaluate: Callable[[torch.nn.Module], dict[str, float]],
                 every_s: float, budget_s: float, target: float, per_step: int,
                 key: str = "pass@1") -> None:
        self.out, self.evaluate, self.key = out, evaluate, key
        self.every_s, self.budget_s, self.target = every_s, budget_s, target
        self.per_step = per_step
        self.t0 = self.paused = 0.0
        self.next_mark = every_s

    def clock(self) -> float:
        return time.perf_counter() - self.t0 - self.paused

    def run_eval(self, model: torch.nn.Module, step: int) -> float:
        t_in = time.perf_counter()
        t = self.clock()
        res = self.evaluate(model)
        row = {"t": t, "ts": time.time(), "step": step, "samples": step * self.per_step,
               "eval_s": time.perf_counter() - t_in, **res}
        with open(self.out / "eval.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"trl t={t:6.1f}s step={step:5d} {self.key}={res[self.key]:.3f} "
              f"reward={res['reward']:.3f}", flush=True)
        self.paused += time.perf_counter() - t_in
        return res[self.key]

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.t0 = time.perf_counter()
        self.run_eval(kw["model"], 0)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kw: Any) -> None:
        """TRL's logged metrics (entropy, clip ratios, zero-std fraction, grad norm), one
        JSON line per logging step with the training clock: the mechanism table of
        ``vs_trl.py`` reads them next to sluice's metrics.jsonl."""
        row = {"step": state.global_step, "t": self.clock(), **(logs or {})}
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        t = self.clock()
        if t >= self.next_mark or t >= self.budget_s:
            while self.next_mark <= t:
                self.next_mark += self.every_s
            score = self.run_eval(kw["model"], state.global_step)
            if score >= self.target or t >= self.budget_s:
                control.should_training_stop = True


class MeasuredGRPO:
    """Mixed into TRL's ``GRPOTrainer`` (`measured_trainer`): logs, next to TRL's own
    metrics, the two figures sluice's mechanism table compares on the same footing —
    ``entropy/adv_nonzero`` (mean token entropy over completions with a non-zero
    advantage: TRL's ``entropy`` covers every completion, sluice forwards only these at
    β = 0) and the ``frac_reward_zero_std/solved|stuck`` split (`trainer.stats`), from the
    reward function's last call (``reward_fn.last``: one generation batch, groups
    contiguous, as TRL's sampler orders them). TRL's loss and updates are untouched."""

    reward_fn: Any = None
    pass_threshold: float = 1.0

    def _get_per_token_logps_and_entropies(self, *args: Any, **kw: Any) -> Any:
        out = super()._get_per_token_logps_and_entropies(*args, **kw)  # type: ignore[misc]
        self._entropies = out[1]
        return out

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
        self._entropies = None
        loss = super()._compute_loss(model, inputs)  # type: ignore[misc]
        ent, adv = self._entropies, inputs["advantages"]
        if ent is not None and self.model.training:
            rows = (adv != 0) if adv.dim() == 1 else (adv != 0).any(dim=1)
            m = inputs["completion_mask"] * rows[:, None]
            if float(m.sum()) > 0:
                self._metrics["train"]["entropy/adv_nonzero"].append(
                    float((ent.detach() * m).sum() / m.sum()))
        return loss

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        out = super()._generate_and_score_completions(inputs)  # type: ignore[misc]
        last = getattr(self.reward_fn, "last", None)
        if last and self.model.training:
            g = self.num_generations
            split = zero_std_split([np.asarray(last[i:i + g], dtype=float)
                                    for i in range(0, len(last), g)], self.pass_threshold)
            for k in ("frac_reward_zero_std/solved", "frac_reward_zero_std/stuck"):
                self._metrics["train"][k].append(split[k])
        return out


def measured_trainer(reward_fn: Any, pass_threshold: float = 1.0) -> type:
    """TRL's ``GRPOTrainer`` with `MeasuredGRPO` mixed in."""
    from trl import GRPOTrainer

    return type("MeasuredGRPOTrainer", (MeasuredGRPO, GRPOTrainer),
                {"reward_fn": reward_fn, "pass_threshold": pass_threshold})


def config_overrides(pairs: list[str]) -> dict[str, Any]:
    """``--config KEY=VALUE`` pairs as ``GRPOConfig`` keyword arguments (values read as
    Python literals where they parse, e.g. ``use_adaptive_entropy=True``, else strings:
    ``scale_rewards=none``)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--config wants KEY=VALUE, got {pair!r}")
        try:
            out[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            out[key] = raw
    return out


def train_profiled(tr: Any, clock: EvalClock, out: Path, per_step: int,
                   extra: dict[str, Any] | None = None) -> None:
    """``tr.train()`` with the seconds spent in TRL's generation + scoring
    (``_generate_and_score_completions``) timed apart; ``profile.json`` gets them, the
    rest of the training clock, the steps and ``extra``."""
    gen_s = [0.0]
    inner = tr._generate_and_score_completions

    def timed(inputs: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(inputs)
        finally:
            gen_s[0] += time.perf_counter() - t

    tr._generate_and_score_completions = timed
    tr.train()
    total = clock.clock()
    (out / "profile.json").write_text(json.dumps({
        "train_clock_s": total, "generate_and_score_s": gen_s[0],
        "optimize_and_rest_s": total - gen_s[0], "steps": tr.state.global_step,
        "completions_per_s": tr.state.global_step * per_step / max(total, 1e-9),
        **(extra or {})}, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--budget-s", type=float, default=600)
    p.add_argument("--eval-every-s", type=float, default=10)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--adam-beta2", type=float, default=0.99)
    p.add_argument("--no-kl-bias-correction", action="store_true",
                   help="use_bias_correction_kl=False (only matters with --beta > 0)")
    p.add_argument("--completions-per-step", type=int, default=64)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--heldout", type=int, default=256)
    p.add_argument("--log-every", type=int, default=25,
                   help="TRL logging_steps: its metrics, averaged, every this many steps")
    p.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="a GRPOConfig field over this script's settings (an ablation: "
                        "scale_rewards=none, use_adaptive_entropy=True, adam_beta1=0.8)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "eval.jsonl").unlink(missing_ok=True)
    (a.out / "metrics.jsonl").unlink(missing_ok=True)

    import datasets
    from trl import GRPOConfig

    task = make_task("copy", seed=a.seed, num_prompts=20_000)  # = task.num_prompts default
    heldout = task.heldout(a.heldout)
    rows = [task.prompt(i) for i in range(len(task))]
    ds = datasets.Dataset.from_dict({"prompt": [r["text"] for r in rows],
                                     "answer": [r["answer"] for r in rows]})
    model, tok = load_model(a.model)
    model.train()
    copy_reward.eos_id = tok.eos_token_id  # type: ignore[attr-defined]
    settings: dict[str, Any] = dict(
        output_dir=str(a.out / "trl"), per_device_train_batch_size=a.completions_per_step,
        num_generations=a.num_generations, max_completion_length=a.max_new_tokens,
        learning_rate=a.lr, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=a.adam_beta2, beta=a.beta,
        use_bias_correction_kl=not a.no_kl_bias_correction,
        loss_type="dapo", epsilon=0.2, scale_rewards="group",
        temperature=1.0, max_steps=10**6, save_strategy="no", logging_steps=a.log_every,
        report_to="none", bf16=False, use_cpu=True, seed=a.seed, disable_tqdm=True,
        gradient_checkpointing=False)  # GRPOConfig's default is True (slower); sluice's off
    cfg = GRPOConfig(**{**settings, **config_overrides(a.config)})
    held = HeldoutEval(a.model, heldout, a.max_new_tokens, EVAL_REWARDS)
    clock = EvalClock(a.out, lambda m: held(m.state_dict()), a.eval_every_s, a.budget_s,
                      a.target, a.completions_per_step)
    tr = measured_trainer(copy_reward)(model=model, reward_funcs=[copy_reward], args=cfg,
                                       train_dataset=ds, processing_class=tok,
                                       callbacks=[clock])
    train_profiled(tr, clock, a.out, a.completions_per_step)


if __name__ == "__main__":
    main()
