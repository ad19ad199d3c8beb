"""The default serving dtype: a bf16 server (in this process, no Ray) loads pushed fp32
weights and then samples like transformers with those weights.

Tolerance: the server rounds weights and activations to bf16 (8-bit mantissa), the
reference is fp32; on the 2-layer tiny model with weights of std 0.1 the log-probs
differ by up to 0.04 (seen here), so 0.1. Serving the old weights instead moves them by
more than 1 (asserted), so the check still separates right from wrong weights.
"""

from __future__ import annotations

import numpy as np
import pytest
from rollout_reference import hf_log_probs, load_hf, prompts_batch

from polyrl.batch import from_token_lists
from polyrl.rollout import RolloutConfig, RolloutServer, SamplingSpec
from polyrl.weight_sync import host_payload, iter_buckets

BF16_ATOL = 0.1  # see module docstring


@pytest.fixture(scope="module")
def bf16_server(padded_model_dir):
    server = RolloutServer(
        RolloutConfig(
            model_path=str(padded_model_dir), dtype="bfloat16", max_model_len=256, kv_cache_gib=0.25
        )
    )
    yield server
    server.shutdown()


def test_bf16_server_loads_fp32_buckets(bf16_server, padded_model_dir):
    s = bf16_server
    old, new = load_hf(padded_model_dir), load_hf(padded_model_dir, seed=123)
    s.begin_weight_update()
    for bucket in iter_buckets(new.state_dict().items(), 64 * 1024):
        s.load_bucket(*host_payload(bucket))
    assert s.finish_weight_update(5) == 5 and s.info()["version"] == 5

    prompts = list(prompts_batch([10, 30, 50], seed=3)["prompt_ids"])
    out = s.generate(
        [(i, p) for i, p in enumerate(prompts)],
        SamplingSpec(temperature=1.0, max_tokens=10, seed=1),
        expected_version=5,
    )
    batch = from_token_lists(prompts, [r["token_ids"] for r in out], pad_id=0)
    got = np.zeros(batch["responses"].shape, np.float32)
    for i, r in enumerate(out):
        got[i, : len(r["log_probs"])] = r["log_probs"]
    np.testing.assert_allclose(got, hf_log_probs(new, batch, 1.0, vocab=58), atol=BF16_ATOL, rtol=0)
    assert np.abs(got - hf_log_probs(old, batch, 1.0, vocab=58)).max() > 1.0
