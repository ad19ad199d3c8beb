"""LoRA runs of `polyrl train` (gin/experiments/tiny_grpo_lora.gin): GRPO learns the copy
task on both backends with adapters only, the reference is the actor's base (no
reference workers), and a resumed run repeats the uninterrupted one's metrics."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from run_checks import assert_same_steps

from polyrl.configure.launch import train
from polyrl.loop.metrics import read_jsonl

LORA = "gin/experiments/tiny_grpo_lora.gin"
JAX = "gin/backends/jax_pjit.gin"
# As tests/trainer/test_trainer.py: a uniformly random policy earns ~0.042; emitting only
# (random) digits ~0.24, so a mean above 0.25 over the last steps needs some copying.
RANDOM_PLAY = 0.042

import peft  # noqa: E402, F401 (pinned in requirements/cpu.lock: missing must fail, not skip)


def _params(run_dir: Path, *extra: str) -> list[str]:
    return [
        f"polyrl.RunConfig.run_dir = {str(run_dir)!r}",
        "polyrl.RunConfig.tensorboard = False",
        *extra,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch_fsdp", "jax_pjit"])
def test_lora_grpo_learns(backend, ray_session, tmp_path, capsys):
    """Measured (torch, 30 steps): reward 0.024 -> 0.35 over the last 5 steps."""
    run = tmp_path / backend
    files = [LORA] + ([JAX] if backend == "jax_pjit" else [])
    train(files, _params(run, "polyrl.RunConfig.total_steps = 30"))
    rewards = np.array([r["reward/mean"] for r in read_jsonl(run / "metrics.jsonl")])
    assert rewards[:2].mean() < 2 * RANDOM_PLAY, rewards[:5]
    assert rewards[-5:].mean() > 0.25, rewards
    # The reference is the actor's base (adapters off): it did not move with the adapters.
    assert "log-probs moved" not in capsys.readouterr().out


@pytest.mark.slow
def test_lora_run_resumes_with_the_same_metrics(ray_session, tmp_path):
    """2 steps + checkpoint (adapters and their optimizer state only), then --resume to 4:
    the same metrics as 4 steps in one go."""
    common = ["polyrl.RunConfig.save_every = 2", "polyrl.LoraConfig.dropout = 0.1"]
    full, part = tmp_path / "full", tmp_path / "part"
    train([LORA], _params(full, "polyrl.RunConfig.total_steps = 4", *common))
    train([LORA], _params(part, "polyrl.RunConfig.total_steps = 2", *common))
    train([LORA], _params(part, "polyrl.RunConfig.total_steps = 4", *common), resume=True)
    a, b = read_jsonl(full / "metrics.jsonl"), read_jsonl(part / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert_same_steps(b, a)
    assert a[-1]["actor/kl_loss"] > 0  # the adapters moved the policy off the reference
    # The first push is the whole model, later ones (in the resumed run too) only the
    # adapted projections, all seven here: per layer q (+bias), k and v (+bias, 2 of 4
    # heads), o, gate, up, down, in fp32.
    from polyrl.data.tiny import TinyModelSpec

    spec = TinyModelSpec()
    h, i = spec.hidden_size, spec.intermediate_size
    kv = spec.num_key_value_heads * h // spec.num_attention_heads
    per_layer = (h * h + h) + 2 * (kv * h + kv) + h * h + 3 * h * i
    moved_gb = spec.num_hidden_layers * per_layer * 4 / 1e9
    assert a[0]["sync/gb"] > moved_gb  # + the embedding and the norms
    for row in a[1:] + b[2:]:
        assert row["sync/gb"] == pytest.approx(moved_gb, rel=1e-12), row["step"]
