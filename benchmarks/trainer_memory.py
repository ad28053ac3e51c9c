"""Peak memory of one GRPO training step at a 152k vocabulary: full logits vs memory-lean.

    .venv/bin/python -m benchmarks.trainer_memory [--samples 16] [--prompt 64]
        [--completion 256] [--hidden 256] [--layers 2] [--vocab 151936] [--chunks 256]
        [--untied] [--threads 2] [--quick]

Model: a random-init 2-layer Qwen2 (``--hidden`` 256, 4 heads, 2 KV heads, MLP 4 x
hidden) with Qwen2.5's vocabulary (151,936 ids) and tied embeddings, as Qwen2.5-0.5B to
3B have (``--untied`` adds a separate LM head). Batch: ``--samples`` synthetic samples
(`benchmarks.synthetic`, groups of 4) of exactly ``--prompt`` + ``--completion`` tokens,
every completion token trained. float32, no autocast, no gradient checkpointing. Arms,
each one ``loss.backward()`` of the same batch (no optimizer step):

* ``before``: the trainer's old path, as ``compute_loss`` was before the lean logprobs:
  ``model(...).logits`` at every position ``[B, L, V]``, gathered to the completion
  positions ``[B, T, V]`` (`trainer.step.token_logps`), `grpo_loss`, and the entropy
  metric from those logits (`entropy_from_logits`);
* ``padded`` / ``packed``: `trainer.step.compute_loss` (the lean path,
  `trainer.logprobs`): hidden states of trained positions only, the LM head applied
  ``--chunks`` tokens at a time (``StepSettings.chunk_tokens``, default 256), each
  chunk recomputed in backward; entropy per chunk. More sizes (``--chunks 256,64,1024``)
  add padded rows at those sizes: how the lean peak splits into a part that grows with
  the chunk and a part that does not (the LM head's ``[V, H]`` weight-gradient
  temporaries, made per chunk and summed into the tied embedding's gradient).

How peak memory is measured: each arm runs in a fresh subprocess (no allocator state
shared between arms). It first takes a tiny step (2 samples of 8 tokens) of the same
arm, so libraries are initialised and parameter gradients exist (kept, zeroed in place);
then it reads its resident set (``/proc/self/statm``), runs the measured step and reads
``ru_maxrss`` (the kernel's high-water mark of the resident set). The peak is that
high-water mark minus the resident set before the step: what the step itself added at
its peak (activations, logits, temporaries, the autograd graph), excluding weights and
their gradients. torch's CPU
allocator does not cache, and glibc returns large blocks (mmap) on free, so this tracks
live tensors closely; it would under-count only if the step never exceeded the
process's earlier peak, which is checked (``note`` says so when it happens).

Prints a table (peak MB, step seconds and loss per arm: equal losses show the arms
compute the same thing), the sizes of the full ``[B, L, V]`` float32 logits, of one
``[chunk, V]`` chunk and of the LM head for scale, and the ratios before/after. Step
times are one step each, on a machine that may be shared: indicative only.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from benchmarks.synthetic import scored_groups
from pipeline.rl.logprobs import entropy_from_logits
from pipeline.rl.losses import LossConfig, grpo_loss
from pipeline.runtime import set_threads
from trainer.batch import Batch, build_batch
from trainer.packing import LayoutKind
from trainer.step import StepSettings, compute_loss, token_logps

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("before", "padded", "packed")
GROUP = 4  # samples per group
MB = 2**20


def make_model(a: argparse.Namespace) -> Qwen2ForCausalLM:
    heads = max(1, a.hidden // 64)
    cfg = Qwen2Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden,
                      num_hidden_layers=a.layers, num_attention_heads=heads,
                      num_key_value_heads=min(2, heads), max_position_embeddings=4096,
                      tie_word_embeddings=not a.untied, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    model.train()
    return model


def make_batch(a: argparse.Namespace, samples: int, prompt: int, completion: int) -> Batch:
    groups = scored_groups(max(1, samples // GROUP), min(GROUP, samples), vocab_size=a.vocab,
                           prompt_tokens=(prompt, prompt),
                           completion_tokens=(completion, completion), seed=1)
    return build_batch(groups, pad_id=0)


def settings(a: argparse.Namespace, layout: LayoutKind) -> StepSettings:
    return StepSettings(loss=LossConfig(loss_type="dapo"), temperature=1.0,
                        layout=layout, chunk_tokens=a.chunks[0])


def step_before(model: torch.nn.Module, batch: Batch, st: StepSettings) -> float:
    """The old ``compute_loss`` (full logits) and its backward."""
    logps, comp = token_logps(model, batch, st.temperature)
    loss, _ = grpo_loss(logps, None, batch.behaviour_logps, batch.advantages, batch.mask,
                        st.loss)
    with torch.no_grad():
        ent = entropy_from_logits(comp.detach() / st.temperature)
        float((ent * batch.mask).sum() / batch.mask.sum().clamp(min=1))
    loss.backward()
    return float(loss.detach())


def step_lean(model: torch.nn.Module, batch: Batch, st: StepSettings) -> float:
    loss, _ = compute_loss(model, batch, st)  # entropy on, as in a first pass
    loss.backward()
    return float(loss.detach())


def rss_bytes() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize()


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def run_arm(a: argparse.Namespace) -> dict[str, Any]:
    """In the child: warm-up step, then the measured step of arm ``a.arm``."""
    set_threads(a.threads)
    model = make_model(a)
    layout: LayoutKind = "padded" if a.arm == "before" else a.arm
    st = settings(a, layout)
    step = step_before if a.arm == "before" else step_lean
    step(model, make_batch(a, 2, 4, 4), st)  # grads allocated, libraries initialised
    model.zero_grad(set_to_none=False)
    batch = make_batch(a, a.samples, a.prompt, a.completion)
    gc.collect()
    before, high_before = rss_bytes(), max_rss_bytes()
    t0 = time.perf_counter()
    loss = step(model, batch, st)
    seconds = time.perf_counter() - t0
    high = max_rss_bytes()
    return {"arm": a.arm, "chunk": a.chunks[0], "peak_mb": (high - before) / MB,
            "step_s": seconds, "loss": loss, "rss_before_mb": before / MB,
            "note": "" if high > high_before else "step under the earlier peak: lower bound"}


def child_args(a: argparse.Namespace, arm: str, chunk: int) -> list[str]:
    out = [sys.executable, "-m", "benchmarks.trainer_memory", "--arm", arm,
           "--chunks", str(chunk)]
    for k in ("samples", "prompt", "completion", "hidden", "layers", "vocab", "threads"):
        out += [f"--{k}", str(getattr(a, k))]
    return out + (["--untied"] if a.untied else [])


def report(a: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> None:
    params = make_model(a).num_parameters()
    full = a.samples * (a.prompt + a.completion) * a.vocab * 4
    chunk = a.chunks[0] * a.vocab * 4
    tied = "untied" if a.untied else "tied"
    print(f"model: {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}, {tied} embeddings, "
          f"{params / 1e6:.1f}M params (float32); batch {a.samples} x ({a.prompt} prompt + "
          f"{a.completion} completion) tokens; {a.threads} torch threads")
    print(f"for scale: full logits [B, L, V] float32 = {full / MB:.0f} MB; one chunk "
          f"[{a.chunks[0]}, V] float32 = {chunk / MB:.0f} MB; LM head [V, H] float32 = "
          f"{a.vocab * a.hidden * 4 / MB:.0f} MB\n")
    print(f"{'arm':<12}{'chunk':>6}{'peak_MB':>10}{'step_s':>9}{'loss':>11}  note")
    for name, r in rows.items():
        chunk_s = "-" if r["arm"] == "before" else str(r["chunk"])
        print(f"{name:<12}{chunk_s:>6}{r['peak_mb']:>10.1f}{r['step_s']:>9.2f}"
              f"{r['loss']:>11.3g}  {r['note']}")
    print()
    b = rows["before"]
    for name, r in rows.items():
        if name == "before":
            continue
        ratio = b["peak_mb"] / r["peak_mb"] if r["peak_mb"] > 0 else math.inf
        print(f"before/{name} peak memory = {ratio:.2f}x, step time = "
              f"{b['step_s'] / r['step_s']:.2f}x")


def arms(a: argparse.Namespace) -> list[tuple[str, str, int]]:
    """(row name, arm, chunk): before, padded and packed at the first chunk size, then
    padded at each further ``--chunks`` size."""
    first, *more = a.chunks
    return ([("before", "before", first), ("padded", "padded", first),
             ("packed", "packed", first)] + [(f"padded@{c}", "padded", c) for c in more])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--completion", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=[256],
                   help="StepSettings.chunk_tokens; more sizes (256,64) add padded rows")
    p.add_argument("--untied", action="store_true", help="a separate LM head")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 4 x (8 + 24) tokens, hidden 64, vocab 32768")
    p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # the child's arm
    a = p.parse_args(argv)
    if a.quick:
        a.samples, a.prompt, a.completion, a.hidden, a.vocab = 4, 8, 24, 64, 32768
        a.chunks = [32]
    if a.arm:
        print(json.dumps(run_arm(a)))
        return 0
    rows: dict[str, dict[str, Any]] = {}
    for name, arm, chunk in arms(a):
        res = subprocess.run(child_args(a, arm, chunk), cwd=ROOT, capture_output=True,
                             text=True)
        if res.returncode != 0:
            print(res.stderr, file=sys.stderr)
            print(f"arm {name} failed (exit {res.returncode})", file=sys.stderr)
            return 1
        rows[name] = json.loads(res.stdout.strip().splitlines()[-1])
    report(a, rows)
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
