"""Scoring a Hugging Face directory outside polyrl's engines: vLLM (CPU build, in a
subprocess so its torch.distributed set-up never meets an engine's process group in the
test process) and transformers. Shared by the export tests of both backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

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


def vllm_logprobs(path, ids: list[int]) -> np.ndarray:
    """vLLM's log-prob of each of ``ids[1:]`` given the tokens before it."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _VLLM_SCRIPT, str(path), json.dumps(ids)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return np.asarray(json.loads(lines[0].removeprefix("RESULT "))[1:])  # first: no log-prob


def transformers_logprobs(path, ids: list[int]) -> np.ndarray:
    """transformers' (fp32, eager) log-prob of each of ``ids[1:]``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    x = torch.as_tensor([ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=x).logits[0, :-1].float(), -1)
    return logp.gather(-1, x[0, 1:, None])[:, 0].numpy()
