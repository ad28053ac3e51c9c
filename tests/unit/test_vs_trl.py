"""sluice's GRPO maths against TRL's own GRPOTrainer code, on the same batch and model.

TRL (a test-only dependency, pinned in the ``dev`` extra) runs its real code path:
``GRPOTrainer._generate_and_score_completions`` (rewards, ``sum_then_normalize`` reward
weights, ``scale_rewards``, old logprobs, the vLLM importance-sampling correction, the
reference model) and ``compute_loss``; the only thing replaced is generation, through
TRL's public ``rollout_func`` hook, which returns fixed token ids and "sampler" logprobs.
sluice runs ``pipeline.rl.advantages`` (what the scorer runs) and ``trainer.step`` (what
the trainer runs) on the same rows. Loss, advantages and every parameter's gradient must
agree to 1e-5.

Set-up notes (the batch is built so both sides see identical tensors):
* all prompts have the same length: TRL left-pads prompts and the model derives
  positions from the attention mask in neither codebase, so padded prompts would shift
  RoPE phases in TRL only;
* the "sampler" logprobs are the model's own plus fixed offsets in [-1.6, 1.6], so IS
  ratios cross both ``is_clip_min`` = 0.5 and ``is_clip_max`` = 3;
* TRL applies the IS correction only with vLLM; the test sets ``use_vllm`` after
  construction, which is exactly the switch TRL's loss code reads;
* every case names the IS mode: TRL's default is ``sequence_mask``, sluice's is
  ``token_truncate`` (docs/compared-with-trl.md).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")  # installed with trl (dev extra)
trl = pytest.importorskip("trl")

from pipeline.bus.schema import Rollout, RolloutGroup, ScoredGroup  # noqa: E402
from pipeline.model import load_model  # noqa: E402
from pipeline.rl.advantages import batch_advantages, combine_rewards  # noqa: E402
from pipeline.rl.losses import LossConfig  # noqa: E402
from trainer.batch import Batch, build_batch  # noqa: E402
from trainer.step import StepSettings, compute_loss, optimize, token_logps  # noqa: E402

EOS = 1
PROMPTS = [[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]]
G = 4
# 8 distinct completions, lengths 1..6, some stopped by eos, some cut at the max length.
COMPLETIONS = [
    [30, 31, 32, EOS], [30, 33, EOS], [34, 35, 36, 37, 38, 39], [40, EOS],
    [41, 42, 43, 44, 45, EOS], [46], [47, 48, 49, 50, 51, 52], [53, 54, EOS],
]
MAX_LEN = 6
# Two reward functions; None = "not applicable" (TRL: NaN, left out of the weighted sum).
REWARD_A: list[float | None] = [1.0, 0.0, 0.5, None, 0.25, 1.0, 0.0, 0.75]
REWARD_B: list[float | None] = [0.2, 0.4, None, 0.1, 0.9, 0.3, 0.3, 0.0]
WEIGHTS = [1.0, 0.5]
OFFSETS = torch.tensor([-1.6, -0.9, -0.3, 0.0, 0.4, 0.8, 1.2, 1.6])
ATOL = 1e-5


def _lookup(values: list[float | None]) -> Any:
    table = {tuple(c): v for c, v in zip(COMPLETIONS, values, strict=True)}

    def reward(prompts: list, completions: list, completion_ids: list, **_: Any) -> list:
        return [table[tuple(ids)] for ids in completion_ids]

    reward.__name__ = f"reward_{id(values)}"
    return reward


def _sampler_logps(model_dir: Path, temperature: float) -> list[list[float]]:
    """The model's own logprobs plus fixed offsets: a sampler that is off-policy."""
    model, _ = load_model(model_dir)
    batch = _batch(model_dir, [[0.0] * len(c) for c in COMPLETIONS], np.zeros(len(COMPLETIONS)))
    with torch.no_grad():
        lp, _ = token_logps(model, batch, temperature)
    out = []
    for i, c in enumerate(COMPLETIONS):
        off = OFFSETS.roll(i)[: len(c)]
        out.append((lp[i, : len(c)] + off).tolist())
    return out


def _batch(model_dir: Path, sampler: list[list[float]], advantages: np.ndarray) -> Batch:
    groups = []
    for g, prompt in enumerate(PROMPTS):
        rollouts = [
            Rollout(completion_ids=np.array(c, np.int32), logprobs=np.array(s, np.float32),
                    versions=np.zeros(len(c), np.int32), mask=np.ones(len(c), np.uint8),
                    finish_reason="stop" if c[-1] == EOS else "length", text="")
            for c, s in zip(COMPLETIONS[g * G:(g + 1) * G], sampler[g * G:(g + 1) * G],
                            strict=True)
        ]
        rg = RolloutGroup(group_id=f"0:{g}", prompt_index=g, epoch=0, prompt={"text": "p"},
                          prompt_ids=np.array(prompt, np.int32), generator="test",
                          t_admit=0.0, t_done=0.0, rollouts=rollouts)
        adv = advantages[g * G:(g + 1) * G].astype(np.float32)
        groups.append(ScoredGroup(group=rg.for_training(),
                                  rewards=np.zeros(G, np.float32), reward_parts={},
                                  advantages=adv, scorer="test", t_scored=0.0))
    return build_batch(groups, pad_id=0)


def _sluice_advantages(scale_rewards: str) -> np.ndarray:
    per_fn = np.array([[np.nan if v is None else v for v in col]
                       for col in (REWARD_A, REWARD_B)]).T
    total = combine_rewards(per_fn, np.array(WEIGHTS))
    groups = [total[g * G:(g + 1) * G] for g in range(len(PROMPTS))]
    return np.concatenate(batch_advantages(groups, scale_rewards=scale_rewards))  # type: ignore[arg-type]


def _trl_trainer(model_dir: Path, tmp: Path, sampler: list[list[float]],
                 **cfg: Any) -> Any:
    from trl import GRPOConfig, GRPOTrainer

    def rollout_func(prompts: list, trainer: Any) -> dict[str, list]:
        assert len(prompts) == len(COMPLETIONS)
        return {"prompt_ids": [PROMPTS[i // G] for i in range(len(COMPLETIONS))],
                "completion_ids": [list(c) for c in COMPLETIONS],
                "logprobs": [list(s) for s in sampler]}

    args = GRPOConfig(
        output_dir=str(tmp), per_device_train_batch_size=len(COMPLETIONS), num_generations=G,
        max_completion_length=MAX_LEN, report_to="none", bf16=False, use_cpu=True,
        reward_weights=WEIGHTS, logging_steps=1, learning_rate=1e-3, seed=0,
        vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=3.0, **cfg)
    _, tok = load_model(model_dir)
    ds = datasets.Dataset.from_dict({"prompt": ["p0", "p1"]})
    tr = GRPOTrainer(model=str(model_dir), reward_funcs=[_lookup(REWARD_A), _lookup(REWARD_B)],
                     args=args, train_dataset=ds, processing_class=tok,
                     rollout_func=rollout_func)
    tr.use_vllm = True  # the switch TRL's IS correction reads; generation is rollout_func
    tr.vllm_importance_sampling_correction = True
    tr._last_loaded_step = tr.state.global_step
    tr.current_gradient_accumulation_steps = 1
    tr.model.train()
    return tr


def _trl_rows() -> list[dict[str, str]]:
    return [{"prompt": f"p{i // G}"} for i in range(len(COMPLETIONS))]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pipeline.model import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("trl") / "tiny", seed=3, hidden_size=64,
                           intermediate_size=128)


CASES: list[dict[str, Any]] = [
    # loss types (IS token_truncate, group scaling)
    {"loss_type": "dapo"},
    {"loss_type": "grpo"},
    {"loss_type": "bnpo"},
    {"loss_type": "dr_grpo"},
    # IS modes
    {"vllm_importance_sampling_mode": "token_mask"},
    {"vllm_importance_sampling_mode": "sequence_truncate"},
    {"vllm_importance_sampling_mode": "sequence_mask"},
    # advantage scaling
    {"scale_rewards": "batch"},
    {"scale_rewards": "none"},
    # clip-higher, temperature, KL with and without the bias correction
    {"epsilon": 0.1, "epsilon_high": 0.28, "temperature": 0.7},
    {"beta": 0.1, "loss_type": "grpo"},
    {"beta": 0.1, "use_bias_correction_kl": False},
    # GSPO's sequence-level ratio and CISPO (epsilon_high = the ratio cap)
    {"importance_sampling_level": "sequence"},
    {"importance_sampling_level": "sequence", "loss_type": "grpo"},
    {"loss_type": "cispo", "epsilon_high": 5.0},
    # a static entropy bonus (TRL 1.16's entropy_coef: - c times the mean token entropy)
    {"entropy_coef": 0.05},
    {"entropy_coef": 0.05, "loss_type": "grpo"},
]


def _sluice_settings(cfg: dict[str, Any]) -> StepSettings:
    return StepSettings(
        loss=LossConfig(
            loss_type=cfg.get("loss_type", "dapo"), epsilon=cfg.get("epsilon", 0.2),
            epsilon_high=cfg.get("epsilon_high"),
            is_mode=cfg.get("vllm_importance_sampling_mode", "token_truncate"),
            is_clip_min=0.5, is_clip_max=3.0, beta=cfg.get("beta", 0.0),
            kl_bias_correction=cfg.get("use_bias_correction_kl", True),
            max_completion_length=MAX_LEN,
            importance_sampling_level=cfg.get("importance_sampling_level", "token")),
        temperature=cfg.get("temperature", 1.0), num_iterations=cfg.get("num_iterations", 1))


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_loss_advantages_and_gradients_equal_trl(model_dir: Path, tmp_path: Path,
                                                 cfg: dict[str, Any]) -> None:
    cfg = {"loss_type": "dapo", "vllm_importance_sampling_mode": "token_truncate", **cfg}
    temperature = cfg.get("temperature", 1.0)
    sampler = _sampler_logps(model_dir, temperature)
    tr = _trl_trainer(model_dir, tmp_path, sampler, **cfg)
    inputs = tr._generate_and_score_completions(_trl_rows())

    adv = _sluice_advantages(cfg.get("scale_rewards", "group"))
    np.testing.assert_allclose(inputs["advantages"].numpy(), adv, atol=ATOL, rtol=0)

    st = _sluice_settings(cfg)
    model, _ = load_model(model_dir)
    model.train()
    ref = None
    batch = _batch(model_dir, sampler, adv)
    if st.loss.beta > 0:
        ref_model, _ = load_model(model_dir)
        with torch.no_grad():
            ref, _ = token_logps(ref_model, batch, temperature)
    loss, metrics = compute_loss(model, batch, st, ref_logps=ref,
                                 entropy_coef=cfg.get("entropy_coef", 0.0))
    loss.backward()

    trl_loss = tr.compute_loss(tr.model, inputs)
    trl_loss.backward()
    assert float(loss.detach()) == pytest.approx(float(trl_loss.detach()), abs=ATOL)
    ours, theirs = _grads(model), _grads(tr.model)
    assert ours.keys() == theirs.keys() and ours
    for name, g in ours.items():
        torch.testing.assert_close(g, theirs[name], atol=ATOL, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")
    # The batch exercised what it claims to: clipping by the IS bounds, nonzero gradients.
    is_ratio = inputs["importance_sampling_ratio"]
    assert metrics["is_ratio/max"] > 3.0 and metrics["is_ratio/min"] < 0.5
    assert bool(is_ratio.max() <= 3.0 + 1e-6)
    assert max(float(g.abs().max()) for g in ours.values()) > 1e-4
    if cfg.get("beta"):
        assert metrics["kl"] == 0.0  # reference == initial policy: KL value 0, gradient not


@pytest.mark.parametrize(("level", "eps"), [("token", 0.05), ("sequence", 0.01)])
def test_num_iterations_two_matches_trl_replay(model_dir: Path, tmp_path: Path, level: str,
                                               eps: float) -> None:
    """μ = 2: the same two optimizer steps (TRL's old logprobs fixed at batch start), with
    token ratios and with GSPO's sequence ratio (whose clip the second pass reaches)."""
    sampler = _sampler_logps(model_dir, 1.0)
    tr = _trl_trainer(model_dir, tmp_path, sampler, loss_type="dapo", num_iterations=2,
                      epsilon=eps, vllm_importance_sampling_mode="token_truncate",
                      importance_sampling_level=level)
    inputs = tr._generate_and_score_completions(_trl_rows())
    assert inputs.get("old_per_token_logps") is not None  # TRL computed old logprobs once
    # SGD, not Adam: Adam divides by sqrt(v), which turns 1e-9 float noise in near-zero
    # gradients into full-size steps and would compare rounding, not maths.
    trl_opt = torch.optim.SGD(tr.model.parameters(), lr=2.0)
    clip_fracs = []
    for _ in range(2):
        trl_opt.zero_grad()
        tr.compute_loss(tr.model, inputs).backward()
        torch.nn.utils.clip_grad_norm_(tr.model.parameters(), 1.0)
        trl_opt.step()
        clip_fracs.append(tr._metrics["train"]["clip_ratio/region_mean"][-1])

    model, _ = load_model(model_dir)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=2.0)
    st = _sluice_settings({"num_iterations": 2, "epsilon": eps,
                           "importance_sampling_level": level})
    metrics = optimize(model, opt, _batch(model_dir, sampler, _sluice_advantages("group")), st)
    theirs = dict(tr.model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), theirs[name].detach(), atol=ATOL, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")
    # the second pass really was off-policy: its ratio moved past the clip range
    assert clip_fracs[0] == 0.0 and clip_fracs[1] > 0.0
    assert metrics["clip_ratio/region_mean"] == pytest.approx(sum(clip_fracs) / 2, abs=1e-6)


def test_std_ddof_and_eps_conventions() -> None:
    """TRL: unbiased std (ddof 1) + 1e-4. sluice defaults to the same; ddof 0 is the
    population std, kept as an option and tested on both sides."""
    r = np.array([1.0, 0.0, 0.5, 0.25])
    trl_side = (r - r.mean()) / (torch.tensor(r).std().item() + 1e-4)  # torch: ddof 1
    np.testing.assert_allclose(batch_advantages([r], scale_rewards="group")[0], trl_side,
                               atol=1e-6)
    pop = (r - r.mean()) / (np.std(r, ddof=0) + 1e-4)
    np.testing.assert_allclose(batch_advantages([r], scale_rewards="group", ddof=0)[0], pop,
                               atol=1e-6)
    assert not np.allclose(pop, trl_side, atol=1e-3)
    assert math.isclose(float(np.abs(batch_advantages([r], scale_rewards="group",
                                                      eps=0.0)[0]).max()),
                        float(np.abs(r - r.mean()).max() / np.std(r, ddof=1)), rel_tol=1e-6)


def test_loss_depends_on_the_advantages(model_dir: Path) -> None:
    """Guard: flipping the advantages changes the loss, so the equality above is not
    between two constants."""
    st = _sluice_settings({})
    sampler = _sampler_logps(model_dir, 1.0)
    model, _ = load_model(model_dir)
    model.train()
    losses = [float(compute_loss(model, _batch(model_dir, sampler, adv), st)[0].detach())
              for adv in (_sluice_advantages("group"), -_sluice_advantages("group"))]
    assert losses[0] != pytest.approx(losses[1], abs=1e-4)


def test_adaptive_entropy_control_matches_trl(model_dir: Path, tmp_path: Path) -> None:
    """TRL's adaptive entropy control (``use_adaptive_entropy``) and `EntropyControl`
    on the same batch, step after step: the coefficient each loss applies (TRL's
    ``apply_coef``: only after a step at or below the target, none on the first), the
    coefficient after each update (raised by δ at or below the target, lowered above
    it, within [min, max]) and the loss. The target is moved between steps (TRL reads
    ``args.entropy_target`` at every step) so both branches and the gate are crossed."""
    from pipeline.rl.entropy_control import EntropyControl

    sampler = _sampler_logps(model_dir, 1.0)
    cfg = {"use_adaptive_entropy": True, "entropy_coef": 0.02, "entropy_coef_delta": 0.03,
           "entropy_coef_min": 0.0, "entropy_coef_max": 0.07}
    tr = _trl_trainer(model_dir, tmp_path, sampler, loss_type="dapo",
                      vllm_importance_sampling_mode="token_truncate", **cfg)
    inputs = tr._generate_and_score_completions(_trl_rows())
    model, _ = load_model(model_dir)
    model.train()
    batch = _batch(model_dir, sampler, _sluice_advantages("group"))
    st = _sluice_settings({})
    with torch.no_grad():
        h = compute_loss(model, batch, st)[1]["entropy"]
    ctl = EntropyControl(coef=0.02, adaptive=True, delta=0.03, coef_min=0.0, coef_max=0.07)
    applied, coefs = [], []
    # at/below x3 (max reached), above x3 (min reached; the gate closes at once: the
    # last step's entropy is above the new target), at/below x2 (the gate reopens)
    for target in (h + 1, h + 1, h + 1, h - 1, h - 1, h - 1, h + 1, h + 1):
        tr.args.entropy_target = ctl.target = target
        applied.append(ctl.applied())
        assert tr.accelerator.sync_gradients  # TRL updates at an optimizer-step boundary
        trl_loss = float(tr.compute_loss(tr.model, inputs).detach())
        with torch.no_grad():
            loss, metrics = compute_loss(model, batch, st, entropy_coef=applied[-1])
        assert float(loss) == pytest.approx(trl_loss, abs=ATOL)
        ctl.update(metrics["entropy"])
        assert ctl.coef == pytest.approx(tr.entropy_coef, abs=1e-12)
        assert ctl.last_entropy == pytest.approx(tr._last_world_entropy, abs=1e-5)
        coefs.append(ctl.coef)
    assert applied == pytest.approx([0.0, 0.05, 0.07, 0.0, 0.0, 0.0, 0.0, 0.03])
    assert coefs == pytest.approx([0.05, 0.07, 0.07, 0.04, 0.01, 0.0, 0.03, 0.06])
