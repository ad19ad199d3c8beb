"""On-policy distillation end to end (issue 50): the teacher role scores the student's
sampled tokens on either backend, single- and multi-turn, and the run's advantages equal
a hand computation from transformers' log-probs of the same tokens."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest

from polyrl.configure.launch import parse_config

DISTILL = "gin/experiments/tiny_distill.gin"
JAX = "gin/backends/jax_pjit.gin"
MULTITURN = "gin/experiments/tiny_multiturn.gin"
DISTILL_ALGO = "gin/algos/distillation.gin"


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
    """Advantages = -(student - teacher) per valid token (distill_coef 1, discount 0,
    no task reward), with both sides' log-probs computed here by transformers."""
    temperature = float(cfg.sampling.temperature)
    mask = batch["response_mask"]
    student = _hand_log_probs(cfg.model_path, batch, temperature)
    teacher = _hand_log_probs(teacher, batch, temperature)
    # fp32 engines against an fp64 softmax of fp32 logits: 1e-4 nats
    np.testing.assert_allclose(batch["teacher_log_probs"] * mask, teacher * mask, atol=1e-4)
    want = -(student - teacher) * mask
    assert np.abs(want).max() > 0.1, "teacher and student agree: the check would be vacuous"
    np.testing.assert_allclose(batch["advantages"], want, atol=2e-4)
    kl = ((student - teacher) * mask).sum() / mask.sum()
    assert metrics["distill/reverse_kl"] == pytest.approx(kl, abs=1e-4)
    assert metrics["distill/tokens"] == mask.sum()


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_advantages_equal_a_hand_computation(ray_session, tmp_path, teacher_dir, backend):
    files = [DISTILL] + ([JAX] if backend == "jax" else [])
    teacher = f"teacher/polyrl.RoleConfig.model_path = {str(teacher_dir)!r}"
    batch, metrics, cfg = _one_step(files, tmp_path / backend, teacher)
    _check_by_hand(batch, metrics, cfg, teacher_dir)


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
