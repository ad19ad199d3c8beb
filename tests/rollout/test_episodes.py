"""Episodes with envs in real Ray env workers, and on real rollout servers (vLLM CPU)."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest
from episode_policy import TextPolicy

from polyrl.batch import Batch
from polyrl.envs import Env, EpisodeConfig, StepResult, register_env
from polyrl.envs.workers import EnvPool
from polyrl.rollout.episodes import ChatTokens, EpisodeRunner
from polyrl.rollout.sampling import SamplingSpec


@pytest.fixture(scope="module")
def tokenizer(padded_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(padded_model_dir)


@pytest.fixture(scope="module", autouse=True)
def envs_by_value(ray_session):
    """The env workers get this module's env classes by value (the test module is not
    importable in a worker of this Ray session)."""
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@register_env("test/killer")
class Killer(Env):
    """Plays two turns; at turn 1 kills its worker's process when the row says so, or
    (``outlive``: False) holds turn 1 until its worker dies, at most 15 s."""

    def reset(self, row):
        self.kill = row["extra_info"].get("kill", False)
        self.outlive = row["extra_info"].get("outlive", True)
        return super().reset(row)

    def step(self, turn):
        if turn.index == 1 and self.kill:
            os._exit(1)
        if turn.index == 1 and not self.outlive:
            # Episodes run their turns concurrently: without this, an episode sharing the
            # killer's worker could finish its last step before the killer's (seen once in
            # CI: episode 3 ended "done")
            threading.Event().wait(15)
        if turn.index == 1:
            return StepResult(reward=1.0, done=True)
        return StepResult([{"role": "user", "content": "+"}], reward=0.5)


def _prompts(source: str, extras: list[dict]) -> Batch:
    n = len(extras)
    return Batch(
        {"prompt_index": np.arange(n)},
        {
            "prompt": [[{"role": "user", "content": "secret"}]] * n,
            "ground_truth": [str(i % 10) for i in range(n)],
            "data_source": [source] * n,
            "extra_info": extras,
        },
    )


def test_env_worker_killed_mid_episode_ends_only_its_episodes(ray_session, tokenizer):
    """The turns come from TextPolicy (no vLLM needed to kill an env worker)."""
    config = EpisodeConfig(max_turns=3, max_episode_tokens=64, env_workers=2, env_timeout_s=20)
    runner = EpisodeRunner(TextPolicy(tokenizer), EnvPool(2, 20), tokenizer, config)
    try:
        # the first batch's episode k lives on worker k % 2: episode 1 kills worker 1,
        # which also hosts 3 and 5 (they do not outlive it)
        extras = [{"kill": i == 1, "outlive": i % 2 == 0} for i in range(6)]
        spec = SamplingSpec(n=1, max_tokens=4, seed=3)
        batch = runner.generate(_prompts("test/killer", extras), spec)
        assert list(batch["finish_reason"]) == ["done", "env_worker_died"] * 3
        scores = batch["scores"]
        assert list(scores[0::2]) == [1.5] * 3 and scores[1] == 0.5  # the killer keeps turn 0's
        # episodes run their turns concurrently: 3 and 5 died in whichever step their env
        # was in, and each keeps the rewards of the steps its env finished
        for row in (3, 5):
            done = [t["reward"] for t in batch["turns"][row] if "reward" in t]
            assert len(done) <= 1 and scores[row] == pytest.approx(sum(done))
        assert all("env worker 1 died" in t[-1]["error"] for t in batch["turns"][1::2])
        # Ray restarted worker 1: the next batch plays out everywhere
        batch = runner.generate(_prompts("test/killer", [{}] * 6), spec)
        assert list(batch["finish_reason"]) == ["done"] * 6
    finally:
        runner.shutdown()


@pytest.mark.slow  # (the default tier runs episodes on vLLM in tests/trainer/test_multiturn.py)
def test_guess_episodes_on_real_servers(pool, tokenizer):
    """The guessing game on vLLM: sampled tokens carry their log-probs and version, the
    observation tokens are the template's, and the template gives back the same ids
    except where the model sampled a non-canonical split (never in an observation)."""
    config = EpisodeConfig(max_turns=4, max_episode_tokens=80, env_workers=1)
    runner = EpisodeRunner(pool, EnvPool(1, config.env_timeout_s), tokenizer, config)
    try:
        prompts = _prompts("polyrl/guess", [{}] * 8)
        batch = runner.generate(prompts, SamplingSpec(n=4, max_tokens=3, seed=0))
    finally:
        runner.shutdown()
    chat = ChatTokens(tokenizer)
    mask = batch["response_mask"] > 0
    assert (batch["rollout_log_probs"][mask] < 0).all()
    assert (batch["rollout_log_probs"][~mask] == 0).all()
    assert (batch["rollout_token_versions"][mask] == pool.version).all()
    assert (batch["rollout_token_versions"][~mask] == -1).all()
    for row in range(len(batch)):
        messages = list(batch["prompt"][row])
        response = list(batch["responses"][row, : batch["response_lengths"][row]])
        pos = 0
        for turn in batch["turns"][row]:
            sampled = response[pos : pos + turn["tokens"]]
            assert mask[row, pos : pos + turn["tokens"]].all()
            assert turn["text"] == tokenizer.decode(sampled, skip_special_tokens=True)
            pos += turn["tokens"]
            messages.append({"role": "assistant", "content": turn["text"]})
            if "observation" in turn:
                obs, _ = chat.observation(messages, turn["observation"], None, sampled)
                assert response[pos : pos + len(obs)] == obs
                assert not mask[row, pos : pos + len(obs)].any()
                pos += len(obs)
                messages += turn["observation"]
        assert pos == len(response)
    m = batch.info["episode_metrics"]
    assert m["episode/template_drift_share"] == 0.0
    assert m["episode/turns_mean"] > 1


def test_in_flight_is_the_busy_seconds_over_the_play():
    """Hand-computed: three episodes over a play from t=10 to t=20 (the third never
    timed): 8 + 4 s at the servers and 2 s in env steps -> 1.2 and 0.2 in flight."""
    from polyrl.rollout.episodes import Episode, in_flight

    a, b, c = (Episode(i, i, {}) for i in range(3))
    a.seconds, a.span = {"sampling": 8.0, "env": 2.0}, (10.0, 20.0)
    b.seconds, b.span = {"sampling": 4.0}, (12.0, 16.0)
    assert in_flight([a, b, c]) == {
        "episode/play_s": 10.0,
        "episode/sampling_in_flight_mean": 1.2,
        "episode/env_in_flight_mean": 0.2,
    }
    assert in_flight([c]) == {}  # agents' episodes: not timed


@register_env("test/slow_step")
class SlowStep(Env):
    """Two turns, each env step 0.1 s (awaited: the episodes' steps overlap)."""

    async def step(self, turn):
        import asyncio

        await asyncio.sleep(0.1)
        return StepResult([{"role": "user", "content": "+"}], reward=0.0, done=turn.index == 1)


class SlowPolicy(TextPolicy):
    async def generate_on(self, server, requests, spec):
        import asyncio

        await asyncio.sleep(0.2)  # a turn at the server
        return self.generate_ids(requests, spec)


def test_episodes_say_how_many_were_sampling_and_stepping_at_once(tokenizer):
    """4 episodes of 2 turns, each turn 0.2 s at the "server" and 0.1 s in its env step,
    all at once: twice as many in flight at the servers as in env steps, together never
    more than the 4 episodes (and the play at least the 0.6 s one episode takes)."""
    config = EpisodeConfig(max_turns=2, max_episode_tokens=64, env_workers=0)
    runner = EpisodeRunner(SlowPolicy(tokenizer, cut=0.0), EnvPool(0), tokenizer, config)
    try:
        t0 = time.monotonic()
        batch = runner.generate(_prompts("test/slow_step", [{}] * 4), SamplingSpec(n=1))
        wall = time.monotonic() - t0
    finally:
        runner.shutdown()
    m = batch.info["episode_metrics"]
    assert m["episode/play_s"] >= 0.6
    # the generate call's parts outside the play: the resets, the end, the batch
    parts = [m[f"episode/{k}_s"] for k in ("start", "play", "close_out", "finish", "assemble")]
    assert all(p > 0 for p in parts) and sum(parts) <= wall, (parts, wall)
    sampling, env = m["episode/sampling_in_flight_mean"], m["episode/env_in_flight_mean"]
    assert sampling + env <= 4 + 1e-6
    assert sampling / env == pytest.approx(2.0, rel=0.25)
    assert sampling > 1.6  # 4 x 0.4 s over a play of ~0.6 s (2.67); 1.6 at a 1 s play
