"""One trainer rank for tests/integration/test_ranks.py, run under torchrun.

``torchrun --nproc_per_node N -m tests.integration.rank_worker RUN.toml OUT.safetensors``
trains 3 SGD steps (lr 0.05, so the parameters move measurably) on the same synthetic
groups through `Trainer.train_step` (each rank its share, FSDP2 over gloo when N > 1) and
rank 0 writes the gathered parameters. ``SLUICE_TEST_RANK1_SET=key=value`` gives rank 1 a
different config (the disagreement test).
"""

from __future__ import annotations

import os
import sys

import torch
from safetensors.torch import save_file

from benchmarks.synthetic import scored_groups
from pipeline.config import load_config
from trainer.trainer import Trainer


def main() -> None:
    config, out = sys.argv[1], sys.argv[2]
    overrides = []
    if os.environ.get("RANK") == "1" and os.environ.get("SLUICE_TEST_RANK1_SET"):
        overrides.append(os.environ["SLUICE_TEST_RANK1_SET"])
    cfg = load_config(config, overrides)
    torch.set_num_threads(1)
    tr = Trainer(cfg)
    sgd = torch.optim.SGD([p for p in tr.model.parameters() if p.requires_grad], lr=0.05)
    tr.optimizer = tr.setup.optimizer = sgd
    gps = cfg.trainer.groups_per_step
    groups = scored_groups(3 * gps, cfg.generation.num_generations, vocab_size=76,
                           prompt_tokens=(3, 10), completion_tokens=(1, 8), seed=11)
    for step in range(3):
        tr.train_step(groups[step * gps:(step + 1) * gps])
    state = tr.weights()
    if tr.ranks.is_main:
        if isinstance(state, torch.nn.Module):
            state = {k: v.detach().clone().contiguous() for k, v in state.state_dict().items()}
        save_file(dict(state), out)
    tr.ranks.close()


if __name__ == "__main__":
    main()
