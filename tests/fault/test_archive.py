"""The archive under faults, in a real pipeline: the archiver killed (kill -9) mid-run and
restarted under its name leaves every trained group in the archive exactly once; and a
replay of the run on the CPU, across a trainer killed mid-run and resumed, reproduces the
original's weights bit for bit (an A/B replay with another loss trains on the same data;
a config that changes the data is refused; a truncated archive file stops the replay
before the first step it would leave a gap in)."""

from __future__ import annotations

import os
import random
import shutil
import time
import uuid
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.archive.history import step_plan
from pipeline.bus.keys import ARCHIVERS_GROUP
from pipeline.bus.ledger import read_ledgers
from pipeline.config import ConfigError, load_config
from tests.fault.harness import GROUPS_PER_STEP, Pipeline

pytestmark = pytest.mark.fault

ARCHIVE = {"file_s": 0.3}  # many small files: kills land before, in and after a write


def stop_with_archive_drained(p: Pipeline) -> None:
    """Stop every role, the archiver last and only once it has read everything that
    reached `scored` (it writes what it holds when it stops)."""
    for name, role in list(p.roles.items()):
        if role in ("generate", "score") and p.procs[name].poll() is None:
            assert p.stop(name) == 0, p.log(name)
    if p.procs["trainer-0"].poll() is None:
        assert p.stop("trainer-0") == 0, p.log("trainer-0")
    p.wait(lambda: not p.group("scored", ARCHIVERS_GROUP)["undelivered"], 120,
           lambda: f"the archiver to read all of scored\n{p.logs()}", 0.2)
    p.stop_all()


def archived_gids(out: Path) -> Counter[str]:
    return Counter(g for f in sorted((out / "archive" / "groups").glob("*.parquet"))
                   for g in pq.read_table(f, columns=["gid"])["gid"].to_pylist())


@pytest.fixture(params=["redis", "cluster"])
def archived(request: pytest.FixtureRequest, tmp_path: Path, tiny_model_dir: Path
             ) -> Pipeline:
    """An archiving pipeline on its own redis-server, and on the session's 3-master Redis
    Cluster in 3 lanes."""
    if request.param == "redis":
        return Pipeline(tmp_path, tiny_model_dir, archive=ARCHIVE)
    return Pipeline(tmp_path, tiny_model_dir, run=f"a{uuid.uuid4().hex[:8]}",
                    cluster=request.getfixturevalue("redis_cluster"), partitions=3,
                    archive=ARCHIVE)


def test_archiver_killed_mid_run_resumes_without_gaps_or_duplicates(archived: Pipeline
                                                                    ) -> None:
    pipeline = archived
    with pipeline as p:
        for role, name in (("train", "trainer-0"), ("archive", "archiver-0"),
                           ("generate", "g0"), ("score", "s0")):
            p.start(role, name)
        p.wait_trained(8)
        rng = random.Random(0)
        kills = 6 if os.environ.get("SLUICE_FAULTS") == "full" else 2
        for _ in range(kills):  # at whatever it is doing: reading, holding, writing, acking
            files = int(p.worker("archiver/").get("files", 0))
            p.wait(lambda f=files: int(p.worker("archiver/").get("files", 0)) > f, 60,
                   lambda: f"the archiver to write a file\n{p.logs()}", 0.05)
            time.sleep(rng.uniform(0, ARCHIVE["file_s"]))  # a random moment of its cycle
            p.kill9("archiver-0")
            trained = p.trained()
            p.wait_trained(trained + GROUPS_PER_STEP)  # the run goes on without it
            p.start("archive", "archiver-0")
        p.wait_trained(p.trained() + 2 * GROUPS_PER_STEP)
        stop_with_archive_drained(p)
        report = p.assert_clean(min_trained=16)
        rows = read_ledgers(p.out)
        handed = {r["gid"] for r in rows if r["ev"] == "handed_off"}
        trained = {r["gid"] for r in rows if r["ev"] == "trained"}
        gids = archived_gids(p.out)
        assert set(gids) == handed and trained <= handed, (len(gids), len(handed))
        assert max(gids.values()) == 1, [g for g, n in gids.items() if n > 1]
        assert report.archived == len(handed)


def test_replay_reproduces_the_run_bit_for_bit_across_a_trainer_restart(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    from trainer.replay import replay

    with Pipeline(tmp_path, tiny_model_dir, archive=ARCHIVE) as p:
        for role, name in (("train", "trainer-0"), ("archive", "archiver-0"),
                           ("generate", "g0"), ("score", "s0")):
            p.start(role, name)
        p.wait_trained(7 * GROUPS_PER_STEP)  # past the checkpoint of step 5
        p.kill9("trainer-0")  # the steps after its last checkpoint are lost
        p.start("train", "trainer-0")
        p.wait_trained(p.trained() + 6 * GROUPS_PER_STEP)
        stop_with_archive_drained(p)
        p.assert_clean(min_trained=13 * GROUPS_PER_STEP)
        config = p.config
    rows = read_ledgers(p.out)
    assert sum(1 for r in rows if r["ev"] == "resumed") == 2
    plan = step_plan(rows)
    cfg = load_config(config)

    result = replay(cfg, str(p.out), out=str(tmp_path / "same"), say=print)
    assert result.gap is None and result.steps == len(plan) == plan[-1].step
    last = f"v{plan[-1].version + 1:08d}"
    assert last in result.compared and f"step-{plan[-1].step:08d}" in result.compared
    assert result.bit_exact, result.compared
    # the published files themselves, not only their tensors (one-key safetensors header)
    assert set(result.compared.values()) == {"bytes"}, result.compared

    ab = replay(load_config(config, ["trainer.loss_type=grpo", "trainer.epsilon=0.1"]),
                str(p.out), out=str(tmp_path / "grpo"), say=print)
    assert ab.steps == len(plan) and not ab.bit_exact  # same data, another loss
    with pytest.raises(ConfigError, match=r"task\.name"):
        replay(load_config(config, ["task.name=add"]), str(p.out), out=str(tmp_path / "x"))

    # a truncated file: reported with the groups it held; no step is trained on a gap
    copy = tmp_path / "broken"
    shutil.copytree(p.out, copy, ignore=shutil.ignore_patterns("redis", "replay*"))
    files = sorted((copy / "archive" / "groups").glob("*.parquet"))
    victim = files[len(files) // 2]
    victim.write_bytes(victim.read_bytes()[:200])
    said: list[str] = []
    broken = replay(cfg, str(copy), out=str(tmp_path / "gap"), say=said.append)
    assert str(victim) in broken.bad_files and broken.bad_files[str(victim)]
    lost = set(broken.bad_files[str(victim)])
    first = next(s for s in plan if lost & set(s.gids))
    assert broken.steps == first.step - 1 and f"step {first.step}" in (broken.gap or "")
    assert any(str(victim) in line for line in said)
