"""The Slurm script as rendered, for what a real multi-node cluster would break on and the
two-node test cluster cannot show (it has no GPUs): steps that hold GPUs never share them,
every node asks for the memory and CPUs of what runs on it, a layout that would leave GPUs
idle is refused, and the job's stop, requeue and logs are wired. Seconds, no Slurm; the
live runs are in tests/deploy/test_slurm.py."""

from __future__ import annotations

import re
import stat
import subprocess
from pathlib import Path

import pytest

from pipeline.config import ConfigError
from sluice.deploy.certs import make_certs
from sluice.deploy.plan import MEMORY_DEFAULT_GIB, mem_mib
from tests.deploy.rendered import fresh_credentials, render_into


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return fresh_credentials(tmp_path_factory.mktemp("acl"))


@pytest.fixture(autouse=True)
def _no_env_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLUICE_REDIS_CREDENTIALS_FILE", raising=False)


def _script(tmp_path: Path, creds: dict[str, Path], example: str, *sets: str) -> str:
    out = render_into(tmp_path / "out", "slurm", creds, example, *sets)
    return (out / "sluice.sbatch").read_text()


def _steps(script: str) -> list[str]:
    """Each launched step as one line: ``step GROUP NODE NAME ROLE OPTS -- COMMAND``."""
    return [line for line in script.replace("\\\n  ", " ").splitlines()
            if line.startswith("step ")]


def _sbatch(script: str) -> list[list[str]]:
    """The ``#SBATCH`` options of each het component (the job-wide ones in the first)."""
    comps: list[list[str]] = [[]]
    for line in script.splitlines():
        if line == "#SBATCH hetjob":
            comps.append([])
        elif line.startswith("#SBATCH "):
            comps[-1] += line.split()[1:]
    return comps


GPU_PLAN = ("gsm8k", "up.generators=2", "generation.vllm.launch=4")
"""Two generators with two vLLM servers each on one node, the trainer and the evaluator's
server on the other: seven GPU steps, four of them on one node."""


def test_steps_holding_gpus_never_overlap_and_sum_to_their_nodes_gpus(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """``--overlap`` shares GRES: two steps on one node given a GPU each could land on the
    same device. A GPU step asks for its own (``--exact --gpus``), and the GPUs of a
    node's steps add up to what its component asks for."""
    script = _script(tmp_path, creds, *GPU_PLAN)
    launcher = re.search(r"exec srun [^\n]*\n[^\n]*", script)[0]  # type: ignore[index]
    assert "--overlap" not in launcher, launcher  # step() adds nothing: each step says
    per_node: dict[tuple[str, str], int] = {}
    gpu_steps = 0
    for line in _steps(script):
        opts = line.split(" -- ")[0]
        gpus = re.search(r"--gpus=(\d+)", opts)
        if gpus:
            gpu_steps += 1
            assert "--overlap" not in opts and "--exact" in opts, line
            assert re.search(r"--mem=\d+", opts), line  # else it takes the node's memory
            key = (line.split()[1], line.split()[2])
            per_node[key] = per_node.get(key, 0) + int(gpus[1])
        else:
            assert "--overlap" in opts, line
    assert gpu_steps == 6, _steps(script)  # 4 generator servers, the evaluator's, trainer
    comps = _sbatch(script)
    want = {"0": "--gpus-per-node=2", "1": "--gpus-per-node=4"}  # trainer + eval server
    for (group, _node), n in per_node.items():
        assert f"--gpus-per-node={n}" in comps[int(group)] and want[group] in comps[int(group)]


def test_a_layout_that_would_leave_gpus_idle_is_refused_naming_the_key(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """Slurm asks every node of a component for the same GPUs: the evaluator's server on
    one of two generator nodes used to be asked for on both."""
    with pytest.raises(ConfigError, match=r"deploy\.evaluator_with: .*\[3, 2\] GPUs"):
        _script(tmp_path, creds, "gsm8k", "up.generators=2", "generation.vllm.launch=4",
                "deploy.generator_nodes=2", "deploy.evaluator_with=generators")
    script = _script(tmp_path / "ok", creds, "gsm8k", "up.generators=2",
                     "generation.vllm.launch=4", "deploy.generator_nodes=2")
    assert "--gpus-per-node=2" in _sbatch(script)[1]


def test_every_node_asks_for_the_memory_of_what_runs_on_it(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """Memory keys left at 0 take the container targets' defaults, so ``--mem`` is always
    asked for (a site's default per CPU is far too little for a trainer and vLLM), and a
    vLLM server gets the CPUs its processes keep busy, not 1 (a hard cgroup limit)."""
    script = _script(tmp_path, creds, "gsm8k")
    d = MEMORY_DEFAULT_GIB
    trainer_node = d["trainer"] + d["redis"] + 4 * d["role"] + d["role"] + d["vllm"]
    generator_node = d["role"] + d["vllm"]
    comps = _sbatch(script)
    assert f"--mem={mem_mib(trainer_node)}" in comps[0], comps
    assert f"--mem={mem_mib(generator_node)}" in comps[1], comps
    servers = [s for s in _steps(script) if " vllm-" in s]
    assert servers and all("--cpus-per-task=2" in s for s in servers), servers
    set_mem = _script(tmp_path / "set", creds, "copy", "deploy.trainer_memory_gib=1",
                      "deploy.role_memory_gib=0.5", "deploy.redis_memory_gib=0.25")
    assert "--mem=2816" in _sbatch(set_mem)[0]  # 1 + 0.25 + 2 scorers, the evaluator


def test_the_job_stops_in_order_requeues_and_keeps_every_attempts_logs(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """Preemption and time limits: the job may be requeued, its script hears SIGTERM
    ``trainer_grace_s + grace_s`` before the limit and traps it, and every log (the job's
    and each step's) is appended to, so a second attempt keeps the first's."""
    script = _script(tmp_path, creds, "copy", "deploy.trainer_grace_s=300",
                     "deploy.time_limit_min=120")
    first = _sbatch(script)[0]
    assert {"--requeue", "--open-mode=append", "--signal=B:TERM@360",
            "--exclusive"} <= set(first), first
    assert "trap on_term TERM" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    launcher = re.search(r"exec srun [^\n]*\n[^\n]*", script)[0]  # type: ignore[index]
    assert "--open-mode=append" in launcher
    # the steps are told through Slurm (srun answers its own SIGTERM by killing its step
    # at once: no checkpoint), and Redis, not a step, is stopped after the trainer exits
    assert 'stop_steps() { scancel --signal=TERM "$SLURM_JOB_ID"' in script
    assert not re.search(r'kill -TERM "\$(p|TRAINER_PID)"', script), script
    redis = next(ln for ln in script.splitlines() if "redis-server" in ln)
    assert redis.startswith("redis-server ") and "srun" not in redis
    assert script.index('wait_for "$TRAINER_PID"') < script.index('kill -TERM "$REDIS_PID"')
    off = _sbatch(_script(tmp_path / "off", creds, "copy", "deploy.requeue=false",
                          "deploy.exclusive=false"))[0]
    assert "--requeue" not in off and "--exclusive" not in off


def test_redis_binds_what_the_other_nodes_resolve_the_head_to(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """``redis-server --bind NAME`` on the head node resolves the name there, and Debian
    maps a host's own name to 127.0.1.1: the generators would be refused. The address is
    asked of a generator node, and a loopback answer stops the job with a message."""
    script = _script(tmp_path, creds, "copy")
    assert re.search(r'HEAD_ADDR=\$\(srun --het-group=1 [^\n]*getent ahostsv4 "\$HEAD_HOST"',
                     script)
    assert '--bind "${BIND[@]}"' in script and "127.*) fail" in script
    assert 'REDIS_URL="redis://$HEAD_HOST:$REDIS_PORT/0"' in script
    assert "--bind \"$HEAD_ADDR\"" not in script


def test_vllm_servers_run_the_python_given_at_submit_time(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    """A vLLM server runs ``$SLUICE_VLLM_PYTHON``, else the ``.venv-vllm`` beside
    ``$SLUICE_VENV`` (where deploy/setup.sh puts it), else a python the config names."""
    script = _script(tmp_path, creds, *GPU_PLAN)
    assert 'VLLM_PY=${SLUICE_VLLM_PYTHON:-$(dirname "$SLUICE_VENV")/.venv-vllm/bin/python}' \
        in script
    own = _script(tmp_path / "own", creds, *GPU_PLAN,
                  "generation.vllm.python=/opt/vllm env/bin/python")
    assert "VLLM_PY=${SLUICE_VLLM_PYTHON:-'/opt/vllm env/bin/python'}" in own
    servers = [s for s in _steps(script) if " vllm-" in s]
    assert servers and all(re.search(r' -- +env .* "\$VLLM_PY" -m ', s) for s in servers)


def test_bundled_tls_serves_only_tls_checks_the_name_and_ships_the_files(
        tmp_path: Path, creds: dict[str, Path]) -> None:
    certs = tmp_path / "certs"
    make_certs(certs, ["n1"])
    out = render_into(tmp_path / "out", "slurm", creds, "copy",
                      f"deploy.redis_tls_dir={certs}")
    script = (out / "sluice.sbatch").read_text()
    assert 'REDIS_URL="rediss://$HEAD_HOST:$REDIS_PORT/0"' in script
    assert '--set "bus.tls_ca_file=$SECRETS/tls/ca.crt"' in script
    redis = next(ln for ln in script.splitlines() if ln.startswith("redis-server "))
    assert '--port 0 --tls-port "$REDIS_PORT"' in redis
    assert '--tls-key-file "$SECRETS/redis-tls/redis.key"' in redis
    assert 'deploy check-cert "$SECRETS/redis-tls/redis.crt" --host "$HEAD_HOST"' in script
    for name in ("tls/ca.crt", "redis-tls/ca.crt", "redis-tls/redis.crt",
                 "redis-tls/redis.key"):
        path = out / "secrets" / name
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, name
    assert not (out / "secrets" / "tls" / "redis.key").exists()  # roles never hold it
    check = subprocess.run(["bash", "-n", str(out / "sluice.sbatch")], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stderr
