"""Trainer tokens/s with packed and prefix-shared layouts vs padded, on the same batches.

    .venv/bin/python -m benchmarks.packing [--groups 8] [--generations 8] [--repeats 5]
        [--threads 1,2] [--micro-batch-tokens 0] [--quick] [--model DIR]
        [--arms padded,packed,shared,trie] [--multi-turn [--turns 2-5] [--turn-tokens 8-48]
        [--observation-tokens 8-24] [--repeat 0.5]]

Model: the tiny random-init Qwen2 of `pipeline.model.init_tiny_model` (2 layers, hidden
128, vocab 76, SDPA attention), ``max_position_embeddings`` 2048, float32; or the model
folder ``--model`` (e.g. SmolLM2-135M-Instruct: token ids drawn from its vocabulary). Batches:
``--groups`` x ``--generations`` synthetic samples (`benchmarks.synthetic`), prompts
of 32-128 tokens (one per group), completions drawn uniformly from 16-512 tokens; or,
with ``--multi-turn``, episodes (`benchmarks.synthetic.episode_groups`) of ``--turns``
model turns (mask 1) with an observation (mask 0) after each but the last, in which an
episode repeats, with probability ``--repeat`` per turn, the turn an earlier episode of
its group took from the same conversation (the same action, then the same observation
from a deterministic environment): episodes share the conversation so far up to where
they diverge, as multi-turn rollouts do.

Each arm is `trainer.step.optimize` (one AdamW step: forward, backward, clip, step)
with ``StepSettings.layout`` = ``padded`` (one row per sample, right-padded),
``packed`` (samples concatenated into rows, attention kept per sample by position ids),
``shared`` (packed with each group's prompt written once, a 4D tree mask) or ``trie``
(every shared prefix written once per row, rows as long as packed's, a 4D tree mask);
``--arms`` picks some. Each arm has its own copy of the same initial weights. One
warm-up step per arm and torch thread count (``--threads``), then for each of
``--repeats`` batches one timed step per thread count and arm, the order of both
rotated per batch (so a busy spell on the machine falls on every arm and thread count
alike). A step's tokens/s = its real tokens (prompt + completion of every sample: what
every layout must forward) / wall seconds of ``optimize``; an arm's is the median over
its timed steps (min-max shown), so one step slowed by another process on the machine
does not decide the result.
Tokens per CPU-second of this process are printed too, as a cross-check that is less
sensitive to other processes (at 1 thread close to the work itself).

Printed: per arm, forwarded tokens (`trainer.packing.layout_cost`, summed over the
step's micro-batches), the non-padding tokens written (a shared prefix once per row),
the query-key pairs its attention scores (rows x columns^2 of each layout: masks are
dense, so this is what SDPA computes), tokens/s per thread count
and the fastest thread count; the packing ratio = padded forwarded tokens / real tokens;
the gain = packed tokens/s / padded tokens/s (each at its own fastest thread count); and
gain / packing ratio against the issue's target of 0.8. ``shared`` is compared with the
same ratio, and so is ``trie`` (both may forward fewer tokens than there are real
ones). The machine may be shared and noisy: the ratios, measured in one run, are the
result.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path
from typing import TypeVar

import torch
from transformers.utils import logging as hf_logging

from benchmarks.synthetic import episode_groups, scored_groups
from pipeline.model import VOCAB_SIZE, init_tiny_model, load_model
from pipeline.rl.losses import LossConfig
from pipeline.runtime import set_threads
from trainer.batch import Batch, build_batch
from trainer.packing import LayoutKind, layout_cost, layout_stats, make_layout
from trainer.step import StepSettings, micro_batches, optimize

ARMS: tuple[LayoutKind, ...] = ("padded", "packed", "shared", "trie")
T = TypeVar("T")
TARGET = 0.8


def make_batches(a: argparse.Namespace, n: int, seed0: int) -> list[Batch]:
    if a.multi_turn:
        return [build_batch(episode_groups(
            a.groups, a.generations, vocab_size=a.vocab_size, prompt_tokens=a.prompt_tokens,
            turns=a.turns, turn_tokens=a.turn_tokens, observation_tokens=a.observation_tokens,
            repeat=a.repeat, seed=seed0 + i), pad_id=0) for i in range(n)]
    return [build_batch(scored_groups(a.groups, a.generations, vocab_size=a.vocab_size,
                                      prompt_tokens=a.prompt_tokens,
                                      completion_tokens=a.completion_tokens, seed=seed0 + i),
                        pad_id=0) for i in range(n)]


def written(batch: Batch, st: StepSettings) -> int:
    """Non-padding tokens the layout writes over the step's micro-batches."""
    stats = [layout_stats([mb], st.layout) for mb in micro_batches(batch, st)]
    return round(sum(x["batch/row_tokens_mean"] * x["batch/rows"] for x in stats))


def settings(a: argparse.Namespace, layout: LayoutKind) -> StepSettings:
    return StepSettings(loss=LossConfig(loss_type="dapo"), temperature=1.0,
                        micro_batch_tokens=a.micro_batch_tokens, layout=layout)


def real_tokens(batch: Batch) -> int:
    return int(batch.seq_lens.sum())


def forwarded(batch: Batch, st: StepSettings) -> int:
    return sum(layout_cost(mb, st.layout) for mb in micro_batches(batch, st))


def attention_pairs(batch: Batch, st: StepSettings) -> int:
    """Query-key pairs SDPA scores per layer and head: rows x columns^2 of every
    micro-batch's layout (the padding, block-causal and tree masks are all dense)."""
    shapes = [make_layout(mb, st.layout, 0).input_ids.shape for mb in micro_batches(batch, st)]
    return sum(r * c * c for r, c in shapes)


Stats = dict[str, float]


def bench(a: argparse.Namespace, base: torch.nn.Module) -> dict[int, dict[str, Stats]]:
    """{threads: {arm: stats}}: median, min and max over the timed steps of the step's
    real tokens per wall second (``tps``, ``lo``, ``hi``) and per CPU second of this
    process (``tpc``)."""
    warm, timed = make_batches(a, 1, 1000)[0], make_batches(a, a.repeats, 0)
    models = {arm: copy.deepcopy(base) for arm in a.arms}
    opts = {arm: torch.optim.AdamW(m.parameters(), lr=1e-5) for arm, m in models.items()}
    wall = {(n, arm): list[float]() for n in a.threads for arm in a.arms}
    cpu = {(n, arm): list[float]() for n in a.threads for arm in a.arms}
    for n in a.threads:
        set_threads(n)
        for arm in a.arms:
            optimize(models[arm], opts[arm], warm, settings(a, arm))
    for i, batch in enumerate(timed):
        tokens = real_tokens(batch)
        for n in rotated(a.threads, i):
            set_threads(n)
            for arm in rotated(list(a.arms), i):
                t0, c0 = time.perf_counter(), time.process_time()
                optimize(models[arm], opts[arm], batch, settings(a, arm))
                wall[n, arm].append(tokens / (time.perf_counter() - t0))
                cpu[n, arm].append(tokens / (time.process_time() - c0))
    return {n: {arm: {"tps": statistics.median(wall[n, arm]), "lo": min(wall[n, arm]),
                      "hi": max(wall[n, arm]), "tpc": statistics.median(cpu[n, arm])}
                for arm in a.arms} for n in a.threads}


def rotated(xs: list[T], i: int) -> list[T]:
    k = i % len(xs)
    return xs[k:] + xs[:k]


def report(a: argparse.Namespace, st: dict[int, dict[str, Stats]]) -> None:
    timed = make_batches(a, a.repeats, 0)
    real = sum(real_tokens(b) for b in timed)
    fwd = {arm: sum(forwarded(b, settings(a, arm)) for b in timed) for arm in a.arms}
    attn = {arm: sum(attention_pairs(b, settings(a, arm)) for b in timed) for arm in a.arms}
    wrote = {arm: sum(written(b, settings(a, arm)) for b in timed) for arm in a.arms}
    shape = (f"turns {a.turns[0]}-{a.turns[1]} of {a.turn_tokens[0]}-{a.turn_tokens[1]} "
             f"tokens, observations {a.observation_tokens[0]}-{a.observation_tokens[1]}, "
             f"repeat {a.repeat}") if a.multi_turn else \
        f"completions {a.completion_tokens[0]}-{a.completion_tokens[1]} tokens"
    print(f"{a.repeats} timed steps of {a.groups} groups x {a.generations} "
          f"{'episodes' if a.multi_turn else 'samples'}; prompts {a.prompt_tokens[0]}-"
          f"{a.prompt_tokens[1]}, {shape}; micro_batch_tokens {a.micro_batch_tokens}; "
          f"real tokens {real}; tokens/s: median over steps [min-max]\n")
    print(f"{'arm':<8}{'forwarded':>11}{'fwd/real':>10}{'written':>9}{'attn_Mpairs':>13}"
          + "".join(f"{f'tok/s @{n} thread':>26}" for n in a.threads) + f"{'best':>6}")
    best: dict[str, float] = {}
    for arm in a.arms:
        n_best = max(a.threads, key=lambda n, arm=arm: st[n][arm]["tps"])
        best[arm] = st[n_best][arm]["tps"]
        cells = "".join(f"{st[n][arm]['tps']:>12.0f} [{st[n][arm]['lo']:.0f}-"
                        f"{st[n][arm]['hi']:.0f}]".rjust(26) for n in a.threads)
        print(f"{arm:<8}{fwd[arm]:>11}{fwd[arm] / real:>10.2f}{wrote[arm]:>9}"
              f"{attn[arm] / 1e6:>13.1f}"
              + cells + f"{f'{n_best}t':>6}")
    ratio = fwd["padded"] / real
    print(f"\npacking ratio (padded forwarded / real tokens) = {ratio:.2f}x")
    for arm in a.arms[1:]:
        gain = best[arm] / best["padded"]
        verdict = "meets" if gain >= TARGET * ratio else "below"
        print(f"{arm}/padded tokens/s = {gain:.2f}x (each at its best thread count); "
              f"gain / packing ratio = {gain / ratio:.2f} ({verdict} the {TARGET} target)")
    if len(a.threads) > 1:
        lo, hi = min(a.threads), max(a.threads)
        print(f"{hi} threads / {lo} thread tokens/s: " + ", ".join(
            f"{arm} {st[hi][arm]['tps'] / st[lo][arm]['tps']:.2f}x" for arm in a.arms))
    for n in a.threads:
        print(f"{n} thread(s): " + ", ".join(
            f"{arm}/padded {st[n][arm]['tps'] / st[n]['padded']['tps']:.2f}x" for arm in a.arms[1:])
            + "; per CPU-second of this process: " + ", ".join(
            f"{arm}/padded {st[n][arm]['tpc'] / st[n]['padded']['tpc']:.2f}x"
            for arm in a.arms[1:]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt-tokens", type=lambda s: tuple(map(int, s.split("-"))),
                   default=(32, 128), help="inclusive range, e.g. 32-128")
    p.add_argument("--completion-tokens", type=lambda s: tuple(map(int, s.split("-"))),
                   default=(16, 512), help="inclusive range, e.g. 16-512")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per arm and setting")
    p.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    p.add_argument("--micro-batch-tokens", type=int, default=0)
    p.add_argument("--arms", type=lambda s: s.split(","), default=list(ARMS),
                   help="layouts to time, padded first (the baseline of every ratio)")
    p.add_argument("--multi-turn", action="store_true",
                   help="episodes sharing conversation prefixes instead of single turns")
    p.add_argument("--turns", type=lambda s: tuple(map(int, s.split("-"))), default=(2, 5))
    p.add_argument("--turn-tokens", type=lambda s: tuple(map(int, s.split("-"))),
                   default=(8, 48))
    p.add_argument("--observation-tokens", type=lambda s: tuple(map(int, s.split("-"))),
                   default=(8, 24))
    p.add_argument("--repeat", type=float, default=0.5,
                   help="chance per turn that an episode takes an earlier episode's turn")
    p.add_argument("--quick", action="store_true", help="smoke test: 2 x 4 short samples")
    p.add_argument("--model", type=Path, default=None,
                   help="a model folder (e.g. SmolLM2-135M-Instruct) instead of the tiny model")
    a = p.parse_args(argv)
    if a.arms[0] != "padded" or not set(a.arms) <= set(ARMS):
        p.error(f"--arms: padded first, then any of {', '.join(ARMS[1:])}")
    if a.quick:
        a.groups, a.generations, a.repeats, a.threads = 2, 4, 1, [1]
        a.prompt_tokens, a.completion_tokens = (4, 8), (2, 32)
        a.turns, a.turn_tokens, a.observation_tokens = (1, 3), (2, 8), (2, 4)
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="sluice-bench-packing-") as d:
        model_dir = a.model or init_tiny_model(Path(d) / "tiny", seed=0,
                                               max_position_embeddings=2048)
        base, _ = load_model(model_dir)
    a.vocab_size = VOCAB_SIZE if a.model is None else base.config.vocab_size
    base.train()
    report(a, bench(a, base))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
