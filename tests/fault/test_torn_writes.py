"""Torn writes: checkpoints and weight versions survive kill -9 at any moment of their
write and a full disk.

A real writer process (the trainer's `Checkpointer` and the `WeightStore` it publishes
through) saves step after step, every parameter set to the step number, and is killed
with SIGKILL at random moments inside a write (``SLUICE_TEST_WRITE_PAUSE_S`` slows each
file so the kill lands in one). Each restart resumes like the trainer: removes what the
killed writer left, loads the newest checkpoint and checks it is whole (its weights,
optimizer and meta agree) and that every weight version in the store verifies.
"""

from __future__ import annotations

import errno
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pipeline.durable import TEST_PAUSE_ENV
from tests.helpers import wait_for

pytestmark = pytest.mark.fault

WRITER = textwrap.dedent("""
    import hashlib, json, sys
    from pathlib import Path
    import torch
    from pipeline.weights.store import WeightStore
    from trainer.checkpoint import Checkpointer, TrainerState

    root = Path(sys.argv[1])
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    ckpt, store = Checkpointer(root / "checkpoints", keep=2), WeightStore(root / "weights")
    ckpt.clean_temp(); store.clean_temp()
    st = ckpt.load_latest(model, opt) or TrainerState()
    # resumed whole: every parameter is the step number the meta says
    assert all(float(p.min()) == float(p.max()) == st.step for p in model.parameters()) \\
        or st.step == 0, ("torn checkpoint", st.step)
    for d in sorted(store.root.glob("v*")):  # every version that has a name is whole
        man = json.loads((d / "manifest.json").read_text())
        assert sorted(p.name for p in d.iterdir()) == sorted([*man["files"], "manifest.json"])
        for name, digest in man["files"].items():
            assert hashlib.sha256((d / name).read_bytes()).hexdigest() == digest, d
    print("RESUMED", st.step, flush=True)
    Path(sys.argv[2]).write_text(f"RESUMED {st.step}")
    while True:
        st.step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(st.step)
        opt.zero_grad(); model(torch.ones(1, 64)).sum().backward(); opt.step()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(st.step)
        blob = torch.full((4096,), float(st.step)).numpy().tobytes()
        store.commit([("a.bin", blob), ("b.bin", blob)], fmt="raw", version=st.step,
                     step=st.step)
        ckpt.save(model, opt, st)
""")


def _start(root: Path, mark: Path, pause_s: float) -> subprocess.Popen[bytes]:
    import os
    env = {**os.environ, TEST_PAUSE_ENV: str(pause_s)}
    return subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(mark)], env=env,
                            cwd=Path(__file__).resolve().parents[2],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _in_a_write(root: Path) -> bool:
    return any(root.glob("checkpoints/.tmp-step-*")) or any(root.glob("weights/.tmp-v*"))


def test_kill9_mid_checkpoint_and_publish_resumes_whole(tmp_path: Path) -> None:
    rng = random.Random()
    resumed = []
    for kill in range(8):
        mark = tmp_path / f"resumed-{kill}"
        p = _start(tmp_path, mark, pause_s=0.05)
        try:  # resumed (it checked what the last kill left), then inside a write
            wait_for(lambda p=p, m=mark: m.exists() or p.poll() is not None, 60,
                     "the writer to resume")
            wait_for(lambda p=p: _in_a_write(tmp_path) or p.poll() is not None, 60,
                     "the writer to be inside a write")
            time.sleep(rng.uniform(0, 0.15))  # a random moment of that write (or next)
        finally:
            p.send_signal(signal.SIGKILL)
            out = p.communicate(timeout=30)[0].decode()
        assert "RESUMED" in out, f"restart {kill} refused what it found:\n{out[-3000:]}"
        resumed.append(int(out.split("RESUMED", 1)[1].split()[0]))
    assert resumed == sorted(resumed), resumed  # never went back
    assert resumed[-1] > 0


def test_full_disk_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    from trainer.checkpoint import Checkpointer, CheckpointError, TrainerState

    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root/CAP_SYS_ADMIN): "
                    f"{r.stderr.strip()}")
    try:
        model = torch.nn.Linear(256, 256)  # ~260 KB of weights, ~780 KB per checkpoint
        opt = torch.optim.AdamW(model.parameters())
        model(torch.ones(1, 256)).sum().backward()
        opt.step()
        ckpt = Checkpointer(mnt / "checkpoints", keep=2)
        ckpt.save(model, opt, TrainerState(step=1))
        (mnt / "filler").write_bytes(b"\0" * (3 * 2**20 - 2 * 800_000))  # leaves < 1 save
        with pytest.raises(CheckpointError) as err:
            ckpt.save(model, opt, TrainerState(step=2))
        assert err.value.errno == errno.ENOSPC
        assert "No space left on device" in str(err.value) and "step 2" in str(err.value)
        assert not list((mnt / "checkpoints").glob(".tmp-*")), "temporary folder left"
        assert [p.name for p in ckpt.list()] == ["step-00000001"]
        fresh = torch.nn.Linear(256, 256)
        st = ckpt.load_latest(fresh, torch.optim.AdamW(fresh.parameters()))
        assert st is not None and st.step == 1
        assert torch.equal(fresh.weight, model.weight)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
