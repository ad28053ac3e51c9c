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
import os
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
    env = {**os.environ, TEST_PAUSE_ENV: str(pause_s)}
    return subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(mark)], env=env,
                            cwd=Path(__file__).resolve().parents[2],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _in_a_write(root: Path) -> bool:
    return any(root.glob("checkpoints/.tmp-step-*")) or any(root.glob("weights/.tmp-v*"))


def _newest_checkpoint(root: Path) -> int:
    """The newest committed checkpoint's step (0: none), as `Checkpointer.list` sees it."""
    return max((int(d.name[5:]) for d in root.glob("checkpoints/step-*")
                if (d / "meta.json").exists()), default=0)


def test_kill9_mid_checkpoint_and_publish_resumes_whole(tmp_path: Path) -> None:
    """Each round waits until the writer has committed a checkpoint past the one it
    resumed from (progress is made however slow the machine) and is inside a write
    again, then kills it at a random moment: the restart must resume whole, from at
    least the newest checkpoint committed before the kill."""
    rng = random.Random()
    resumed, committed = [], 0
    for kill in range(8):
        before = committed
        mark = tmp_path / f"resumed-{kill}"
        p = _start(tmp_path, mark, pause_s=0.05)
        try:  # resumed (it checked what the last kill left), committed, inside a write
            wait_for(lambda p=p, m=mark: m.exists() or p.poll() is not None, 120,
                     "the writer to resume")
            wait_for(lambda p=p, c=committed: _newest_checkpoint(tmp_path) > c
                     or p.poll() is not None, 120, "the writer to commit a checkpoint")
            committed = _newest_checkpoint(tmp_path)
            wait_for(lambda p=p: _in_a_write(tmp_path) or p.poll() is not None, 120,
                     "the writer to be inside a write")
            time.sleep(rng.uniform(0, 0.15))  # a random moment of that write (or next)
        finally:
            p.send_signal(signal.SIGKILL)
            out = p.communicate(timeout=30)[0].decode()
        assert "RESUMED" in out, f"restart {kill} refused what it found:\n{out[-3000:]}"
        resumed.append(int(out.split("RESUMED", 1)[1].split()[0]))
        assert resumed[-1] >= before, (kill, resumed, before)  # nothing committed lost
    assert resumed == sorted(resumed), resumed  # never went back
    final = _start(tmp_path, tmp_path / "resumed-final", pause_s=0)
    try:
        wait_for(lambda: (tmp_path / "resumed-final").exists() or final.poll() is not None,
                 120, "the last restart to resume")
    finally:
        final.send_signal(signal.SIGKILL)
        out = final.communicate(timeout=30)[0].decode()
    assert "RESUMED" in out, out[-3000:]
    assert int(out.split("RESUMED", 1)[1].split()[0]) >= committed > 0, (out, committed)


PRUNER = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from pipeline.weights.store import WeightStore

    root = Path(sys.argv[1])
    for line in sys.stdin:  # one writer per line, forked: the imports are paid once
        pid = os.fork()
        if pid == 0:
            store = WeightStore(root, keep=1)
            store.clean_temp()
            version = max([int(p.name[1:]) for p in root.glob("v*")] or [0])
            while True:  # every commit prunes the version before it: 64 files to delete
                version += 1
                store.commit([(f"f{i}.bin", b"x" * 4096) for i in range(64)], fmt="raw",
                             version=version, step=version)
        print(pid, flush=True)
        print(os.waitpid(pid, 0)[1], flush=True)
""")


def _half_versions(root: Path) -> list[str]:
    """Version folders that are not whole: a manifest missing, or files it does not
    list, or files it lists missing."""
    import json

    bad = []
    for d in sorted(root.glob("v*")):
        man = d / "manifest.json"
        names = sorted(p.name for p in d.iterdir())
        if not man.exists() or names != sorted([*json.loads(man.read_text())["files"],
                                                "manifest.json"]):
            bad.append(f"{d.name}: {len(names)} files, manifest {man.exists()}")
    return bad


def _versions(root: Path) -> set[str]:
    try:
        return {p.name for p in root.iterdir() if p.name.startswith("v")}
    except FileNotFoundError:
        return set()


def test_kill9_mid_prune_leaves_no_half_version(tmp_path: Path) -> None:
    """The weight store prunes the version before each new one, right after the new
    one's rename. A writer (a real process, forked from one that paid the imports) is
    killed with SIGKILL a random few milliseconds after a new version appears, so most
    kills land inside a prune: no ``v<N>`` folder may be left with some of its files (a
    reader would find it under its name). Before `pipeline.durable.remove_dir`, several
    of 30 kills did."""
    rng = random.Random()
    root = tmp_path / "weights"
    root.mkdir()
    zygote = subprocess.Popen([sys.executable, "-c", PRUNER, str(root)],
                              cwd=Path(__file__).resolve().parents[2], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert zygote.stdin is not None and zygote.stdout is not None
    try:
        for kill in range(30):
            seen = _versions(root)
            zygote.stdin.write("go\n")
            zygote.stdin.flush()
            pid = int(zygote.stdout.readline())
            try:  # a new version renamed into place: its prune of the one before follows
                wait_for(lambda s=seen: _versions(root) - s, 120,
                         "the writer to commit a version", 0.001)
                time.sleep(rng.uniform(0, 0.01))
            finally:
                os.kill(pid, signal.SIGKILL)
            assert int(zygote.stdout.readline()) == signal.SIGKILL, kill  # died by it
            assert not _half_versions(root), (kill, _half_versions(root))
    finally:
        zygote.kill()
        zygote.communicate(timeout=30)


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
