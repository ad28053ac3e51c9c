"""torchrun ranks with FSDP2 on CPU (gloo): the same maths as one rank, and one config.

Each run is a real ``torchrun`` job of `rank_worker.py` (3 SGD steps through
`Trainer.train_step`, micro-batches and packing on); the gathered parameters of a 2-rank
job must equal a 1-rank job's on the same batches to 1e-5.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import ROOT

pytestmark = pytest.mark.integration

CONFIG = """
[run]
name = "ranks"
output_dir = "{out}"
ledger = false
[model]
path = "{model}"
init = ""
[generation]
num_generations = 4
max_new_tokens = 8
[trainer]
groups_per_step = 4
micro_batch_tokens = 48
packing = true
lr = 0.05
threads = 1
"""


def _torchrun(tmp: Path, model: Path, nproc: int, name: str,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cfg = tmp / f"{name}.toml"
    cfg.write_text(CONFIG.format(out=tmp / name, model=model))
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
            "-m", "tests.integration.rank_worker", str(cfg),
            str(tmp / f"{name}.safetensors")]
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                               **(env or {})})


def _free_port() -> int:
    from pipeline.ports import free_port

    return free_port()


def test_two_ranks_train_the_same_parameters_as_one(tmp_path: Path, tiny_model_dir: Path
                                                    ) -> None:
    one = _torchrun(tmp_path, tiny_model_dir, 1, "one")
    assert one.returncode == 0, one.stderr[-4000:]
    two = _torchrun(tmp_path, tiny_model_dir, 2, "two")
    assert two.returncode == 0, two.stderr[-4000:]
    a, b = load_file(tmp_path / "one.safetensors"), load_file(tmp_path / "two.safetensors")
    start = load_file(tiny_model_dir / "model.safetensors")
    assert a.keys() == b.keys()
    moved = max(float((a[k] - start[k]).abs().max()) for k in a if k in start)
    assert moved > 1e-3  # the steps did change the weights: the comparison means something
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-5, rtol=1e-5, msg=k)


def test_ranks_that_disagree_on_the_config_fail_at_start_naming_the_key(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    run = _torchrun(tmp_path, tiny_model_dir, 2, "bad",
                    {"SLUICE_TEST_RANK1_SET": "trainer.epsilon=0.3"})
    assert run.returncode != 0
    assert "trainer.epsilon: rank 1 has 0.3, rank 0 has 0.2" in run.stderr + run.stdout
