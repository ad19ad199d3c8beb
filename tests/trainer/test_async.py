"""The asynchronous (one-step off-policy) mode: generation really runs beside the step,
staleness is bounded and logged, batches survive a checkpoint, the tiny task still
learns (real vLLM-CPU, real Ray), and a resumed run takes the same steps."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from polyrl.async_rollout import (
    Rollouts,
    async_problems,
    load_batch,
    mismatch_metrics,
    save_batch,
    staleness_metrics,
)
from polyrl.batch import Batch
from polyrl.config import RunConfig
from polyrl.launch import train
from polyrl.metrics import phase_summary, read_jsonl

GRPO = "gin/experiments/tiny_grpo.gin"
ASYNC = "polyrl.RunConfig.async_rollout = True"


def _batch(step: int) -> Batch:
    return Batch(
        {"rollout_weight_version": np.array([step, step]), "x": np.arange(2.0) + step},
        {"extra_info": [{"i": 1, "tags": ["a"]}, None], "ground_truth": ["12", "3"]},
        {"step": step, "dropped": []},
    )


def test_next_batch_is_generated_while_the_step_runs():
    """collect(1) blocks until the step (after take(0) returned) signals it: if take ran
    it in the caller's thread this would deadlock (and fail on the timeout)."""
    step_running = threading.Event()
    calls: list[tuple[int, str]] = []

    def collect(step: int) -> Batch:
        calls.append((step, threading.current_thread().name))
        if step == 1:
            assert step_running.wait(timeout=30), "collect(1) ran inside take(0)"
        return _batch(step)

    rollouts = Rollouts(collect, total_steps=3, ahead=True)
    first = rollouts.take(0)
    step_running.set()  # "training" on batch 0 happens here
    assert rollouts.settle()["async/generate_s"] >= 0.0
    second = rollouts.take(1)
    rollouts.settle()
    third = rollouts.take(2)
    assert rollouts.settle() == {}  # nothing generated beyond total_steps
    assert [b.info["step"] for b in (first, second, third)] == [0, 1, 2]
    assert [s for s, _ in calls] == [0, 1, 2]  # each batch generated exactly once
    assert calls[0][1] == threading.current_thread().name
    assert calls[1][1] != calls[0][1]


def test_synchronous_mode_generates_in_the_step():
    names = []

    def collect(step):
        names.append(threading.current_thread().name)
        return _batch(step)

    rollouts = Rollouts(collect, total_steps=2, ahead=False)
    rollouts.take(0)
    assert rollouts.settle() == {}
    rollouts.take(1)
    assert names == [threading.current_thread().name] * 2
    assert rollouts.limit == 0


def test_background_error_reaches_the_trainer():
    def collect(step):
        if step == 1:
            raise RuntimeError("server 0 died")
        return _batch(step)

    rollouts = Rollouts(collect, total_steps=2, ahead=True)
    rollouts.take(0)
    with pytest.raises(RuntimeError, match="server 0 died"):
        rollouts.settle()


def test_pending_batch_round_trips_through_a_checkpoint(tmp_path):
    rollouts = Rollouts(_batch, total_steps=5, ahead=True)
    rollouts.take(2)
    rollouts.settle()
    rollouts.save(tmp_path)
    restored = Rollouts(lambda s: pytest.fail("regenerated a saved batch"), 5, ahead=True)
    restored.load(tmp_path, 3)
    got = restored.take(3)
    want = _batch(3)
    assert got.info == want.info
    for k in want.tensors:
        np.testing.assert_array_equal(got[k], want[k])
    assert list(got["extra_info"]) == list(want["extra_info"])
    assert list(got["ground_truth"]) == ["12", "3"]
    # A batch saved for another step is not used for this one.
    save_batch(_batch(7), tmp_path / "pending_batch")
    assert load_batch(tmp_path / "pending_batch").info["step"] == 7
    fresh = Rollouts(_batch, 9, ahead=True)
    fresh.load(tmp_path, 3)
    assert fresh.take(3).info["step"] == 3


def test_mismatch_by_hand():
    batch = Batch(
        {
            "old_log_probs": np.array([[-1.0, -2.0], [-0.5, -9.0]]),
            "rollout_log_probs": np.array([[-1.5, -2.0], [-0.25, 0.0]]),
            "response_mask": np.array([[1.0, 1.0], [1.0, 0.0]]),
        }
    )
    m = mismatch_metrics(batch)  # |diffs| on the 3 real tokens: 0.5, 0, 0.25
    assert m == {"rollout/log_prob_diff_mean": 0.25, "rollout/log_prob_diff_max": 0.5}


def test_staleness_by_hand():
    batch = Batch({"rollout_weight_version": np.array([4, 4, 5, 5])})
    m = staleness_metrics(batch, 5, limit=1)
    assert m == {"rollout/staleness_mean": 0.5, "rollout/staleness_max": 1.0}
    with pytest.raises(RuntimeError, match=r"staleness 0\.\.1 .* outside 0\.\.0"):
        staleness_metrics(batch, 5, limit=0)


def test_invalid_async_configs_name_the_binding(tmp_path):
    from polyrl.algos.registry import get_algorithm

    grpo = get_algorithm("grpo")
    colocated_gpu = RunConfig(
        run_dir=str(tmp_path), async_rollout=True, pools={"shared": {"CPU": 2, "GPU": 1}}
    )
    (problem,) = async_problems(colocated_gpu, grpo)
    assert "RunConfig.async_rollout=True" in problem and "RunConfig.role_pools" in problem
    split = RunConfig(
        run_dir=str(tmp_path),
        async_rollout=True,
        pools={"train": {"GPU": 1}, "gen": {"GPU": 1}},
        role_pools={"actor": "train", "reference": "train", "rollout": "gen"},
    )
    assert async_problems(split, grpo) == []
    (problem,) = async_problems(split, get_algorithm("dpo"))
    assert "no rollouts" in problem


def test_phase_summary_shows_the_overlap():
    rows = [{"time/generate": 0.5, "time/step": 3.0, "async/generate_s": 2.0, "async/wait_s": 0.5}]
    text = phase_summary(rows, ("generate",))
    # 2 s of generation, 0.5 s of it waited for: 1.5 s (75%) ran beside the step
    assert "generation ahead (async): 2.00 s, 1.50 s of it (75.0%) overlapped" in text


# ------------------------------------------------------------------ end to end


def _params(run_dir, *extra):
    return [
        f"polyrl.RunConfig.run_dir = {str(run_dir)!r}",
        "polyrl.RunConfig.tensorboard = False",
        ASYNC,
        *extra,
    ]


def test_async_grpo_learns_with_bounded_staleness(ray_session, tmp_path):
    """The tiny copy task (tests/trainer/test_trainer.py explains the 0.042 random-play
    reward) still learns when every batch but the first is sampled one update behind,
    with TIS on; staleness is logged: 0 for step 0 (nothing ahead yet), 1 after."""
    run = tmp_path / "async"
    train(
        [GRPO],
        _params(
            run,
            "polyrl.RunConfig.total_steps = 30",
            'polyrl.RunConfig.algo_overrides = {"kl_loss_coef": 0.001, "tis_cap": 2.0}',
        ),
    )
    rows = read_jsonl(run / "metrics.jsonl")
    rewards = np.array([r["reward/mean"] for r in rows])
    assert len(rows) == 30
    assert rewards[:2].mean() < 2 * 0.042, rewards[:5]
    assert rewards[-5:].mean() > 0.25, rewards
    assert [r["rollout/staleness_max"] for r in rows] == [0.0] + [1.0] * 29
    assert all(r["rollout/staleness_mean"] == r["rollout/staleness_max"] for r in rows)
    assert all("async/generate_s" in r for r in rows[:-1]) and "async/generate_s" not in rows[-1]
    # TIS weights are in (0, cap] and the metric is logged every step
    assert all(0.0 < r["actor/tis_weight_mean"] <= 2.0 for r in rows)
    # Step 0 is sampled by the trainer's own weights: rollout and trainer log-probs agree to
    # fp32 kernel noise (~5e-7, docs/rollout.md). Later batches come from the policy one
    # update behind, and it shows (lr 3e-3 moves log-probs by far more than 1e-3).
    assert rows[0]["rollout/log_prob_diff_max"] < 1e-4
    assert np.mean([r["rollout/log_prob_diff_mean"] for r in rows[1:]]) > 1e-3


@pytest.mark.slow
def test_async_run_resumes_with_the_same_metrics(ray_session, tmp_path):
    """Stop an async run after its step-2 checkpoint; --resume must take the steps an
    uninterrupted async run takes: the batch generated ahead (by the step-1 weights) is
    read back from the checkpoint, not regenerated by the restored step-2 weights."""
    common = ("polyrl.RunConfig.total_steps = 4", "polyrl.RunConfig.save_every = 2")
    full = tmp_path / "full"
    train([GRPO], _params(full, *common))

    class Stop(Exception):
        pass

    def stop_at_2(step, metrics):
        if step == 2:
            raise Stop

    cut = tmp_path / "cut"
    with pytest.raises(Stop):
        train([GRPO], _params(cut, *common), on_step=stop_at_2)
    assert (cut / "checkpoints" / "step_2" / "pending_batch.npz").exists()
    train([GRPO], _params(cut, *common), resume=True)
    a, b = read_jsonl(full / "metrics.jsonl"), read_jsonl(cut / "metrics.jsonl")
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    for x, y in zip(a, b):
        for key in ("reward/mean", "actor/loss", "actor/grad_norm", "rollout/staleness_mean"):
            # Same seeds, data and weights; fp32 CPU kernels: 1e-6 allows for
            # reduction-order noise in a restarted engine (as the synchronous test).
            assert x[key] == pytest.approx(y[key], rel=1e-6, abs=1e-7), (x["step"], key)
