"""Independent references for the rollout tests (transformers, not vLLM).

``hf_log_probs`` is the trainer's formula, ``log_softmax(logits / T)`` over the first
``vocab`` logits (the mask documented in polyrl.rollout.sampling), gathered at
``responses[:, t]`` from position ``P - 1 + t``; ``hf_greedy`` decodes one token at a
time with an argmax over the same ids.

LOGPROB_ATOL: both sides are fp32, but vLLM-CPU runs oneDNN GEMMs and its own paged
attention while transformers runs torch matmul + SDPA. Seen here: max |diff| 4.8e-7 at
T = 0.7, 1.0, 1.3; 1e-5 leaves 20x room for other CPUs' kernels while a missing vocab
mask (0.10) or a wrong temperature (>= 0.3) is caught by four orders of magnitude.
"""

from __future__ import annotations

import numpy as np
import torch

from polyrl.batch import Batch
from polyrl.weight_sync import iter_buckets

LOGPROB_ATOL = 1e-5  # see module docstring


def load_hf(model_dir, seed: int | None = None):
    """The tiny model from disk, or (seed given) a fresh random model of its config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if seed is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    config = AutoConfig.from_pretrained(model_dir)
    config.initializer_range = 0.1  # far from the checkpoint, so outputs clearly change
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@torch.no_grad()
def hf_log_probs(model, batch: Batch, temperature: float, vocab: int) -> np.ndarray:
    P = batch["prompts"].shape[1]
    logits = model(
        input_ids=torch.from_numpy(batch["input_ids"]).long(),
        attention_mask=torch.from_numpy(batch["attention_mask"]).long(),
        position_ids=torch.from_numpy(batch["position_ids"]).long(),
    ).logits[:, P - 1 : -1, :vocab]
    lp = torch.log_softmax(logits / temperature, dim=-1)
    out = lp.gather(-1, torch.from_numpy(batch["responses"]).long().unsqueeze(-1)).squeeze(-1)
    return (out.numpy() * batch["response_mask"]).astype(np.float32)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_tokens: int, vocab: int, eos: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        nxt = int(model(torch.tensor([ids])).logits[0, -1, :vocab].argmax())
        ids.append(nxt)
        if nxt == eos:
            break
    return ids[len(prompt) :]


def prompts_batch(lengths: list[int], seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    ids = [rng.integers(4, 58, size=n).tolist() for n in lengths]
    return Batch(meta={"prompt_ids": ids}, tensors={"task": np.arange(len(ids))})


def push(pool, model) -> None:
    pool.update_weights(iter_buckets(model.state_dict().items(), bucket_bytes=64 * 1024))
