"""SFT end to end (`polyrl train` with gin/experiments/tiny_sft.gin: real Ray, the torch
backend), its Hugging Face export, `polyrl export` of its checkpoint, and the SFT -> RL
chain by one binding (``polyrl.RunConfig.model_path = "<sft run>/hf"``)."""

from __future__ import annotations

import numpy as np
import pytest
from chat_eval import greedy_exact_match
from safetensors.numpy import load_file

from polyrl.cli import main
from polyrl.configure.launch import train
from polyrl.loop.metrics import read_jsonl

SFT = "gin/experiments/tiny_sft.gin"


def _params(run_dir, *extra: str) -> list[str]:
    return [
        f"polyrl.RunConfig.run_dir = {str(run_dir)!r}",
        "polyrl.RunConfig.tensorboard = False",
        *extra,
    ]


def _exact_match(model_dir, n: int = 32) -> float:
    """Greedy answers equal to the copy task's on the first ``n`` training
    conversations' first exchange."""
    from polyrl.data.tasks import make_chat_rows

    return greedy_exact_match(model_dir, make_chat_rows("copy", n))


@pytest.fixture(scope="module")
def sft_run(ray_session, tmp_path_factory):
    run = tmp_path_factory.mktemp("sft") / "run"
    train(
        [SFT], _params(run, "polyrl.RunConfig.total_steps = 30", "polyrl.RunConfig.save_every = 30")
    )
    return run


def test_sft_run_learns_and_exports(sft_run, capsys):
    rows = read_jsonl(sft_run / "metrics.jsonl")
    nll = [r["actor/nll"] for r in rows]
    assert len(nll) == 30
    # untrained: ~ln(58) = 4.06 nats a token; the copy answers are learnable (the
    # measured run: 4.06 -> 0.55 in 30 steps)
    assert nll[0] > 3.5 and np.mean(nll[-3:]) < 1.2, nll
    assert all(r["sft/target_tokens"] > 0 for r in rows)
    hf = sft_run / "hf"
    assert (hf / "config.json").is_file() and (hf / "tokenizer.json").is_file()
    base = next((sft_run / "models").iterdir())  # the tiny model the run started from
    before, after = _exact_match(base), _exact_match(hf)
    print(f"exact match on training prompts: {before:.2f} -> {after:.2f}")
    assert before == 0.0 and after > 0.2
    # `polyrl export` of the step-30 checkpoint (engine reloaded from DCP) writes the same
    # weights as the run's own final export (the live engine): bit for bit.
    out = sft_run.parent / "exported"
    assert main(["export", str(sft_run), "--out", str(out)]) == 0
    assert "[export] " in capsys.readouterr().out
    got, want = load_file(out / "model.safetensors"), load_file(hf / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert main(["export", str(sft_run), "--out", str(out)]) == 2  # not empty: refused


@pytest.mark.slow
def test_sft_output_starts_an_rl_run_by_one_binding(sft_run, tmp_path):
    rl = tmp_path / "grpo"
    binding = f"polyrl.RunConfig.model_path = {str(sft_run / 'hf')!r}"
    train(
        ["gin/experiments/tiny_grpo.gin"], _params(rl, binding, "polyrl.RunConfig.total_steps = 2")
    )
    rewards = [r["reward/mean"] for r in read_jsonl(rl / "metrics.jsonl")]
    # A random policy scores ~0.042 on copy (tests/trainer/test_trainer.py); the SFT'd
    # model already copies most digits before RL's first update.
    assert rewards[0] > 0.3, rewards


@pytest.mark.slow
def test_sft_run_learns_on_jax(ray_session, tmp_path):
    run = tmp_path / "sft_jax"
    backend = "polyrl.RunConfig.backend = 'jax_pjit'"
    train([SFT], _params(run, backend, "polyrl.RunConfig.total_steps = 30"))
    nll = [r["actor/nll"] for r in read_jsonl(run / "metrics.jsonl")]
    assert nll[0] > 3.5 and np.mean(nll[-3:]) < 1.2, nll  # as on torch (same numbers)
    assert (run / "hf" / "model.safetensors").is_file()
