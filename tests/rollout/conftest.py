"""One Ray session and one two-server rollout pool per test module.

Module scope, not session: a session-wide pool would keep holding Ray CPUs while later
test directories (tests/trainer) start their own workers.

The pool serves a tiny Qwen2 whose embedding is padded past its tokenizer (64 rows,
58 tokens), the case where the servers must restrict sampling to the tokenizer's ids
and the trainer must apply the same vocabulary mask.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def padded_model_dir(tmp_path_factory):
    from polyrl.data.tiny import TinyModelSpec, ensure_tiny_model

    return ensure_tiny_model(
        tmp_path_factory.mktemp("tiny_padded"), TinyModelSpec(vocab_multiple=16)
    )


@pytest.fixture(scope="module")
def pool(ray_session, padded_model_dir):
    from polyrl.rollout import RolloutConfig, RolloutPool

    config = RolloutConfig(
        model_path=str(padded_model_dir),
        num_servers=2,
        dtype="float32",
        max_model_len=256,
        max_prompt_len=160,
        kv_cache_gib=0.25,
        ready_timeout_s=180,
        request_timeout_s=180,
    )
    p = RolloutPool(config)
    yield p
    p.shutdown()
