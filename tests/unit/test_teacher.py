"""workers.teacher: the in-process teacher against a hand forward, vLLM answers parsed,
and the vocabulary check."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config import ConfigError, load_config
from pipeline.model import load_model
from tests.helpers import build_bpe_model
from trainer.batch import Batch
from trainer.logprobs import CompletionLogprobs
from trainer.packing import make_layout
from workers.teacher import LocalTeacher, _completion_logprobs, check_teacher, check_vocab

ROWS = [  # (prompt, completion, mask): lengths differ; the second has environment tokens
    (np.array([5, 6, 7, 66], np.int32), np.array([5, 6, 7, 1], np.int32),
     np.array([1, 1, 1, 1], np.uint8)),
    (np.array([9, 66], np.int32), np.array([9, 9, 40, 41, 9, 1], np.int32),
     np.array([1, 1, 0, 0, 1, 1], np.uint8)),
    (np.array([4, 4, 4, 4, 4, 66], np.int32), np.array([4], np.int32),
     np.array([1], np.uint8)),
]


def _hand(model: torch.nn.Module, prompt: np.ndarray, completion: np.ndarray) -> np.ndarray:
    """log softmax of a plain full forward over prompt + completion, temperature 1."""
    with torch.no_grad():
        x = torch.tensor([[*prompt.tolist(), *completion.tolist()]])
        logits = model(x).logits[0, len(prompt) - 1:-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion).long()[:, None])
    return lp[:, 0].numpy()


@pytest.mark.parametrize("batch_tokens", [1, 16384])  # one row per forward / all in one
def test_local_teacher_logprobs_equal_a_hand_forward(tiny_model_dir: Path,
                                                     batch_tokens: int) -> None:
    model, _ = load_model(tiny_model_dir)
    teacher = LocalTeacher(model, batch_tokens=batch_tokens, head_chunk=3)
    got = asyncio.run(teacher.logprobs(ROWS))
    assert len(got) == len(ROWS)
    for (p, c, m), lp in zip(ROWS, got, strict=True):
        assert lp.dtype == np.float32 and lp.shape == c.shape
        want = _hand(model, p, c)
        np.testing.assert_allclose(lp[m > 0], want[m > 0], atol=1e-5)
        assert (lp[m == 0] == 0).all()  # environment tokens: not computed


def _trainer_batch(rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> Batch:
    """``rows`` as the trainer's padded batch (advantages and behaviour logprobs 0)."""
    b = len(rows)
    width = max(len(p) + len(c) for p, c, _ in rows)
    t = max(len(c) for _, c, _ in rows)
    ids, att = torch.zeros((b, width), dtype=torch.long), torch.zeros((b, width), dtype=torch.long)
    comp, mask = torch.zeros((b, t), dtype=torch.long), torch.zeros((b, t))
    for r, (p, c, m) in enumerate(rows):
        ids[r, :len(p) + len(c)] = torch.from_numpy(np.concatenate([p, c]).astype(np.int64))
        att[r, :len(p) + len(c)] = 1
        comp[r, :len(c)] = torch.from_numpy(c.astype(np.int64))
        mask[r, :len(c)] = torch.from_numpy(m.astype(np.float32))
    return Batch(input_ids=ids, attention_mask=att,
                 completion_start=torch.tensor([len(p) for p, _, _ in rows]),
                 completion_ids=comp, behaviour_logps=torch.zeros((b, t)), mask=mask,
                 advantages=torch.zeros(b), versions=torch.zeros((b, t), dtype=torch.long))


def test_local_teacher_logprobs_equal_the_trainers(tiny_model_dir: Path) -> None:
    """The teacher and the trainer share `pipeline.rl.logprobs`: on the same model and
    tokens, the teacher's logprob is the trainer's (temperature 1, padded layout)."""
    model, _ = load_model(tiny_model_dir)
    got = LocalTeacher(model, head_chunk=3).forward(ROWS)
    batch = _trainer_batch(ROWS)
    with torch.no_grad():
        want, _, _ = CompletionLogprobs(model, 1.0, chunk_tokens=2)(
            make_layout(batch, "padded", 0), batch)
    for r, ((_, c, m), lp) in enumerate(zip(ROWS, got, strict=True)):
        np.testing.assert_allclose(lp[m > 0], want[r, :len(c)].numpy()[m > 0], rtol=0,
                                   atol=1e-6)


def test_vllm_prompt_logprobs_answer_is_cut_to_the_completion() -> None:
    prompt, mask = np.array([3, 4], np.int32), np.array([1, 0, 1], np.uint8)
    seq = [3, 4, 10, 11, 1]
    answer = [None, {"4": {"logprob": -0.1}}, {"10": {"logprob": -1.5, "rank": 2}},
              {"11": {"logprob": -7.0}}, {"1": {"logprob": -0.25}, "9": {"logprob": -2.0}}]
    np.testing.assert_allclose(_completion_logprobs(answer, seq, prompt, mask),
                               [-1.5, 0.0, -0.25])
    with pytest.raises(ValueError, match="no logprob for token 1"):
        _completion_logprobs([*answer[:4], {"9": {"logprob": -2.0}}], seq, prompt, mask)
    with pytest.raises(ValueError, match="4 prompt logprobs for 5 tokens"):
        _completion_logprobs(answer[:4], seq, prompt, mask)


def test_a_teacher_with_another_vocabulary_is_a_config_error_naming_scoring_teacher(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    other = build_bpe_model(tmp_path / "bpe")
    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"scoring.teacher={other}"])
    with pytest.raises(ConfigError, match=r"^scoring\.teacher: .*another vocabulary"):
        check_vocab(cfg)
    with pytest.raises(ConfigError, match=r"^scoring\.teacher: "):
        check_teacher(cfg)  # what the scorer and `sluice up` / `sluice score` run
    # the same vocabulary (another model with the same tokenizer) passes
    check_vocab(load_config(None, [f"model.path={tiny_model_dir}",
                                   f"scoring.teacher={tiny_model_dir}"]))
    # a policy `sluice up` is about to build (model.init): its tiny tokenizer is compared
    check_vocab(load_config(None, [f"model.path={tmp_path / 'not-built-yet'}",
                                   "model.init=tiny-char-qwen2",
                                   f"scoring.teacher={tiny_model_dir}"]))
    missing = load_config(None, [f"model.path={tiny_model_dir}",
                                 f"scoring.teacher={tmp_path / 'nothing'}"])
    with pytest.raises(ConfigError, match=r"^scoring\.teacher: no model at"):
        check_vocab(missing)


def test_empty_rewards_need_a_teacher() -> None:
    with pytest.raises(ConfigError, match=r"scoring\.rewards: empty, and there is no "
                                          r"scoring\.teacher"):
        load_config(None, ["scoring.rewards=[]"])
    assert load_config(None, ["scoring.rewards=[]", "scoring.teacher=x"]).scoring.rewards == []
