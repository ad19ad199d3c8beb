"""End-to-end runs of `polyrl train` on the tiny model: real vLLM (CPU), real Ray, both
backends. Each run asserts what it must show: learning, isolation, exact resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from run_checks import assert_same_steps

from polyrl.configure.launch import parse_config, train
from polyrl.loop.metrics import read_jsonl

GRPO = "gin/experiments/tiny_grpo.gin"
ROOT = Path(__file__).resolve().parents[2]


def _params(run_dir: Path, *extra: str) -> list[str]:
    return [
        f"polyrl.RunConfig.run_dir = {str(run_dir)!r}",
        "polyrl.RunConfig.tensorboard = False",
        *extra,
    ]


def _rewards(run_dir: Path) -> np.ndarray:
    return np.array([r["reward/mean"] for r in read_jsonl(run_dir / "metrics.jsonl")])


# A uniformly random policy over the 58-token vocabulary earns, per answer position,
# (1 * 1/58 + 0.25 * 9/58) ~ 0.056; over 3 of 4 response positions that is ~0.042. Even a
# policy that has learned to emit only (random) digits gets 0.325 * 3/4 ~ 0.24, so a mean
# above 0.25 over the last steps needs some copying.
RANDOM_PLAY = 0.042


def test_grpo_learns_on_torch(ray_session, tmp_path):
    run = tmp_path / "grpo_torch"
    train([GRPO], _params(run, "polyrl.RunConfig.total_steps = 30"))
    rewards = _rewards(run)
    assert len(rewards) == 30
    assert rewards[:2].mean() < 2 * RANDOM_PLAY, rewards[:5]
    assert rewards[-5:].mean() > 0.25, rewards
    assert (run / "summary.png").exists() and (run / "operative_config.gin").exists()
    assert "RunConfig.algorithm = 'grpo'" in (run / "operative_config.gin").read_text()


@pytest.mark.slow
def test_grpo_learns_on_jax(ray_session, tmp_path):
    run = tmp_path / "grpo_jax"
    train(["gin/experiments/tiny_grpo_jax.gin"], _params(run, "polyrl.RunConfig.total_steps = 30"))
    rewards = _rewards(run)
    assert rewards[:2].mean() < 2 * RANDOM_PLAY, rewards[:5]
    assert rewards[-5:].mean() > 0.25, rewards


@pytest.mark.slow
def test_ppo_trains_critic_with_kl_in_reward(ray_session, tmp_path):
    run = tmp_path / "ppo"
    train(["gin/experiments/tiny_ppo.gin"], _params(run, "polyrl.RunConfig.total_steps = 20"))
    rows = read_jsonl(run / "metrics.jsonl")
    assert all("critic/loss" in r and "kl_in_reward/kl" in r for r in rows)
    # The policy moves away from the reference, so the measured KL grows from 0.
    assert rows[0]["kl_in_reward/kl"] < 1e-4 < rows[-1]["kl_in_reward/kl"]
    # The critic learns the returns: its loss falls.
    assert np.mean([r["critic/loss"] for r in rows[-5:]]) < np.mean(
        [r["critic/loss"] for r in rows[:3]]
    )
    assert np.mean([r["reward/mean"] for r in rows[-5:]]) > 3 * RANDOM_PLAY


def test_dpo_raises_the_margin(ray_session, tmp_path):
    run = tmp_path / "dpo"
    train(["gin/experiments/tiny_dpo.gin"], _params(run, "polyrl.RunConfig.total_steps = 10"))
    rows = read_jsonl(run / "metrics.jsonl")
    # Step 0's first update starts from the reference: margin 0 (beta * 0). It must grow.
    assert abs(rows[0]["actor/rewards/margins"]) < 0.1
    assert rows[-1]["actor/rewards/margins"] > 0.2
    assert rows[-1]["actor/rewards/accuracies"] > 0.8


def test_reference_log_probs_do_not_move_with_the_actor(ray_session, tmp_path, capsys):
    """Isolation: the reference is its own frozen engine, not the actor's object; the
    run-time check after the first update stays quiet, and speaks up when the reference
    is (wrongly) the actor's own workers."""
    from polyrl.configure.launch import _components, prepare
    from polyrl.loop.trainer import RLTrainer

    cfg, _ = parse_config([GRPO], _params(tmp_path / "iso", "polyrl.RunConfig.total_steps = 2"))
    cfg, spec = prepare(cfg)
    trainer = RLTrainer(cfg, spec, _components(cfg, spec))
    try:
        probe = trainer.reward(trainer.collect(0))
        ref_before = trainer.reference.forward(probe)["log_probs"]
        actor_before = trainer.actor.forward(probe)["log_probs"]
        trainer.run()
        # not bitwise: two CPU forwards of one batch in one worker differed by 1.4e-6 in
        # 10 of 512 log-probs in one fresh-clone run; a reference moving with the actor
        # moves as it does (> 1e-3, below)
        after = trainer.reference.forward(probe)["log_probs"]
        np.testing.assert_allclose(after, ref_before, rtol=0, atol=1e-5)
        moved = np.abs(trainer.actor.forward(probe)["log_probs"] - actor_before).max()
        assert moved > 1e-3, "the actor did not change, so the check above proves nothing"
        assert "log-probs moved" not in capsys.readouterr().out
        trainer.reference, trainer.start_step = trainer.actor, 2  # a shared "reference"
        trainer.step(2)
        out = capsys.readouterr().out
        assert "WARNING: the reference role's log-probs moved by up to" in out, out
    finally:
        trainer.shutdown()


@pytest.mark.slow  # 99 s on the 2-core machine; the default tier resumes a run in
# test_reliability's dead-worker case
def test_killed_run_resumes_with_the_same_metrics(ray_session, tmp_path):
    """SIGKILL a run after its step-2 checkpoint; --resume must reproduce the steps an
    uninterrupted run takes (same data order, sampling seeds, optimizer state)."""
    common = ["polyrl.RunConfig.total_steps = 4", "polyrl.RunConfig.save_every = 2"]
    full = tmp_path / "full"
    train([GRPO], _params(full, *common))

    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "polyrl.cli", "train", "--gin_file", GRPO]
    cmd += [
        a
        for p in _params(
            killed, "polyrl.RunConfig.total_steps = 100", "polyrl.RunConfig.save_every = 2"
        )
        for a in ("--gin_param", p)
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.time() + 300
        while not (killed / "checkpoints" / "step_2" / "trainer_state.json").exists():
            assert proc.poll() is None and time.time() < deadline, "run died or never checkpointed"
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    train([GRPO], _params(killed, *common), resume=True)
    a, b = read_jsonl(full / "metrics.jsonl"), read_jsonl(killed / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4]  # steps count from 1, as step_N does
    assert_same_steps(b, a)
    state = json.loads((killed / "checkpoints" / "step_4" / "trainer_state.json").read_text())
    assert state["step"] == 4


def test_reward_model_role_adds_its_scores(ray_session, tmp_path, tiny_model_dir):
    """The reward role is its own frozen engine: a response's reward = rule reward +
    coef x the reward model's score, which must equal transformers' sequence classifier
    on the same unpadded sequence."""
    from reward_model_checks import classifier_scores, rl_step_rewards
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, set_seed

    rm_dir = tmp_path / "reward_model"
    set_seed(7)  # a random, non-zero score head
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    rm.save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(rm_dir)

    batch, got, rule = rl_step_rewards(
        [GRPO],
        _params(
            tmp_path / "rm_run",
            f"reward_model/polyrl.RoleConfig.model_path = {str(rm_dir)!r}",
            "polyrl.RunConfig.reward_model_coef = 2.0",
        ),
    )
    hf = classifier_scores(rm_dir, batch)
    assert np.abs(hf).max() > 1e-3, "a zero head would make this test vacuous"
    # fp32 CPU forward, same weights, two implementations: 1e-4.
    np.testing.assert_allclose(got, rule + 2.0 * hf, atol=1e-4)


def test_taking_turns_changes_no_number(ray_session, tmp_path):
    """offload_colocated: engines are offloaded outside their phases and the rollout
    sleeps while the trainer works. On CPU the moves are host -> host, so every metric
    must equal the run without turns (to float rounding, as two runs of one seed do:
    tests/run_checks.py), and the engines must really be offloaded after a step (a
    direct forward is refused). Without turns (the CPU default) the reference and
    old log-prob forwards run at once, with the same numbers as one after the other, and
    no reload, offload or sleep happens at all."""
    from polyrl.configure.launch import _components, prepare
    from polyrl.loop.trainer import RLTrainer

    plain = tmp_path / "plain"
    train([GRPO], _params(plain, "polyrl.RunConfig.total_steps = 3"))
    cfg, _ = parse_config(
        [GRPO],
        _params(
            tmp_path / "turns",
            "polyrl.RunConfig.total_steps = 3",
            "polyrl.RunConfig.offload_colocated = True",
        ),
    )
    cfg, spec = prepare(cfg)
    trainer = RLTrainer(cfg, spec, _components(cfg, spec))
    try:
        trainer.run()
        probe = trainer.reward(trainer.collect(0))
        with pytest.raises(Exception, match="offloaded"):
            trainer.actor.forward(probe)
    finally:
        trainer.shutdown()
    assert_same_steps(
        read_jsonl(tmp_path / "turns" / "metrics.jsonl"), read_jsonl(plain / "metrics.jsonl")
    )
    moves = ("time/reload", "time/offload", "time/rollout_sleep", "time/rollout_wake")
    for row in read_jsonl(plain / "metrics.jsonl"):
        assert not [k for k in moves if k in row] and 0 < row["time/overhead"] < row["time/step"]
    for row in read_jsonl(tmp_path / "turns" / "metrics.jsonl"):  # no sleep mode on CPU
        assert "time/reload" in row and "time/offload" in row and "time/rollout_sleep" not in row

    def spans(run):
        events = json.loads((run / "timeline.json").read_text())
        return {(e["args"]["step"], e["name"]): e for e in events if e.get("ph") == "X"}

    together, serial = spans(plain), spans(tmp_path / "turns")
    for step in (1, 2, 3):
        ref, old = together[step, "reference"], together[step, "old_log_probs"]
        assert ref["ts"] == old["ts"] and ref["tid"] != old["tid"]  # one start, two tracks
        ref, old = serial[step, "reference"], serial[step, "old_log_probs"]
        assert ref["ts"] + ref["dur"] <= old["ts"]


# streaming (single-turn): its batches are the placeholder's columns at the same width
STREAM_WARM = ("polyrl.RunConfig.streaming = True", "polyrl.RunConfig.max_staleness = 1")


@pytest.mark.parametrize(
    "gin, extra",
    [
        ("gin/experiments/tiny_grpo_jax.gin", ()),
        pytest.param("gin/experiments/tiny_grpo.gin", (), marks=pytest.mark.slow),
        pytest.param("gin/experiments/tiny_grpo_jax.gin", STREAM_WARM, marks=pytest.mark.slow),
        pytest.param("gin/experiments/tiny_grpo.gin", STREAM_WARM, marks=pytest.mark.slow),
        # (the default tier checks the multi-turn placeholder's columns and shapes:
        # tests/rollout/test_episode_tokens.py)
        pytest.param("gin/experiments/tiny_multiturn_jax.gin", (), marks=pytest.mark.slow),
        pytest.param("gin/experiments/tiny_multiturn.gin", (), marks=pytest.mark.slow),
    ],
    ids=["jax", "torch", "jax-stream", "torch-stream", "jax-multiturn", "torch-multiturn"],
)
def test_the_warm_up_leaves_step_1_nothing_to_compile(ray_session, tmp_path, capsys, gin, extra):
    """RunConfig.warm_up: while vLLM starts, each role compiles step 1's programs on a
    placeholder of its batch (its columns and padded shapes, for JAX's jitted programs;
    rows with and without padding, for torch.compile's graphs: anything of the real batch
    the placeholder misses is a program the step compiles again), so the step compiles
    nothing; the start-up line names the wait."""
    import ray

    from polyrl.configure.launch import _components, prepare
    from polyrl.loop.trainer import RLTrainer

    params = _params(
        tmp_path / "warm",
        "polyrl.RunConfig.total_steps = 1",
        "polyrl.RunConfig.compile = True",
        *extra,
    )
    cfg, _ = parse_config([gin], params)
    cfg, spec = prepare(cfg)
    trainer = RLTrainer(cfg, spec, _components(cfg, spec))

    def count(worker) -> int:  # (a closure: Ray sends it by value)
        """Programs the worker compiled: JAX's jitted traces, torch.compile's graphs."""
        if hasattr(worker.engine, "compile_count"):
            return worker.engine.compile_count
        from torch._dynamo.utils import counters

        return counters["stats"]["unique_graphs"]

    def compiled() -> dict[str, int]:
        return {
            role: ray.get(group.workers[0].__ray_call__.remote(count))
            for role, group in trainer.groups.items()
        }

    try:
        warmed = compiled()
        assert warmed["actor"] >= 2 and warmed["reference"] >= 1, warmed
        trainer.run()
        assert compiled() == warmed
    finally:
        trainer.shutdown()
    assert ", warm-up " in capsys.readouterr().out
