"""`sluice up` with the vllm engine: it launches a real vLLM server for the generator and
one for the evaluator, learns `copy` with score centering on the server's top logprobs,
and stops both servers on exit."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tests.helpers import ROOT, run_up, up_args
from tests.vllm.conftest import vllm_python

pytestmark = pytest.mark.e2e


def test_sluice_up_with_vllm_learns_copy_and_stops_its_server(tmp_path: Path) -> None:
    py = vllm_python()
    if py is None:
        pytest.skip("no vLLM server environment: run `bash deploy/setup.sh --vllm`")
    out = tmp_path / "run"
    # learning, as in tests/e2e/test_up.py's reverse-task test: the run stops itself once
    # the held-out greedy reward is twice the initial weights' (0.020 -> 0.04). It waits
    # for that condition, not for a step count: a fixed 40 steps once ended at 0.025
    # after passing 0.08 at versions 15 and 28 (this tiny model's held-out reward swings).
    args = up_args(ROOT / "examples" / "copy_vllm.toml", out, tmp_path / "model", "e2e-vllm",
                   "trainer.save_steps=20", "run.max_time_s=500",
                   f"generation.vllm.python={py}", "trainer.max_steps=1000",
                   "up.stop_at=reward>=0.04", "up.plot=false",
                   # score centering on (its default once the sampler reports top-k)
                   "generation.num_sampler_logprobs=4")
    _, summary = run_up(args, out, tmp_path, 600)
    c = summary["conservation"]
    assert c["balanced"] and summary["reason"] == "stop_at reward>=0.04 reached", summary
    assert c["by_reason"].get("dead", 0) == 0
    assert summary["eval_reward_before"] < 0.03, summary  # so 0.04 is at least a doubling
    assert summary["value_at_target"] >= 0.04, summary
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == summary["steps"] > 0
    assert max(m["staleness_max"] for m in metrics) <= 1
    # every trained token carried the server's top 4 and was centred (a step whose groups
    # all had zero advantage forwards nothing and reports no sampling/*)
    centred = [m for m in metrics if "sampling/centered_frac" in m]
    assert len(centred) >= len(metrics) // 2, len(centred)
    assert all(m["sampling/centered_frac"] > 0.999 for m in centred)
    assert all(0 < m["sampling/sampler_mass"] <= 1.0001 for m in centred)
    # TRL's rollout/* series, from the generator's heartbeats (pipeline.rollout_meter)
    rolled = [m for m in metrics if "rollout/concurrency_cap" in m]
    assert len(rolled) >= len(metrics) // 2, len(rolled)
    assert all(m["rollout/concurrency_cap"] >= 1 and m["rollout/concurrency"] >= 0
               for m in rolled)
    assert max(m.get("rollout/generated_tok_s", 0.0) for m in metrics) > 0
    gen_log = (out / "logs" / "generator-0.log").read_text()
    assert "engine vllm" in gen_log
    # the evaluator decoded on a vLLM server of its own, which sluice up launched too
    eval_log = (out / "logs" / "evaluator.log").read_text()
    assert "evaluator on engine vllm" in eval_log, eval_log[-2000:]
    # both servers sluice up launched are gone: their ports no longer answer
    server_logs = list((out / "vllm").glob("vllm-*.log"))
    assert len(server_logs) == 2, server_logs
    for log in server_logs:
        port = int(log.stem.split("-")[1])
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
