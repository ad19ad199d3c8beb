"""Reward workers: checked results, timeouts, parallel scoring in real Ray actors, and the
pending-task report."""

from __future__ import annotations

import math
import os
import re
import sys
import threading
import time

import numpy as np
import pytest

from polyrl.rewards import REWARDS
from polyrl.rewards.workers import RewardError, RewardPool, check_reward, score_items

ITEM = (3, "12 apples", "12", "my/source", None)


@pytest.mark.parametrize("value", [1, 0.5, np.float32(0.25), np.int64(2), -3.0])
def test_finite_numbers_pass(value):
    assert check_reward(value, ITEM) == float(value)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (float("nan"), "nan, which is not finite"),
        (math.inf, "inf, which is not finite"),
        (True, "True, which is a bool, not a float"),
        (np.bool_(False), "np.False_, which is a bool, not a float"),
        ("1.0", "'1.0', which is a str, not a float"),
        (None, "None, which is a NoneType, not a float"),
        ([1.0], r"\[1.0\], which is a list, not a float"),
    ],
)
def test_bad_rewards_name_source_sample_and_value(value, why):
    with pytest.raises(RewardError) as e:
        check_reward(value, ITEM)
    msg = str(e.value)
    assert "data_source 'my/source', sample 3 (response '12 apples')" in msg
    assert " returned " in msg
    assert re.search(why, msg), msg


def _slow(text, truth, extra):
    time.sleep(60)
    return 1.0


def _raises(text, truth, extra):
    return {"a": 1}["b"]


def test_timeout_and_exceptions_name_the_sample():
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"sample 0 \(response 'x'\) did not return within 0.2 s"):
        score_items({"s": _slow}, [(0, "x", "y", "s", None)], timeout_s=0.2)
    assert time.perf_counter() - t0 < 30  # interrupted, not the 60 s waited out
    with pytest.raises(RewardError, match=r"data_source 's', sample 1 .* raised KeyError: 'b'"):
        score_items({"s": _raises}, [(1, "x", "y", "s", None)], timeout_s=1.0)


def _length_reward(text, truth, extra):
    return float(len(text)) + (extra or {}).get("bonus", 0.0)


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(
        address="local",
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        # as polyrl train does: the workers import what the driver can (this test module)
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}},
    )
    yield ray
    ray.shutdown()


def test_pool_scores_in_workers_in_order(ray_local):
    REWARDS["test/length"] = _length_reward  # a user's reward, registered in the driver
    try:
        pool = RewardPool(num_workers=3, timeout_s=5.0)
    finally:
        del REWARDS["test/length"]
    texts = ["a", "bb", "ccc", "dddd", "", "ffffff", "g"]
    extras = [None] * 6 + [{"bonus": 0.5}]
    scores = pool.score(texts, [""] * 7, ["test/length"] * 7, extras)
    np.testing.assert_array_equal(scores, [1, 2, 3, 4, 0, 6, 1.5])
    # the built-in rule runs there too; a bad value raised in a worker keeps its message
    assert pool.score(["472"], ["472"], ["polyrl/copy"], [None]).tolist() == [1.0]
    with pytest.raises(RewardError, match=r"no reward function for data_source 'nope', sample 0"):
        pool.score(["x"], ["x"], ["nope"], [None])
    pool.shutdown()


def test_pending_task_is_reported(ray_local):
    from polyrl.observe.health import watch_pending

    ray = ray_local
    hog = ray.remote(lambda: time.sleep(30)).options(num_cpus=1).remote()  # takes the CPU
    waiting = ray.remote(lambda: 1).options(num_cpus=1).remote()
    seen: list[str] = []
    stop = watch_pending(user_cpus=0, after_s=1.0, every_s=0.5, echo=seen.append)
    deadline = time.monotonic() + 20
    while not seen and time.monotonic() < deadline:
        time.sleep(0.2)
    stop.set()
    ray.cancel(hog, force=True)
    ray.cancel(waiting, force=True)
    assert seen and "asking for {'CPU': 1.0}" in seen[0] and "RunConfig.user_cpus" in seen[0]


def test_pending_watch_outlives_a_failed_status_call(ray_local, monkeypatch):
    """A status call that fails once (a GCS hiccup on a loaded node) does not end the
    watch: before, the first failure stopped it for the rest of the run, silently."""
    from polyrl.observe import health

    calls = []

    def flaky(gcs: str) -> dict[str, int]:
        calls.append(gcs)
        if len(calls) == 1:
            raise TimeoutError("GetClusterStatus timed out")
        return {"{'CPU': 1.0}": 1}  # a request that waits on every later poll

    monkeypatch.setattr(health, "_demands", flaky)
    seen: list[str] = []
    warned = threading.Event()
    echo = lambda line: (seen.append(line), warned.set())  # noqa: E731
    stop = health.watch_pending(user_cpus=0, after_s=0.2, every_s=0.05, echo=echo)
    warned.wait(10)
    stop.set()
    assert len(calls) >= 2 and seen and "asking for {'CPU': 1.0}" in seen[0], (calls, seen)
