"""The scorer as an on-policy distillation scorer (``scoring.teacher``; real Redis,
in-process teacher): per-token advantages handed off, flat groups kept, the audit's
reward-advantage check, the KL it reports, and teacher failures."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.bus.audit import audit
from pipeline.bus.schema import ScoredGroup
from pipeline.config import load_config
from pipeline.model import load_model
from sluice.embedded import EmbeddedRedis
from tests.conftest import arun
from tests.helpers import make_group
from tests.integration.test_scorer import _score_all
from workers.scorer import Scorer
from workers.teacher import Row, TeacherError

pytestmark = pytest.mark.integration

BEHAVIOUR = -0.5  # make_group's logprob of every token


def _teacher_lps(model: torch.nn.Module, prompt: np.ndarray, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        x = torch.tensor([[*prompt.tolist(), *ids.tolist()]])
        lp = torch.log_softmax(model(x).logits[0, len(prompt) - 1:-1].float(), -1)
    return lp.gather(-1, torch.tensor(ids).long()[:, None])[:, 0].numpy()


def _groups() -> list:
    varied = make_group("0:1", texts=("123", "12", "1", "9"))
    varied.rollouts[0].mask = np.array([1, 0, 1, 1], np.uint8)  # "2" inserted by an env
    varied.rollouts[0].logprobs[1] = 0.0
    flat = make_group("0:2", texts=("123",) * 4)  # equal rewards: no reward advantage
    return [varied, flat]


def _config(tmp_path: Path, run_name: str, url: str, model: Path, *sets: str):
    return load_config(None, [
        f"run.name={run_name}", f"run.output_dir={tmp_path}", f"bus.redis_url={url}",
        "bus.block_ms=50", f"model.path={model}", f"scoring.teacher={model}",
        "scoring.zero_variance=filter", "scoring.teacher_coef=0.5", *sets])


@pytest.mark.parametrize("rewards", ["[]", "[{fn='workers.tasks.rewards:copy_reward'}]"])
def test_scorer_hands_off_per_token_teacher_advantages_and_keeps_flat_groups(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path, tiny_model_dir: Path,
        rewards: str) -> None:
    cfg = _config(tmp_path, run_name, redis_server.url, tiny_model_dir,
                  f"scoring.rewards={rewards}")
    groups = _groups()
    scorer, (scored, dlq) = arun(_score_all(cfg, redis_server.url, run_name, groups))
    assert not dlq and scorer.counts["scored"] == 2 and scorer.counts["filtered"] == 0
    model, _ = load_model(tiny_model_dir)
    by_gid = {s.group.group_id: s for s in scored}
    r = np.array([1.0, 0.5, 0.25, 0.0])  # copy rewards of "123","12","1","9" vs "123"
    group_adv = {"0:1": (r - r.mean()) / (r.std(ddof=1) + 1e-4) if rewards != "[]"
                 else np.zeros(4), "0:2": np.zeros(4)}  # flat: exactly 0
    kl_sum, kl_n = 0.0, 0
    for g in groups:
        sg = by_gid[g.group_id]
        assert isinstance(sg, ScoredGroup) and sg.token_advantages is not None
        for i, ro in enumerate(g.rollouts):
            on = ro.mask > 0
            t = _teacher_lps(model, g.prompt_ids, ro.completion_ids)
            want = np.where(on, group_adv[g.group_id][i] + 0.5 * (t - ro.logprobs), 0.0)
            np.testing.assert_allclose(sg.token_advantages[i], want, atol=1e-5)
            assert sg.advantages[i] == pytest.approx(want[on].mean(), abs=1e-5)
            kl_sum += float((ro.logprobs[on] - t[on]).sum())
            kl_n += int(on.sum())
    assert sg.token_advantages[0].dtype == np.float32
    assert by_gid["0:1"].token_advantages[0][1] == 0.0  # the environment's token
    assert scorer.kl_n == kl_n and scorer.kl_sum == pytest.approx(kl_sum, rel=1e-5)
    info = scorer.info()
    assert info["teacher_tokens"] == kl_n and info["teacher_errors"] == 0
    # the ledger: adv_sum is the reward advantages' (0: centred), kl the group's mean
    rows = [json.loads(x) for f in (tmp_path / "ledger").glob("scorer-*.jsonl")
            for x in f.read_text().splitlines()]
    scored_rows = {x["gid"]: x for x in rows if x["ev"] == "scored"}
    assert all(abs(x["adv_sum"]) < 1e-5 for x in scored_rows.values())
    assert sum(x["kl"] * x["kl_n"] for x in scored_rows.values()) == pytest.approx(
        kl_sum, rel=1e-4)
    rep = audit(tmp_path)
    assert not [v for v in rep.violations if "advantages" in v], rep.summary()


class FlakyTeacher:
    """Fails any call that includes a rollout of prompt ``bad``; else all logprobs -1."""

    def __init__(self, bad: Sequence[int]) -> None:
        self.bad = list(bad)
        self.calls: list[int] = []

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def logprobs(self, rows: Sequence[Row]) -> list[np.ndarray]:
        self.calls.append(len(rows))
        if any(p.tolist() == self.bad for p, _, _ in rows):
            raise TeacherError("teacher refused")
        return [np.full(len(c), -1.0, np.float32) for _, c, _ in rows]


def test_a_teacher_failure_sinks_only_its_own_group(
        redis_server: EmbeddedRedis, run_name: str, tmp_path: Path,
        tiny_model_dir: Path) -> None:
    cfg = _config(tmp_path, run_name, redis_server.url, tiny_model_dir,
                  "scoring.rewards=[]", "bus.max_deliveries=1")
    good, bad = make_group("0:1"), make_group("0:2", answer="45")
    fake = FlakyTeacher(bad.prompt_ids.tolist())

    def prepare(s: Scorer) -> None:
        s.teacher = fake

    scorer, (scored, dlq) = arun(_score_all(cfg, redis_server.url, run_name, [good, bad],
                                            prepare))
    assert fake.calls == [8, 4, 4]  # the read, then each group alone
    assert [s.group.group_id for s in scored] == ["0:1"]
    (dead,) = dlq
    assert "teacher: teacher refused" in dead[1][b"reason"].decode()
    assert scorer.counts["teacher_errors"] == 1 and scorer.counts["dead"] == 1
    np.testing.assert_allclose(scored[0].token_advantages[0], 0.5 * (-1.0 - BEHAVIOUR))  # coef
