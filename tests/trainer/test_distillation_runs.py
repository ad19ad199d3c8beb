"""On-policy distillation end to end (issue 50): the teacher role scores the student's
sampled tokens on either backend, single- and multi-turn, and the run's advantages equal
a hand computation from transformers' log-probs of the same tokens; and (slow tier)
gin/experiments/tiny_distill.gin reaches its teacher's copy reward where GRPO from the same
start, over the same steps, does not."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest

from polyrl.configure.launch import parse_config, train
from polyrl.loop.metrics import read_jsonl

DISTILL = "gin/experiments/tiny_distill.gin"
JAX = "gin/backends/jax_pjit.gin"
MULTITURN = "gin/experiments/tiny_multiturn.gin"
DISTILL_ALGO = "gin/algos/distillation.gin"
SFT = "gin/experiments/tiny_sft.gin"
GRPO = "gin/experiments/tiny_grpo.gin"
TINY = "polyrl.RunConfig.model_path = None"  # the student: the embedded tiny model


def _params(run_dir: Path, *extra: str) -> list[str]:
    return [
        f"polyrl.RunConfig.run_dir = {str(run_dir)!r}",
        "polyrl.RunConfig.tensorboard = False",
        *extra,
    ]


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A teacher with the student's tokenizer and other, larger weights: the tiny model
    of another seed and initialiser scale, so its log-probs differ from the student's
    by tenths of a nat, not thousandths."""
    from polyrl.data.tiny import TinyModelSpec, ensure_tiny_model

    spec = TinyModelSpec(seed=1, initializer_range=0.3)
    return ensure_tiny_model(tmp_path_factory.mktemp("teacher"), spec)


def _hand_log_probs(model_dir, batch, temperature: float) -> np.ndarray:
    """transformers' (fp32, eager) log-prob of every response token [B, R], computed on
    each row's real tokens (from its first prompt token to its last response token),
    at ``temperature``; 0 where the row has no token."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, attn = batch["input_ids"], batch["attention_mask"]
    prompt_len, resp_len = batch["prompts"].shape[1], batch["responses"].shape[1]
    out = np.zeros((len(ids), resp_len))
    for i in range(len(ids)):
        real = np.flatnonzero(attn[i])
        start, end = real[0], real[-1] + 1
        x = torch.as_tensor(ids[i, start:end].astype(np.int64))[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=x).logits[0].double() / temperature, -1)
        for t in range(end - prompt_len):  # token P + t is predicted at P - 1 + t
            out[i, t] = logp[prompt_len - 1 + t - start, ids[i, prompt_len + t]].item()
    return out


def _off_rows(off: np.ndarray, batch, teacher: np.ndarray, student: np.ndarray) -> str:
    """Which rows' teacher log-probs missed the hand computation, and what else those rows
    show: whether the student's engine log-probs (old_log_probs) miss there too (then the
    rows' inputs differ, not the teacher), the row's ids and mask (this check failed once
    in CI, 12 of 512 tokens off by up to 0.0046, and has not been reproduced since)."""
    rows = np.flatnonzero(off.any(axis=1))
    lines = [f"{int(off.sum())} teacher log-probs of {len(rows)} row(s) off by > 1e-4:"]
    for i in rows[:6]:
        cols = np.flatnonzero(off[i])
        engine, hand = batch["teacher_log_probs"][i, cols], teacher[i, cols]
        mask = batch["response_mask"][i]
        student_off = np.abs(batch["old_log_probs"][i] - student[i]) * mask
        lines.append(
            f"row {i} of {len(off)} at {cols.tolist()}: engine {engine.tolist()} hand "
            f"{hand.tolist()}; the student's there off by {student_off.max():.2e}; "
            f"input_ids {batch['input_ids'][i].tolist()} attention_mask "
            f"{batch['attention_mask'][i].tolist()}"
        )
    return "\n".join(lines)


def _one_step(gin_files: list[str], run_dir: Path, *extra: str):
    """Step 1's batch of a real run (rollout, reward, the teacher's and the actor's
    forwards, the advantages) and its advantage metrics, and the run's config."""
    from polyrl.configure.launch import _components, prepare
    from polyrl.loop.trainer import RLTrainer

    cfg, _ = parse_config(gin_files, _params(run_dir, "polyrl.RunConfig.total_steps = 1", *extra))
    cfg, spec = prepare(cfg)
    trainer = RLTrainer(cfg, spec, _components(cfg, spec))
    try:
        batch = trainer.reward(trainer.collect(0))
        with contextlib.ExitStack() as actor_turn:
            batch = trainer.score(batch, actor_turn)
        batch, metrics = trainer.advantages(batch)
    finally:
        trainer.shutdown()
    return batch, metrics, cfg


def _check_by_hand(batch, metrics, cfg, teacher) -> None:
    """Advantages = -(d - baseline) per valid token, d = student - teacher (distill_coef 1,
    discount 0, no task reward; baseline: the batch's token mean of d with
    distill_baseline, else 0), both sides' log-probs computed here by transformers."""
    temperature = float(cfg.sampling.temperature)
    mask = batch["response_mask"]
    student = _hand_log_probs(cfg.model_path, batch, temperature)
    teacher = _hand_log_probs(teacher, batch, temperature)
    # fp32 engines against an fp64 softmax of fp32 logits: 1e-4 nats
    off = np.abs(batch["teacher_log_probs"] - teacher) * mask > 1e-4
    assert not off.any(), _off_rows(off, batch, teacher, student)
    kl = ((student - teacher) * mask).sum() / mask.sum()
    baseline = kl if cfg.algo_overrides.get("distill_baseline") else 0.0
    want = -(student - teacher - baseline) * mask
    assert np.abs(want).max() > 0.1, "teacher and student agree: the check would be vacuous"
    np.testing.assert_allclose(batch["advantages"], want, atol=2e-4)
    assert metrics["distill/reverse_kl"] == pytest.approx(kl, abs=1e-4)
    assert metrics["distill/tokens"] == mask.sum()


# The teacher in a pool of its own (placement as any engine role's), on JAX; shared on torch.
OWN_POOL = (
    "polyrl.RunConfig.pools = {'shared': {'CPU': 1.5}, 'teacher': {'CPU': 0.5}}",
    "teacher/polyrl.RoleConfig.pool = 'teacher'",
)


# JAX in the slow tier (41-60 s here): the default tier has torch end to end and the
# estimator on numpy, torch and jax (tests/algos/test_distillation.py)
@pytest.mark.parametrize("backend", ["torch", pytest.param("jax", marks=pytest.mark.slow)])
def test_advantages_equal_a_hand_computation(ray_session, tmp_path, teacher_dir, backend):
    files = [DISTILL] + ([JAX] if backend == "jax" else [])
    teacher = f"teacher/polyrl.RoleConfig.model_path = {str(teacher_dir)!r}"
    pools = OWN_POOL if backend == "jax" else ()
    batch, metrics, cfg = _one_step(files, tmp_path / backend, teacher, TINY, *pools)
    assert cfg.teacher.pool == ("teacher" if pools else "shared")
    assert cfg.algo_overrides["distill_baseline"]  # tiny_distill.gin's; multi-turn: without
    _check_by_hand(batch, metrics, cfg, teacher_dir)


# slow: 33-45 s here; the default tier has the estimator on multi-turn masks
# (tests/algos/test_distillation.py::test_multi_turn_masked_tokens_carry_no_kl_and_no_discount_step)
@pytest.mark.slow
def test_multi_turn_observation_tokens_carry_no_advantage(ray_session, tmp_path, teacher_dir):
    """A multi-turn episode's environment tokens (response mask 0 between the turns) get
    advantage 0; the student's tokens around them the hand-computed reverse KL."""
    teacher = f"teacher/polyrl.RoleConfig.model_path = {str(teacher_dir)!r}"
    batch, metrics, cfg = _one_step(
        [MULTITURN, DISTILL_ALGO],
        tmp_path / "multiturn",
        teacher,
        "polyrl.RunConfig.algo_overrides = {}",
        "polyrl.RunConfig.prompts_per_step = 4",
        "polyrl.RunConfig.mini_batch_prompts = 4",
    )
    mask, attn = batch["response_mask"], batch["attention_mask"][:, batch["prompts"].shape[1] :]
    observation = (attn == 1) & (mask == 0)
    assert observation.any(), "no episode had a second turn: nothing checks the masking"
    assert (batch["advantages"][observation] == 0).all()
    _check_by_hand(batch, metrics, cfg, teacher_dir)


def _rewards(run_dir: Path) -> np.ndarray:
    return np.array([r["reward/mean"] for r in read_jsonl(run_dir / "metrics.jsonl")])


def _first_reaching(rewards: np.ndarray, target: float, window: int = 3) -> int | None:
    """The first step (from 1) whose last ``window`` steps' mean reward is >= target."""
    means = np.convolve(rewards, np.ones(window) / window, mode="valid")
    hits = np.flatnonzero(means >= target)
    return int(hits[0]) + window if len(hits) else None


@pytest.mark.slow
def test_distillation_reaches_the_teachers_reward_where_grpo_does_not(ray_session, tmp_path):
    """tiny_distill.gin's recipe, as its header writes it: one SFT run makes the teacher
    (final export) and the student (step-20 export); the distillation run and a GRPO run
    start from that student with the same prompts, samples and steps (20).

    Measured (2-core CPU): teacher 1.00; distillation 0.24 -> 0.88 (3-step mean >= 0.6 x
    the teacher's from step 14, last 5 steps 0.82); GRPO 0.24 -> 0.53 (never >= 0.6, last 5
    steps 0.49); distillation without its baseline 0.41, with a teacher after 30 SFT steps
    0.59. Margins: distillation reaches 0.6 x the teacher's reward within the 20 steps, GRPO
    does not, and distillation's last-5 mean is >= GRPO's + 0.15."""
    sft = tmp_path / "sft"
    train(
        [SFT],
        _params(sft, "polyrl.RunConfig.total_steps = 100", "polyrl.RunConfig.export_every = 20"),
    )
    student, teacher = sft / "exports" / "step_20", sft / "hf"
    start = f"polyrl.RunConfig.model_path = {str(student)!r}"
    scored = tmp_path / "teacher_reward"  # the teacher's reward: step 1 samples before any update
    train(
        [GRPO],
        _params(
            scored,
            f"polyrl.RunConfig.model_path = {str(teacher)!r}",
            "polyrl.RunConfig.total_steps = 1",
        ),
    )
    teacher_reward = _rewards(scored)[0]
    assert teacher_reward > 0.9, teacher_reward
    distill, grpo = tmp_path / "distill", tmp_path / "grpo"
    train(
        [DISTILL],
        _params(distill, start, f"teacher/polyrl.RoleConfig.model_path = {str(teacher)!r}"),
    )
    train([GRPO], _params(grpo, start, "polyrl.RunConfig.total_steps = 20"))
    d, g = _rewards(distill), _rewards(grpo)
    print(f"teacher {teacher_reward:.2f}\ndistillation {np.round(d, 2)}\nGRPO {np.round(g, 2)}")
    assert len(d) == len(g) == 20 and abs(d[0] - g[0]) < 0.05  # the same start
    target = 0.6 * teacher_reward
    assert _first_reaching(d, target) is not None, d
    assert _first_reaching(g, target) is None, g
    assert d[-5:].mean() >= g[-5:].mean() + 0.15, (d, g)
