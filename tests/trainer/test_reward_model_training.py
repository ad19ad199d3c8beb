"""Bradley-Terry reward-model training (algorithm ``reward_model``, gin/experiments/tiny_rm.gin):
the held-out pair accuracy rises, the export is a sequence classifier that the reward_model
role loads and scores exactly as the trainer did, on both backends."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from reward_model_checks import classifier_scores, rl_step_rewards

from polyrl.configure.launch import parse_config, train
from polyrl.loop.metrics import read_jsonl

RM = "gin/experiments/tiny_rm.gin"


def _params(run_dir: Path, *extra: str) -> list[str]:
    return [
        f"polyrl.RunConfig.run_dir = {str(run_dir)!r}",
        "polyrl.RunConfig.tensorboard = False",
        *extra,
    ]


def test_reward_model_learns_the_held_out_pairs(ray_session, tmp_path):
    """tiny_rm.gin as written (60 steps, held-out pairs of the copy task's test split every
    10 steps). The head starts at zero, so every pair ties before the first step:
    accuracy 0 (a tie is wrong), margin 0. The chosen response copies the prompt's digits
    and the rejected changes every one, so a model that learns to read the prompt
    separates them: the final held-out accuracy must pass 0.8 (measured: 0.95)."""
    run = tmp_path / "rm"
    train([RM], _params(run))
    rows = read_jsonl(run / "metrics.jsonl")
    val = {r["step"]: r for r in rows if "val/pair_accuracy" in r}
    assert sorted(val) == [0, 10, 20, 30, 40, 50, 60]
    assert val[0]["val/pair_accuracy"] == 0.0 and val[0]["val/rewards/margins"] == 0.0
    assert val[60]["val/pair_accuracy"] > 0.8, {s: r["val/pair_accuracy"] for s, r in val.items()}
    assert val[60]["val/rewards/margins"] > 0
    assert "critic/rewards/accuracies" in rows[-1] and "actor/loss" not in rows[-1]
    assert (run / "hf" / "config.json").is_file()


def _scores_reward_role(backend: str, path: Path, batch) -> np.ndarray:
    """The reward_model role's engine (what an RL run starts) on ``path``."""
    from polyrl.backends.base import engine_on_one_device
    from polyrl.config import ModelConfig, ParallelConfig

    engine = engine_on_one_device(backend)
    engine.init(ModelConfig(str(path), role="reward_model"), None, ParallelConfig())
    return np.asarray(engine.forward(batch)["scores"])


# JAX in the slow tier (15-21 s): the default tier has torch; the value head on both
# backends is in tests/backends
@pytest.mark.parametrize(
    "backend", ["torch_fsdp", pytest.param("jax_pjit", marks=pytest.mark.slow)]
)
def test_exported_reward_model_scores_as_the_trainer(ray_session, tmp_path, capsys, backend):
    """Two steps of training, a checkpoint, the run's own export (run/hf) and
    `polyrl export` of the checkpoint: both load as the reward_model role (and as
    transformers' classifier) and score the training pairs as the trainer's critic did."""
    from polyrl.cli import main
    from polyrl.configure.launch import _components, prepare
    from polyrl.configure.validate import score_head
    from polyrl.loop.trainer import LOOPS, RewardModelTrainer

    run = tmp_path / backend
    cfg, operative = parse_config(
        [RM],
        _params(
            run,
            f"polyrl.RunConfig.backend = {backend!r}",
            "polyrl.RunConfig.total_steps = 2",
            "polyrl.RunConfig.save_every = 2",
            "polyrl.RunConfig.eval_every = 0",
            "critic/polyrl.OptimConfig.lr = 1e-2",  # a head far from zero in two steps
        ),
    )
    cfg, spec = prepare(cfg)
    (run / "operative_config.gin").write_text(operative)  # (prepare made run/, as in train)
    assert LOOPS[spec.objective] is RewardModelTrainer
    trainer = RewardModelTrainer(cfg, spec, _components(cfg, spec))
    try:
        trainer.run()
        batch = trainer.prompts.batch(0, 8)
        trained = trainer.critic.forward(batch)["scores"]
    finally:
        trainer.shutdown()
    assert np.ptp(trained) > 1e-2, "equal scores would make the comparisons vacuous"
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 0
    printed = capsys.readouterr().out
    assert f"reward_model/polyrl.RoleConfig.model_path = '{tmp_path / 'exported'}'" in printed
    for path in (run / "hf", tmp_path / "exported"):
        assert score_head(str(path)) is None, path  # validate-config takes it as a reward model
        config = json.loads((path / "config.json").read_text())
        assert (config["architectures"], config["num_labels"]) == (
            ["Qwen2ForSequenceClassification"],
            1,
        )
        # fp32 CPU, the same weights: 1e-5 within a backend, 1e-4 against transformers
        np.testing.assert_allclose(_scores_reward_role(backend, path, batch), trained, atol=1e-5)
        np.testing.assert_allclose(classifier_scores(path, batch), trained, atol=1e-4)


@pytest.mark.slow
def test_rl_run_takes_the_trained_reward_model(ray_session, tmp_path):
    """The export of a reward-model run is an RL run's reward role: each response's reward
    is its rule reward + reward_model_coef x the trained model's score (here computed by
    transformers on the export)."""
    rm_run = tmp_path / "rm"
    train([RM], _params(rm_run, "polyrl.RunConfig.total_steps = 10"))
    batch, got, rule = rl_step_rewards(
        ["gin/experiments/tiny_grpo.gin"],
        _params(
            tmp_path / "grpo",
            f"reward_model/polyrl.RoleConfig.model_path = {str(rm_run / 'hf')!r}",
            "polyrl.RunConfig.reward_model_coef = 0.5",
        ),
    )
    model = classifier_scores(rm_run / "hf", batch)
    assert np.ptp(model) > 1e-2
    np.testing.assert_allclose(got, rule + 0.5 * model, atol=1e-4)
