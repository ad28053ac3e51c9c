"""Where `sluice up` runs its vLLM servers and in which order they start.

The GPU assignment (`sluice.vllm_placement.plan_servers`) is a pure function, checked
here for every rule it keeps: with ``weight_transfer = "nccl"`` the trainer's GPUs and the
servers' GPUs are disjoint (NCCL refuses two ranks of one group on one GPU), a machine
that cannot give them that is refused before any process starts, a parent's
``CUDA_VISIBLE_DEVICES`` is indexed (never overwritten by a bare index), and servers
sharing a GPU start one after another and split ``gpu_memory_utilization``. The launcher
(`sluice.vllm_launch.launch`) is run against fake servers (real processes on
127.0.0.1 that only answer ``/health``), so the start order is observed, not assumed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pipeline.config import Config, ConfigError, load_config
from sluice import vllm_placement
from sluice.vllm_launch import ServerError, ServerSpec, launch
from sluice.vllm_placement import (
    Placement,
    plan_servers,
    trainer_gpu_indices,
    visible_devices,
    vllm_specs,
)


def _plan(generators: int, evals: int, visible: list[str], trainer: list[int], *,
          nccl: bool, util: float = 0.9) -> list[Placement]:
    return plan_servers(generators, evals, visible, trainer, nccl=nccl,
                        memory_utilization=util)


# ---------------------------------------------------------------- the machine's GPUs


def test_visible_devices_index_the_parents_list() -> None:
    assert visible_devices(None, 2) == ["0", "1"]
    assert visible_devices("4,5,6", 3) == ["4", "5", "6"]  # a Slurm/Kubernetes allocation
    assert visible_devices(" GPU-aa , GPU-bb", 2) == ["GPU-aa", "GPU-bb"]  # UUIDs pass through
    assert visible_devices("3,1,9", 2) == ["3", "1"]  # CUDA stops at an entry it cannot use
    assert visible_devices("", 0) == [] and visible_devices(None, 0) == []


def test_trainer_gpu_indices_follow_trainer_device_and_ranks() -> None:
    assert trainer_gpu_indices("auto", 1, 2) == [0]
    assert trainer_gpu_indices("cuda", 2, 4) == [0, 1]  # torchrun: cuda:LOCAL_RANK
    assert trainer_gpu_indices("cuda:1", 1, 2) == [1]
    assert trainer_gpu_indices("cpu", 1, 2) == []
    assert trainer_gpu_indices("auto", 1, 0) == []  # no GPU: auto is the CPU


# ---------------------------------------------------------------- nccl: disjoint GPUs


def test_nccl_keeps_the_trainer_and_the_servers_on_disjoint_gpus() -> None:
    plan = _plan(2, 0, ["0", "1", "2"], [0], nccl=True)
    assert [p.device for p in plan] == ["1", "2"]
    assert [p.after for p in plan] == [None, None]  # own GPUs: they load in parallel
    assert [p.memory_utilization for p in plan] == [0.9, 0.9]
    # two trainer ranks take GPUs 0 and 1
    assert [p.device for p in _plan(1, 0, ["0", "1", "2"], [0, 1], nccl=True)] == ["2"]


def test_nccl_assignment_indexes_the_parents_visible_devices() -> None:
    plan = _plan(1, 0, ["4", "5"], [0], nccl=True)  # the trainer is on "4" (its cuda:0)
    assert [p.device for p in plan] == ["5"]


def test_nccl_eval_server_shares_a_server_gpu_never_the_trainers() -> None:
    plan = _plan(1, 1, ["0", "1"], [0], nccl=True, util=0.8)
    assert [p.device for p in plan] == ["1", "1"]
    assert [p.after for p in plan] == [None, 0]  # the evaluator's waits for the generators'
    assert [p.memory_utilization for p in plan] == pytest.approx([0.4, 0.4])
    # a free GPU left: the evaluator's server takes it
    assert [p.device for p in _plan(1, 1, ["0", "1", "2"], [0], nccl=True)] == ["1", "2"]


@pytest.mark.parametrize(("generators", "visible", "trainer"), [
    (1, ["0"], [0]),  # one GPU: the trainer and the server would share it
    (2, ["0", "1"], [0]),  # two generator servers in one group on one GPU
    (1, ["0", "1"], [0, 1]),  # every GPU taken by a trainer rank
])
def test_nccl_without_enough_gpus_is_refused_naming_the_keys(
        generators: int, visible: list[str], trainer: list[int]) -> None:
    with pytest.raises(ConfigError) as e:
        _plan(generators, 0, visible, trainer, nccl=True)
    msg = str(e.value)
    for key in ("generation.vllm.weight_transfer", "generation.vllm.launch",
                "up.trainer_ranks", "trainer.device"):
        assert key in msg, key
    assert f"{len(visible)} GPU" in msg


def test_nccl_on_a_cpu_machine_or_a_cpu_trainer_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"generation\.vllm\.weight_transfer.*no CUDA GPU"):
        _plan(1, 0, [], [], nccl=True)
    with pytest.raises(ConfigError, match=r"trainer\.device"):
        _plan(1, 0, ["0", "1"], [], nccl=True)


# ---------------------------------------------------------------- file: shared GPUs


def test_file_servers_go_round_robin_over_gpus_the_trainer_leaves_free() -> None:
    # Was ["0", "1", "0"]: server 0 shared the trainer's GPU 0 while GPU 2 idled. Servers
    # now take the GPUs the trainer does not use first, and share among those.
    plan = _plan(3, 0, ["0", "1", "2"], [0], nccl=False)
    assert [p.device for p in plan] == ["1", "2", "1"]
    assert [p.after for p in plan] == [None, None, 0]
    assert [p.memory_utilization for p in plan] == pytest.approx([0.45, 0.9, 0.45])
    plan = _plan(3, 0, ["0", "1"], [0], nccl=False)  # one free GPU: all three on it
    assert [p.device for p in plan] == ["1", "1", "1"]
    assert [p.after for p in plan] == [None, 0, 1]
    assert sum(p.memory_utilization for p in plan) == pytest.approx(0.9)
    # a CPU trainer uses no GPU: every GPU is free
    assert [p.device for p in _plan(2, 0, ["0", "1"], [], nccl=False)] == ["0", "1"]


def test_servers_sharing_the_trainers_gpu_leave_it_the_trainers_share() -> None:
    """Only when no GPU is free of the trainer; the servers there split the budget less
    ``trainer_gpu_fraction`` (0.5 by default), so the trainer is not starved."""
    plan = _plan(2, 1, ["7"], [0], nccl=False, util=0.9)
    assert [p.device for p in plan] == ["7", "7", "7"]
    assert [p.after for p in plan] == [None, 0, 1]  # a chain: one profiles memory at a time
    assert sum(p.memory_utilization for p in plan) == pytest.approx(0.9 - 0.5)
    plan = plan_servers(1, 0, ["0"], [0], nccl=False, memory_utilization=0.9,
                        trainer_fraction=0.3)
    assert [p.memory_utilization for p in plan] == pytest.approx([0.6])
    with pytest.raises(ConfigError, match=r"generation\.vllm\.gpu_memory_utilization.*"
                                          r"generation\.vllm\.trainer_gpu_fraction"):
        _plan(1, 0, ["0"], [0], nccl=False, util=0.5)


def test_a_gpu_server_never_falls_back_to_the_cpus_64_mib_kv_cache() -> None:
    """``gpu_memory_utilization`` 0 meant ``--kv-cache-memory-bytes`` 64 MiB on a GPU too,
    which a 7B server refuses for a long max_model_len; on a GPU 0 is now vLLM's 0.9 (less
    the trainer's share where it shares the GPU), on the CPU it stays the byte count."""
    plan = _plan(2, 0, ["0", "1"], [0], nccl=False, util=0.0)
    assert [(p.device, p.memory_utilization) for p in plan] == [("1", 0.45), ("1", 0.45)]
    assert [p.memory_utilization for p in _plan(1, 0, ["0"], [0], nccl=False, util=0.0)] \
        == pytest.approx([0.4])
    assert _plan(1, 0, [], [], nccl=False, util=0.0) == [Placement(None, None, 0.0)]
    cmd = ServerSpec(python="py", model="m", cpu_core=None, cuda_device="1",
                     gpu_memory_utilization=plan[0].memory_utilization).command(1)
    assert "--kv-cache-memory-bytes" not in cmd
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.45"


def test_cpu_machine_servers_start_at_once_without_a_gpu() -> None:
    plan = _plan(2, 1, [], [], nccl=False, util=0.0)
    assert plan == [Placement(None, None, 0.0)] * 3


# ---------------------------------------------------------------- the command line


def test_enforce_eager_only_on_the_cpu() -> None:
    cpu = ServerSpec(python="py", model="m")
    gpu = ServerSpec(python="py", model="m", cpu_core=None, cuda_device="GPU-ab",
                     gpu_memory_utilization=0.45)
    assert "--enforce-eager" in cpu.command(8000)
    cmd = gpu.command(8000)
    assert "--enforce-eager" not in cmd  # CUDA graphs and torch.compile stay on
    # the CPU's step token budget is large enough that a prompt is rarely split over
    # steps (seeded requests would fail), and at least max_model_len; a GPU keeps vLLM's
    short = cpu.command(1)
    long = ServerSpec(python="py", model="m", max_model_len=16384).command(1)
    assert short[short.index("--max-num-batched-tokens") + 1] == "8192"
    assert long[long.index("--max-num-batched-tokens") + 1] == "16384"
    assert "--max-num-batched-tokens" not in cmd
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.45"
    assert gpu.env(Path("/tmp"))["CUDA_VISIBLE_DEVICES"] == "GPU-ab"
    # a CPU server keeps whatever the parent has
    assert cpu.env(Path("/tmp")).get("CUDA_VISIBLE_DEVICES") == os.environ.get(
        "CUDA_VISIBLE_DEVICES")


def _cfg(tmp_path: Path, *sets: str) -> Config:
    return load_config(None, ['generation.engine="vllm"', f"run.output_dir={tmp_path}",
                              *sets])


def _fake_machine(monkeypatch: pytest.MonkeyPatch, gpus: list[str]) -> None:
    import pipeline.hub

    monkeypatch.setattr(vllm_placement, "machine_gpus", lambda: list(gpus))
    monkeypatch.setattr(pipeline.hub, "resolve_model",
                        lambda path, revision: SimpleNamespace(local_dir="/models/m"))


def test_vllm_specs_follow_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_machine(monkeypatch, ["4", "5"])
    specs = vllm_specs(_cfg(tmp_path, "generation.vllm.launch=2",
                            "generation.vllm.gpu_memory_utilization=0.8"))
    # + the evaluator's own; all on "5": "4" is the trainer's (cuda:0), left to it
    assert [s.cuda_device for s in specs] == ["5", "5", "5"]
    assert [s.start_after for s in specs] == [None, 0, 1]
    assert [s.gpu_memory_utilization for s in specs] == pytest.approx([0.8 / 3] * 3)
    assert all(s.cpu_core is None and "--enforce-eager" not in s.command(1) for s in specs)
    specs = vllm_specs(_cfg(tmp_path, "generation.vllm.launch=1",
                            'generation.vllm.weight_transfer="nccl"'))
    assert [s.cuda_device for s in specs] == ["5", "5"] and specs[1].start_after == 0
    # only the generators' server joins the trainer's group
    assert ["--weight-transfer-config" in s.extra_args for s in specs] == [True, False]


def test_several_front_ends_go_through_vllms_serve_entry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The api_server module runs one front end whatever --api-server-count says; only
    `vllm serve` starts several, through `workers.engines.vllm_serve` (the CPU wheel's
    own CLI cannot start), which the server finds on its PYTHONPATH."""
    _fake_machine(monkeypatch, ["0", "1"])
    one = vllm_specs(_cfg(tmp_path, "generation.vllm.launch=1"))[0].command(1)
    assert one[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert "--api-server-count" not in one
    specs = vllm_specs(_cfg(tmp_path, "generation.vllm.launch=1",
                            "generation.vllm.api_server_count=8",
                            "generation.num_sampler_logprobs=8"))
    for cmd in (s.command(1) for s in specs):  # the evaluator's server too
        assert cmd[1:3] == ["-m", "workers.engines.vllm_serve"]
        assert cmd[cmd.index("--api-server-count") + 1] == "8"
        assert cmd[cmd.index("--model") + 1] == "/models/m"
    root = str(Path(__file__).resolve().parents[2])
    assert specs[0].own_env("/c")["PYTHONPATH"].split(os.pathsep)[0] == root


def test_up_refuses_nccl_on_one_gpu_before_any_process_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from sluice import up

    _fake_machine(monkeypatch, ["0"])
    started: list[str] = []

    class NoRedis:
        def __init__(self, *a: Any) -> None:
            started.append("redis")

        def start(self) -> Any:
            raise AssertionError("Redis started before the GPU plan was checked")

    monkeypatch.setattr(up, "EmbeddedRedis", NoRedis)
    monkeypatch.setattr(up, "launch", lambda *a, **k: started.append("vllm"))
    cfg = _cfg(tmp_path, "generation.vllm.launch=1", 'generation.vllm.weight_transfer="nccl"')
    assert up.run_up(cfg, "run.toml", []) == 2
    assert started == []
    err = capsys.readouterr().err
    assert "generation.vllm.weight_transfer" in err and "trainer.device" in err


# ---------------------------------------------------------------- the launcher

FAKE_SERVER = """
import argparse, http.server, json, os, time
p = argparse.ArgumentParser()
p.add_argument("--port", type=int)
args, _ = p.parse_known_args()

def note(ev):
    with open("events.jsonl", "a") as f:
        f.write(json.dumps({"port": args.port, "ev": ev, "t": time.time(),
                            "dev": os.environ.get("CUDA_VISIBLE_DEVICES")}) + "\\n")

note("start")
if os.environ.get("FAKE_EXIT_DEV") == os.environ.get("CUDA_VISIBLE_DEVICES"):
    raise SystemExit(3)
time.sleep(float(os.environ["FAKE_LOAD_S"]))

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *a):
        pass

srv = http.server.HTTPServer(("127.0.0.1", args.port), H)
note("ready")
srv.serve_forever()
"""


def _fake_vllm(workdir: Path) -> None:
    """``python -m vllm.entrypoints.openai.api_server`` resolves in the server's working
    directory first: a stand-in that loads for FAKE_LOAD_S, then answers /health."""
    pkg = workdir / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (workdir / "vllm", workdir / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(FAKE_SERVER)


def _events(workdir: Path) -> dict[tuple[int, str], float]:
    rows = [json.loads(x) for x in (workdir / "events.jsonl").read_text().splitlines()]
    return {(r["port"], r["ev"]): r["t"] for r in rows}


def _specs(*placements: tuple[str, int | None]) -> list[ServerSpec]:
    return [ServerSpec(python=sys.executable, model="m", cpu_core=None, cuda_device=dev,
                       start_after=after) for dev, after in placements]


def test_launch_starts_servers_sharing_a_gpu_in_turn_and_others_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_LOAD_S", "1.0")
    _fake_vllm(tmp_path)
    t0 = time.time()
    servers = launch(_specs(("0", None), ("1", None), ("0", 0)), tmp_path, timeout_s=30)
    try:
        ev = _events(tmp_path)
        a, b, c = (s.port for s in servers)
        assert ev[(c, "start")] >= ev[(a, "ready")]  # waited for the one on its GPU
        assert ev[(b, "start")] < ev[(a, "ready")]  # another GPU: loaded in parallel
        assert time.time() - t0 < 20
    finally:
        for s in servers:
            s.stop(grace_s=5)


def test_launch_failure_stops_the_chain_before_the_next_server_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_LOAD_S", "0.2")
    monkeypatch.setenv("FAKE_EXIT_DEV", "0")
    _fake_vllm(tmp_path)
    with pytest.raises(ServerError, match="exited with 3"):
        launch(_specs(("0", None), ("0", 0)), tmp_path, timeout_s=30)
    starts = [k for k in _events(tmp_path) if k[1] == "start"]
    assert len(starts) == 1  # the second never started
