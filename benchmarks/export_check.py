"""A trained run's export, answered by plain transformers and a plain vLLM server, against
the run's own evaluation.

    .venv/bin/python benchmarks/export_check.py RUN_DIR [--version N] [--out DIR]

The weights are exported with the product's own command (``sluice export RUN_DIR --out
DIR/model [--version N]``, ``--merge-lora`` for a LoRA run: run.json says), then the
folder is loaded by code that knows nothing of sluice:
- transformers: ``AutoModelForCausalLM`` + ``AutoTokenizer`` from the folder, float32,
  greedy ``generate`` in left-padded batches (``generation.max_new_tokens``, the
  tokenizer's eos);
- vLLM: a server started on the folder (`sluice.vllm_launch`, float32, keyed with
  `run_key`) and asked over plain HTTP (``/v1/completions``, prompt token ids,
  temperature 0), stopped by PID at the end.
The held-out prompts and their scoring are the evaluator's: the run's pinned config
(run.json), ``task.heldout`` prompts of `task_from_config`, rendered by `render_prompt`,
scored by ``eval.rewards`` in a reward process (`workers.evaluator.reward_values`) and
summarised by `pipeline.evaluation.summarize_scores`. So pass@1 of either arm is the
figure the evaluator would write for that version, up to the engine's numerics; the
printed count of identical completions says how far the two engines agree.

Printed and saved to ``DIR/export_check.json``: pass@1 and each reward's mean per arm,
identical completions, and the run's own eval.jsonl row for the exported version (else
the newest evaluated version's, named as such). Single-turn runs only (an environment or
rollout hook makes episodes, not completions).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.config import Config
from pipeline.evaluation import summarize_scores
from pipeline.rundir import read_run
from pipeline.vllm_auth import auth_headers, run_key
from sluice.vllm_launch import LocalServer, ServerSpec
from workers.engines.base import Completion
from workers.episodes import Episode
from workers.evaluator import reward_values
from workers.reward_runner import RewardRunner
from workers.tasks.catalog import task_from_config
from workers.tasks.prompts import render_prompt
from workers.tasks.rewards import load_rewards

ROOT = Path(__file__).resolve().parents[1]
Answer = tuple[list[int], str]  # (completion token ids, "stop" | "length")
_EXPORTED = re.compile(r"^exported (?:v(\d+)|checkpoint \S+ \(version (\d+)\)), step \d+",
                       re.M)


def exported_version(summary: str) -> int:
    """The weight version `sluice export` says it wrote (its summary's first line)."""
    m = _EXPORTED.search(summary)
    if m is None:
        raise ValueError(f"no 'exported ...' line in sluice export's output:\n{summary}")
    return int(m.group(1) or m.group(2))


def greedy_answer(new_ids: list[int], eos_id: int) -> Answer:
    """A generated row as the engines report it: cut after the first eos (kept, "stop"),
    else every token ("length"). Padding after an eos (pad = eos here) is dropped."""
    if eos_id in new_ids:
        return new_ids[:new_ids.index(eos_id) + 1], "stop"
    return new_ids, "length"


def eval_row(rows: list[dict[str, Any]], version: int) -> tuple[dict[str, Any] | None, bool]:
    """The run's evaluation of ``version`` (True), else its newest evaluated version's
    (False); (None, False) when nothing was evaluated. A version evaluated twice (a
    restarted evaluator) counts by its last row."""
    same = [r for r in rows if r.get("version") == version]
    if same:
        return same[-1], True
    if not rows:
        return None, False
    return max(rows, key=lambda r: (r.get("version", -1), r.get("ts", 0.0))), False


def run_config(run_dir: Path) -> Config:
    """The run's pinned config (run.json); refuses multi-turn runs."""
    saved = read_run(run_dir)
    if saved is None:
        raise SystemExit(f"{run_dir} has no run.json: not a sluice run directory")
    cfg = Config.model_validate(saved["config"])
    if cfg.environment.enabled or cfg.generation.rollout:
        raise SystemExit("export_check compares single completions; this run's "
                         "environment / rollout hook makes episodes")
    return cfg


def export(run_dir: Path, cfg: Config, version: int | None, dest: Path) -> int:
    """``sluice export`` as a subprocess (replacing ``dest``); the version it wrote."""
    cmd = [str(Path(sys.executable).with_name("sluice")), "export", str(run_dir),
           "--out", str(dest), "--force"]
    cmd += ["--version", str(version)] if version is not None else []
    cmd += ["--merge-lora"] if cfg.model.lora is not None else []
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"sluice export failed ({done.returncode}):\n{done.stderr}")
    print("\n".join(x for x in done.stdout.splitlines() if not x.startswith("  ")))
    return exported_version(done.stdout)


@torch.no_grad()
def transformers_arm(model_dir: Path, ids: list[list[int]], max_new_tokens: int,
                     batch: int = 32) -> list[Answer]:
    """Greedy answers of plain transformers: float32, left-padded batches."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = int(tok.eos_token_id)
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    out: list[Answer] = []
    for i in range(0, len(ids), batch):
        enc = tok.pad({"input_ids": ids[i:i + batch]}, return_tensors="pt")
        gen = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=pad)
        width = enc["input_ids"].shape[1]
        out += [greedy_answer(row[width:].tolist(), eos) for row in gen]
    return out


def vllm_arm(model_dir: Path, ids: list[list[int]], cfg: Config, workdir: Path) -> list[Answer]:
    """Greedy answers of a plain vLLM server on ``model_dir`` (one batched request)."""
    v = cfg.generation.vllm
    key = run_key(workdir / "auth")
    spec = ServerSpec(python=str(ROOT / v.python), model=str(model_dir), dtype="float32",
                      max_model_len=v.max_model_len,
                      kv_cache_memory_bytes=v.kv_cache_memory_bytes, api_key=key)
    server = LocalServer(spec, workdir)
    try:
        server.start().wait_ready(max(v.start_timeout_s, 900.0))
        body = {"model": str(model_dir), "prompt": ids, "max_tokens":
                cfg.generation.max_new_tokens, "temperature": 0.0, "return_token_ids": True}
        req = urllib.request.Request(
            server.url + "/v1/completions", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **auth_headers(key)})
        with urllib.request.urlopen(req, timeout=3600) as res:
            choices = sorted(json.load(res)["choices"], key=lambda c: c["index"])
    finally:
        server.stop()
    return [([int(t) for t in c["token_ids"]],
             "stop" if c["finish_reason"] == "stop" else "length") for c in choices]


async def score(cfg: Config, tok: Any, prompts: list[dict[str, Any]],
                arms: dict[str, list[Answer]]) -> dict[str, dict[str, float]]:
    """Each arm's eval row, scored as the evaluator scores greedy completions."""
    rewards = load_rewards(cfg, "eval.rewards")
    runner = RewardRunner(rewards, cfg.scoring.reward_timeout_s)
    out = {}
    try:
        for name, answers in arms.items():
            eps: list[Episode | None] = [Episode.of(Completion(
                np.asarray(a, dtype=np.int32), np.zeros(len(a), np.float32),
                np.zeros(len(a), np.int32), reason)) for a, reason in answers]
            values = await reward_values(runner, tok, prompts, eps)
            out[name] = summarize_scores([r.name for r in rewards],
                                         [r.weight for r in rewards], values,
                                         cfg.eval.pass_threshold)
    finally:
        await runner.close()
    return out


def figures(row: dict[str, Any]) -> str:
    keys = ["pass@1", "reward", *sorted(k for k in row if k.startswith("rewards/"))]
    return "  ".join(f"{k} {row[k]:.4f}" for k in keys if k in row)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--version", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None,
                    help="default: runs/export_check/<run dir name>")
    args = ap.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    run_dir = args.run_dir.resolve()
    out = (args.out or ROOT / "runs" / "export_check" / run_dir.name).resolve()
    cfg = run_config(run_dir)
    model_dir = out / "model"
    version = export(run_dir, cfg, args.version, model_dir)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = task_from_config(cfg, tok).heldout(cfg.task.heldout)
    ids = [render_prompt(tok, p["text"], cfg.task.system_prompt) for p in prompts]
    arms = {"transformers": transformers_arm(model_dir, ids, cfg.generation.max_new_tokens),
            "vllm": vllm_arm(model_dir, ids, cfg, out / "vllm")}
    rows = asyncio.run(score(cfg, tok, prompts, arms))
    same = sum(a[0] == b[0] for a, b in zip(arms["transformers"], arms["vllm"], strict=True))
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()
             if x.strip()] if (run_dir / "eval.jsonl").is_file() else []
    own, exact = eval_row(evals, version)

    print(f"export v{version} of {run_dir.name}: {len(prompts)} held-out prompts, greedy, "
          f"max_new_tokens {cfg.generation.max_new_tokens}, pass at total reward >= "
          f"{cfg.eval.pass_threshold:g}")
    for name, row in rows.items():
        print(f"  {name:>12}: {figures(row)}")
    print(f"  identical completions: {same}/{len(prompts)}")
    if own is None:
        print("  the run evaluated no version (no eval.jsonl rows)")
    else:
        what = "this version" if exact else \
            f"v{own['version']}, the newest evaluated (v{version} was not evaluated)"
        print(f"  run's evaluator, {what}: {figures(own)}")
    result = {"run_dir": str(run_dir), "version": version, "n": len(prompts),
              "arms": rows, "identical": same,
              "run_eval": {"row": own, "same_version": exact},
              "completions": {k: [tok.decode(a, skip_special_tokens=True) for a, _ in v]
                              for k, v in arms.items()}}
    (out / "export_check.json").write_text(json.dumps(result, indent=2))
    print(f"saved {out / 'export_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
