"""save_hf output serves in vLLM: its prompt log-probs equal the engine's log-probs.

Slow (vLLM start-up); vLLM runs in a subprocess so its own torch.distributed set-up never
meets the engine's process group in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from torch_fsdp_helpers import actor, nll_loss, random_batch

from polyrl.batch import from_token_lists

pytest.importorskip("vllm")

_VLLM_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams
path, ids = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model=path, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 28,
          max_model_len=128)
out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))
print("RESULT", json.dumps([None if d is None else d[t].logprob
                            for d, t in zip(out[0].prompt_logprobs, ids)]))
"""


@pytest.mark.slow
def test_save_hf_scores_the_same_in_vllm(tiny_model_dir, tmp_path):
    engine = actor(tiny_model_dir, lr=1e-2)
    engine.train_step(random_batch(8), nll_loss)  # exported weights differ from the source
    engine.save_hf(str(tmp_path / "hf"))
    ids = [7, 12, 30, 41, 9, 22, 17, 5, 33, 28]
    expect = engine.forward(from_token_lists([ids[:1]], [ids[1:]], pad_id=0))["log_probs"][0]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _VLLM_SCRIPT, str(tmp_path / "hf"), json.dumps(ids)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[0].removeprefix("RESULT "))[1:]  # first token has no log-prob
    # fp32 in both, but vLLM's CPU kernels (attention, fused matmuls) sum in another
    # order: ~1e-6 seen; 1e-4 still catches any wrong weight (errors would be O(0.1)).
    np.testing.assert_allclose(got, expect, atol=1e-4)
