"""save_hf output serves in vLLM: its prompt log-probs equal the engine's log-probs.

Slow (vLLM start-up; ``hf_scoring.vllm_logprobs`` runs it in a subprocess).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from torch_fsdp_helpers import actor, nll_loss, random_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/backends: hf_scoring
from hf_scoring import vllm_logprobs  # noqa: E402

from polyrl.batch import from_token_lists  # noqa: E402

pytest.importorskip("vllm")


@pytest.mark.slow
def test_save_hf_scores_the_same_in_vllm(tiny_model_dir, tmp_path):
    engine = actor(tiny_model_dir, lr=1e-2)
    engine.train_step(random_batch(8), nll_loss)  # exported weights differ from the source
    engine.save_hf(str(tmp_path / "hf"))
    ids = [7, 12, 30, 41, 9, 22, 17, 5, 33, 28]
    expect = engine.forward(from_token_lists([ids[:1]], [ids[1:]], pad_id=0))["log_probs"][0]
    got = vllm_logprobs(tmp_path / "hf", ids)
    # fp32 in both, but vLLM's CPU kernels (attention, fused matmuls) sum in another
    # order: ~1e-6 seen; 1e-4 still catches any wrong weight (errors would be O(0.1)).
    np.testing.assert_allclose(got, expect, atol=1e-4)
