"""TRL's GRPOTrainer on SmolLM2-135M-Instruct and the ``compare`` task: the baseline
half of ``vs_trl_real.py``.

Run by ``vs_trl_real.py`` in its own process; writes ``eval.jsonl``, ``metrics.jsonl``
and ``profile.json`` as ``trl_copy.py`` does (its `HeldoutEval`, `EvalClock` and
`train_profiled`).

Everything the two sides must share is read from the sluice config the sluice arm runs
(``examples/smollm2_compare.toml`` with ``run.seed`` set), never restated here:

- the model folder (``model.path``, float32);
- the training prompts (`task_from_config`: CompareTask's 20,000 of this seed) and the
  held-out prompts (``task.heldout``), each given to TRL as a conversation (one user
  turn, ``task.system_prompt`` in front when set), which TRL renders with the chat
  template. TRL's rendering is checked against sluice's (`render_prompt`) token by token
  on 64 training and every held-out prompt before training: a mismatch stops the run.
  (A *string* prompt TRL would tokenize raw, without the template.);
- the rewards and weights (``scoring.rewards``: TRL's ``reward_weights``, summed then
  normalized per group with ``scoring.scale_rewards``, as the scorer does);
- the hyper-parameters: completions per step (``trainer.groups_per_step`` x
  ``generation.num_generations``), ``max_new_tokens``, temperature / top-k / top-p, lr
  and its schedule, AdamW betas and weight decay, grad-norm clip, loss type, epsilon(s),
  beta, IS level, iterations per batch;
- the evaluation: ``eval.rewards`` and ``eval.pass_threshold`` on greedy completions of
  the held-out prompts, through sluice's evaluator code on a transformers copy of the
  model (each row also has every reward's own mean: ``rewards/first_number_reward`` is
  held-out accuracy).

``--generation``: ``generate`` is TRL's default (``model.generate`` over the left-padded
batch); ``paged`` is its ``use_transformers_continuous_batching`` (transformers'
``generate_batch``). TRL's vLLM modes cannot run on this machine: ``vs_trl_real.py``'s
docstring says why.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script

import torch

from benchmarks.trl_copy import EvalClock, HeldoutEval, train_profiled
from pipeline.config import Config, load_config
from pipeline.model import load_model
from workers.tasks.catalog import task_from_config
from workers.tasks.prompts import messages_of, render_prompt
from workers.tasks.rewards import load_rewards


def grpo_args(cfg: Config, out: Path, seed: int, generation: str, log_every: int) -> dict:
    """GRPOConfig keyword arguments: the sluice config's settings under TRL's names."""
    g, t = cfg.generation, cfg.trainer
    return dict(
        output_dir=str(out / "trl"), seed=seed,
        per_device_train_batch_size=t.groups_per_step * g.num_generations,
        num_generations=g.num_generations, max_completion_length=g.max_new_tokens,
        temperature=t.temperature or g.temperature, top_k=g.top_k, top_p=g.top_p,
        learning_rate=t.lr, lr_scheduler_type=t.lr_scheduler, warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay, max_grad_norm=t.max_grad_norm, optim="adamw_torch",
        adam_beta1=t.adam_betas[0], adam_beta2=t.adam_betas[1], beta=t.beta,
        use_bias_correction_kl=t.kl_bias_correction, loss_type=t.loss_type,
        epsilon=t.epsilon, epsilon_high=t.epsilon_high,
        importance_sampling_level=t.importance_sampling_level,
        num_iterations=t.num_iterations, scale_rewards=cfg.scoring.scale_rewards,
        # GRPOConfig turns activation checkpointing on by default (a memory saving that
        # recomputes each forward: slower); sluice's trainer runs as configured (off)
        gradient_checkpointing=t.gradient_checkpointing,
        reward_weights=[r.weight for r in cfg.scoring.rewards],
        use_transformers_continuous_batching=generation == "paged",
        max_steps=10**6, save_strategy="no", logging_steps=log_every, report_to="none",
        bf16=False, use_cpu=True, disable_tqdm=True)


def check_rendering(tr: object, tok: object, prompts: list[dict], system_prompt: str) -> str:
    """TRL's own prompt tokenization (``GRPOTrainer._tokenize_prompts``, the call its
    generation makes) against sluice's `render_prompt` on ``prompts``: identical token ids,
    or SystemExit naming the first prompt that differs."""
    convs = [messages_of(p["text"], system_prompt) for p in prompts]
    trl_ids = tr._tokenize_prompts(convs)[0]  # type: ignore[attr-defined]
    for p, ids in zip(prompts, trl_ids, strict=True):
        ours = render_prompt(tok, p["text"], system_prompt)
        if list(ids) != ours:
            raise SystemExit(f"TRL renders {p['text']!r} as {list(ids)}, sluice as {ours}")
    return f"{len(prompts)} prompts: identical token ids"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--config", type=Path, required=True, help="the sluice arm's config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="the sluice arm's overrides that matter here (model.path, ...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--generation", choices=("generate", "paged"), default="generate")
    p.add_argument("--budget-s", type=float, default=1200)
    p.add_argument("--eval-every-s", type=float, default=150)
    p.add_argument("--target", type=float, default=2.0, help="stop at pass@1 >= this")
    p.add_argument("--log-every", type=int, default=1, help="TRL logging_steps")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    a.out.mkdir(parents=True, exist_ok=True)
    for name in ("eval.jsonl", "metrics.jsonl", "profile.json"):
        (a.out / name).unlink(missing_ok=True)

    import datasets
    from trl import GRPOConfig, GRPOTrainer

    cfg = load_config(a.config, [*a.set, f"run.seed={a.seed}"])
    model_dir = Path(cfg.model.path)
    model, tok = load_model(model_dir, dtype=cfg.model.dtype)
    model.train()
    task = task_from_config(cfg, tok)
    sys_prompt = cfg.task.system_prompt
    rows = [task.prompt(i) for i in range(len(task))]
    heldout = task.heldout(cfg.task.heldout)
    ds = datasets.Dataset.from_dict({"prompt": [messages_of(r["text"], sys_prompt) for r in rows],
                                     "answer": [r["answer"] for r in rows]})
    held = HeldoutEval(model_dir, heldout, cfg.generation.max_new_tokens,
                       load_rewards(cfg, "eval.rewards"), sys_prompt, cfg.eval.pass_threshold)
    per_step = cfg.trainer.groups_per_step * cfg.generation.num_generations
    clock = EvalClock(a.out, lambda m: held(m.state_dict()), a.eval_every_s, a.budget_s,
                      a.target, per_step)
    tr = GRPOTrainer(model=model, reward_funcs=[r.fn for r in load_rewards(cfg)],
                     args=GRPOConfig(**grpo_args(cfg, a.out, a.seed, a.generation,
                                                 a.log_every)),
                     train_dataset=ds, processing_class=tok, callbacks=[clock])
    rendering = check_rendering(tr, tok, rows[:64] + heldout, sys_prompt)
    print(f"trl: {rendering}; {a.threads} thread(s), generation {a.generation}", flush=True)
    train_profiled(tr, clock, a.out, per_step, {"rendering": rendering, "threads": a.threads,
                                                "generation": a.generation})


if __name__ == "__main__":
    main()
