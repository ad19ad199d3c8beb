"""SamplingSpec / RolloutConfig validation and the long-prompt policy, without servers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from polyrl.rollout import RolloutConfig, SamplingSpec, apply_overlong_policy, derive_seed


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("n", 0, r"SamplingSpec.n=0 must be >= 1"),
        ("temperature", -0.1, r"SamplingSpec.temperature=-0.1 must be >= 0 \(0 = greedy\)"),
        ("top_p", 0.0, r"SamplingSpec.top_p=0.0 must be in \(0, 1\]"),
        ("top_k", -2, r"SamplingSpec.top_k=-2 must be >= 0"),
        ("max_tokens", 0, r"SamplingSpec.max_tokens=0 must be >= 1"),
    ],
)
def test_sampling_spec_errors_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingSpec(**{field: value})


def test_vllm_kwargs_seed_per_sample_and_logprobs_of_the_sampled_token():
    spec = SamplingSpec(temperature=0.5, top_k=-1, seed=7, stop_token_ids=[3])
    a, b = spec.vllm_kwargs(0, {"allowed_token_ids": [0, 1]}), spec.vllm_kwargs(1, {})
    assert a["seed"] != b["seed"] and a["seed"] == derive_seed(7, 0)
    assert a["logprobs"] == 0 and a["n"] == 1 and a["top_k"] == 0 and a["stop_token_ids"] == [3]
    assert a["allowed_token_ids"] == [0, 1] and "allowed_token_ids" not in b
    assert "logit_bias" not in b
    assert SamplingSpec(seed=None).vllm_kwargs(3, {})["seed"] is None


@pytest.mark.parametrize(
    "tokenizer, model, form, size",
    [
        # Qwen2.5: 151,665 tokens, 151,936 rows. vLLM 0.26's GPU sampler takes at most 1024
        # allowed ids or 1024 biased ids a request ("Too many allowed token IDs"), and every
        # request's 151,665-long list cost 40-70 ms of host time: the 271 padded ids instead
        (151_665, 151_936, "logit_bias", 271),
        (58, 64, "logit_bias", 6),  # the tiny test model
        (58, 151_936, "allowed_token_ids", 58),  # the GPU benches' tokenizer on a 0.5B shape
        (100, 200, "logit_bias", 100),  # a tie: either is as short
    ],
)
def test_the_vocabulary_mask_sends_the_shorter_list(tokenizer, model, form, size):
    from polyrl.rollout.server import vocab_mask

    config = RolloutConfig(model_path="unused")
    mask = vocab_mask(tokenizer, model, config)
    assert list(mask) == [form] and len(mask[form]) == size
    if form == "logit_bias":  # the ids the tokenizer lacks, pushed down as far as vLLM lets
        assert sorted(mask[form]) == list(range(tokenizer, model))
        assert set(mask[form].values()) == {-100.0}
    else:
        assert mask[form] == list(range(tokenizer))
    unrestricted = dataclasses.replace(config, restrict_to_tokenizer=False)
    assert vocab_mask(tokenizer, model, unrestricted) == {}
    assert vocab_mask(model, model, config) == {}


def test_vllm_requests_are_one_seeded_sample_each():
    """What the servers hand vLLM (and the rollout bench's direct engine, like for like)."""
    from polyrl.rollout.server import vllm_requests

    spec = SamplingSpec(n=2, seed=7, max_tokens=5, detokenize=False)
    prompts, params = vllm_requests(
        [(4, [1, 2]), (5, [1, 2])], spec, {"allowed_token_ids": [0, 1, 2]}
    )
    assert prompts == [{"prompt_token_ids": [1, 2]}] * 2
    assert [p.n for p in params] == [1, 1] and [p.max_tokens for p in params] == [5, 5]
    # the seed is the sample's index mixed with the spec's: 7 * 1_000_003 + index
    assert [p.seed for p in params] == [7_000_025, 7_000_026]
    assert all(p.allowed_token_ids == [0, 1, 2] and p.logprobs == 0 for p in params)
    # vLLM copies a request's params before it samples: a shallow copy, not the allowed
    # ids again per request (151k of them with a real Qwen vocabulary: 40 ms a request)
    assert all(p.clone().allowed_token_ids is p.allowed_token_ids for p in params)


def test_rollout_config_errors_name_the_field():
    with pytest.raises(
        ValueError,
        match=r"overlong_prompt='cut' is not one of \['error', 'truncate_left', 'drop'\]",
    ):
        RolloutConfig(model_path="m", overlong_prompt="cut")
    with pytest.raises(
        ValueError,
        match=r"max_prompt_len=300 must be in \[1, max_model_len=256\); raise max_model_len",
    ):
        RolloutConfig(model_path="m", max_model_len=256, max_prompt_len=300)
    assert RolloutConfig(model_path="m", max_model_len=256).prompt_limit == 255


def test_engines_get_explicit_scheduler_limits():
    """Both engines get both limits from polyrl (vLLM's AsyncLLM would take its engine
    defaults, 128 / 2048): the config's where set, else vllm.LLM's on this device (CPU
    here: 256 sequences, 4096 tokens, a budget of at least one whole sequence)."""
    from polyrl.rollout.server import engine_kwargs

    def limits(**changes):
        kwargs = engine_kwargs(dataclasses.replace(base, **changes), on_gpu=False)
        return kwargs["max_num_seqs"], kwargs["max_num_batched_tokens"]

    base = RolloutConfig(model_path="m", max_model_len=256)
    assert limits() == (256, 4096)
    assert limits(max_model_len=6000) == (256, 6000)
    assert limits(max_num_seqs=3, max_num_batched_tokens=300) == (3, 300)
    with pytest.raises(
        ValueError,
        match=r"RolloutConfig.max_num_batched_tokens=200 is below RolloutConfig.max_model_len=256",
    ):
        limits(max_num_batched_tokens=200)
    with pytest.raises(ValueError, match=r"RolloutConfig.max_num_seqs=0 must be >= 1"):
        RolloutConfig(model_path="m", max_num_seqs=0)


def test_the_kv_cache_size_on_gpus_is_fixed_only_where_given():
    """RolloutConfig.gpu_kv_cache_gib reaches vLLM as kv_cache_memory_bytes on GPUs (no
    memory profile then); unset, vLLM profiles (no kv_cache_memory_bytes); on CPU the
    CPU size (kv_cache_gib) applies either way. 12 GiB = 12 x 2^30 bytes."""
    from polyrl.rollout.server import engine_kwargs

    base = RolloutConfig(model_path="m", max_model_len=256, kv_cache_gib=0.25)
    fixed = dataclasses.replace(base, gpu_kv_cache_gib=12.0)
    assert engine_kwargs(fixed, on_gpu=True)["kv_cache_memory_bytes"] == 12 * 1024**3
    assert "kv_cache_memory_bytes" not in engine_kwargs(base, on_gpu=True)
    for config in (base, fixed):
        assert engine_kwargs(config, on_gpu=False)["kv_cache_memory_bytes"] == 1024**3 // 4
    with pytest.raises(ValueError, match=r"RolloutConfig.gpu_kv_cache_gib=0 must be > 0"):
        RolloutConfig(model_path="m", gpu_kv_cache_gib=0)


def test_overlong_policy():
    prompts = [[1, 2], [1, 2, 3, 4, 5], [9]]
    with pytest.raises(ValueError, match=r"sample 1 has 5 tokens, more than max_prompt_len=3"):
        apply_overlong_policy(prompts, 3, "error")
    assert apply_overlong_policy(prompts, 3, "truncate_left") == (
        [0, 1, 2],
        [[1, 2], [3, 4, 5], [9]],
    )
    assert apply_overlong_policy(prompts, 3, "drop") == ([0, 2], [[1, 2], [9]])
    with pytest.raises(ValueError, match=r"prompt_ids of sample\(s\) \[1\] are empty"):
        apply_overlong_policy([[1], []], 3, "drop")


def test_sampled_log_probs_read_the_first_entry_of_each_position():
    from vllm.logprobs import FlatLogprobs

    from polyrl.rollout.server import sampled_log_probs

    flat = FlatLogprobs()
    # position 0 sampled 7 (and 3 was the top-1 too), position 1 sampled 5 alone
    flat.append_fast([7, 3], [-0.5, -0.25], iter([2, 1]), [None, None])
    flat.append_fast([5], [-1.5], iter([1]), [None])
    np.testing.assert_array_equal(sampled_log_probs(flat, [7, 5]), np.float32([-0.5, -1.5]))
    assert sampled_log_probs(FlatLogprobs(), []).shape == (0,)
    with pytest.raises(RuntimeError, match="do not start with the sampled tokens"):
        sampled_log_probs(flat, [3, 5])
    # One entry per position (logprobs=0, as the servers ask): the sampled tokens' own.
    single = FlatLogprobs()
    for token, value in ((4, -0.75), (9, -2.0), (4, -0.125)):
        single.append_fast([token], [value], iter([1]), [None])
    np.testing.assert_array_equal(
        sampled_log_probs(single, np.int32([4, 9, 4])), np.float32([-0.75, -2.0, -0.125])
    )
    with pytest.raises(RuntimeError, match="do not start with the sampled tokens"):
        sampled_log_probs(single, [4, 4, 4])
