"""`sluice up` with ``environment.tools``: a tiny model that really calls a tool
(`tests.tool_model`: taught in seconds to call ``add``, then to answer the sum or the sum
plus one, half and half), every role a real process, an embedded Redis. Proves the whole
path: the generator's tool loop runs the calls inside rollouts (call, tool result, answer:
episodes longer than any single turn can be), the scorer scores the transcripts (the
reward pays for the right final answer, so groups' rewards vary), the trainer trains on
non-zero advantages, and the per-tool counters ride the generator's heartbeat into the
trainer's step rows (metrics.jsonl) and its /metrics. Waits for those conditions, then
ends the run as Ctrl-C does (the orderly end: summary and ledger audit)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis

from pipeline.bus.keys import Keys
from pipeline.model import load_tokenizer
from tests.helpers import ROOT, role_logs, scrape_metrics, up_args, wait_for
from tests.tool_model import PAIRS, TOOL, build_tool_model, episode_segments, write_prompts
from workers.environments.tools import load_tools

pytestmark = pytest.mark.e2e

CONFIG = """
[run]
seed = 0
max_time_s = 300          # a bound on a broken run only: the test ends it on a condition

[model]
init = ""

[task]
name = "jsonl"
path = "{prompts}"
heldout = 8

[environment]
tools = ["{tool}"]
tool_timeout_s = 5
max_turns = 3             # TRL's max_tool_calling_iterations = 2
max_episode_tokens = 96
step_timeout_s = 10

[generation]
num_generations = 4
max_new_tokens = 12       # per turn: the call is 8 tokens and its end (tests.tool_model)
temperature = 0.5         # the call all but certain (no failure); the answer stays 50/50
batch_groups = 2

[scoring]
rewards = [{{ fn = "examples.tools_fns:final_answer_reward", weight = 1.0 }}]

[trainer]
groups_per_step = 2
max_staleness = 1
lr = 1e-5                 # train, but leave the memorised call as it is
save_steps = 1000

[bus]
heartbeat_s = 0.5

[up]
scorers = 1
generators = 1
plot = false
"""


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tests.tool_model.build_tool_model`, once per session (seconds on a CPU)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return build_tool_model(tmp_path_factory.mktemp("tool_model") / "model")
    finally:
        torch.set_num_threads(threads)


def _rows(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def test_sluice_up_runs_the_models_tool_calls_and_reports_them(
        tool_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "tools.toml"
    config.write_text(CONFIG.format(prompts=write_prompts(tmp_path / "prompts.jsonl"),
                                    tool=TOOL))
    out = tmp_path / "run"
    args = up_args(config, out, tool_model, "tools", "trainer.max_steps=100000")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    up = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    client = None
    try:
        def called() -> list[dict[str, Any]] | None:
            """The rows once a step counted calls of `add` and one trained on a group
            whose rewards differ (non-zero advantages)."""
            assert up.poll() is None, f"sluice up exited {up.returncode}\n{role_logs(out)}"
            rows = _rows(out)
            hit = any(r.get("tools/add/calls", 0) > 0 for r in rows)
            return rows if hit and any(r["frac_reward_zero_std"] < 1 for r in rows) else None

        wait_for(called, 240, lambda: f"a step row with tools/add/calls > 0 and one with "
                 f"non-zero advantages\n{_rows(out)[-2:]}\n{role_logs(out)}", interval_s=0.5)

        def trainer_metrics() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
            """The trainer's /metrics once its tool counter has counted calls. The counter
            sums every step's ``tools/add/calls``: a step's own figure (its gauge) is a
            delta, 0 in most steps (between two heartbeats), so a scrape seldom sees it
            non-zero, and never when the scrapes keep step with the heartbeats."""
            nonlocal client
            if client is None:
                client = redis.Redis(unix_socket_path=str(out / "redis" / "redis.sock"))
            beats = client.hgetall(Keys("tools").heartbeats("trainer"))
            urls = [json.loads(v).get("metrics") for v in beats.values()]
            if not urls or not urls[0]:
                return None
            samples = scrape_metrics(urls[0])
            calls = sum(v for (name, labels), v in samples.items()
                        if name == "sluice_batch_tool_calls_total" and ("tool", "add") in labels)
            return samples if calls > 0 else None

        samples = wait_for(trainer_metrics, 120, "the trainer's /metrics counting calls of "
                           "add (sluice_batch_tool_calls_total)", interval_s=0.5)
        rows_then = _rows(out)
    finally:
        if client is not None:
            client.close()
        if up.poll() is None:
            up.send_signal(signal.SIGINT)  # Ctrl-C: the orderly end, then the summary
        try:
            output, _ = up.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            up.kill()
            output, _ = up.communicate()
    assert up.returncode == 130, f"{output[-3000:]}\n{role_logs(out)}"  # interrupted

    # the counters and the step figures in /metrics: the counter sums the rows' calls
    # (rows written by then: it may lag the newest row, never lead the rows after it)
    figures = {dict(labels)["metric"] for (name, labels) in samples
               if name == "sluice_batch_figure"}
    assert {"tools/add/calls", "tools/add/failures", "tools/failure_frequency"} <= figures
    counted = {(name, dict(labels)["tool"]): v for (name, labels), v in samples.items()
               if name.startswith("sluice_batch_tool_") and name.endswith("_total")}
    assert set(counted) == {("sluice_batch_tool_calls_total", "add"),
                            ("sluice_batch_tool_failures_total", "add")}, counted
    assert 0 < counted["sluice_batch_tool_calls_total", "add"] <= sum(
        r.get("tools/add/calls", 0) for r in _rows(out))
    assert counted["sluice_batch_tool_calls_total", "add"] >= sum(
        r.get("tools/add/calls", 0) for r in rows_then[:-1])
    rows = _rows(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] >= 2 and summary["steps"] == rows[-1]["step"], summary
    assert summary["conservation"]["balanced"], summary
    assert ": OK:" in output, output[-3000:]  # the ledger audit at the end

    calls = sum(r.get("tools/add/calls", 0) for r in rows)
    failures = sum(r.get("tools/add/failures", 0) for r in rows)
    assert calls > 0 and failures <= 0.05 * calls, (calls, failures)  # the model knows add
    assert all(r["tools/failure_frequency"] == pytest.approx(
        r.get("tools/add/failures", 0) / r["tools/add/calls"]) if r.get("tools/add/calls")
        else r["tools/failure_frequency"] == 0.0
        for r in rows if "tools/failure_frequency" in r), rows
    assert all(r["tools/call_frequency"] > 0 for r in rows
               if r.get("tools/add/calls", 0) > 0 and "tools/call_frequency" in r), rows
    lat = [r["tools/add/latency_s"] for r in rows if "tools/add/latency_s" in r]
    assert lat and all(0 < x < 5 for x in lat), lat
    # multi-turn: an episode of opening + call + tool result + answer is longer than any
    # one turn can be (opening + max_new_tokens), so these episodes went on past the call
    tok = load_tokenizer(tool_model)
    segs = episode_segments(tok, *PAIRS[0], [t.schema for t in load_tools([TOOL])])
    past_result = sum(len(s) for s, _ in segs[1:4]) + 1
    assert len(segs[1][0]) + 12 < past_result
    assert max(r["completions/max_length"] for r in rows) >= past_result, rows[-1]
    # the scorer paid 1 for the right final answer after the tool's result, 0 for the
    # sum plus one: a step whose groups' rewards differ has a mean strictly between
    rewards = [r["reward"] for r in rows]
    assert all(0 <= x <= 1 for x in rewards) and any(0 < x < 1 for x in rewards), rewards
