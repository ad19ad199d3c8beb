"""Chunked LM head (lm_head.ChunkedLMHead): log-probs, entropy and gradients equal those
of the full [B, R, V] logits computed by plain transformers, for any chunk size."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch_fsdp_helpers import random_batch

from polyrl.backends.torch_fsdp import lm_head, models
from polyrl.backends.torch_fsdp.engine import MODEL_COLUMNS
from polyrl.config import ModelConfig

# fp32 on CPU: the two computations differ only in matmul shapes / summation order
# (~1e-7 observed); 1e-5 leaves headroom, far below any real difference (~1e-2).
ATOL = 1e-5


def _inputs(batch) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.array(batch[k])) for k in MODEL_COLUMNS}


def _reference(model, inputs, temperature, vocab):
    """Full logits of the unpatched model -> log-probs and entropy, the textbook way."""
    R = inputs["responses"].shape[1]
    logits = model(
        input_ids=inputs["input_ids"],
        attention_mask=inputs["attention_mask"],
        position_ids=inputs["position_ids"],
    ).logits[:, -R - 1 : -1, :vocab]
    logp = torch.log_softmax(logits.float() / temperature, -1)
    lp = logp.gather(-1, inputs["responses"].long()[..., None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    keep = inputs["response_mask"] > 0
    return torch.where(keep, lp, 0.0), torch.where(keep, ent, 0.0)


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_chunked_equals_full_logits_with_gradients(tiny_model_dir, chunk):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = ModelConfig(str(tiny_model_dir), sampling_vocab_size=58)
    chunked = models.load_model(cfg, torch.float32, logits_chunk_tokens=chunk).module
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert isinstance(chunked.get_output_embeddings(), lm_head.ChunkedLMHead)
    # the tie to the embedding survives the swap
    assert chunked.lm_head.weight is chunked.model.embed_tokens.weight
    inputs = _inputs(random_batch(6, seed=3))
    temperature = 0.7
    out = models.policy_outputs(chunked, inputs, temperature, True, vocab=58)
    lp, ent = _reference(plain, inputs, temperature, 58)
    torch.testing.assert_close(out["log_probs"], lp, atol=ATOL, rtol=0)
    torch.testing.assert_close(out["entropy"], ent, atol=ATOL, rtol=0)
    # a loss touching both outputs: gradients agree for every parameter
    mask = inputs["response_mask"].float()
    ((out["log_probs"] - 0.1 * out["entropy"]) * mask).sum().backward()
    ((lp - 0.1 * ent) * mask).sum().backward()
    grads = dict(plain.named_parameters())
    for name, param in chunked.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, atol=ATOL, rtol=1e-4)


def test_outside_scoring_it_is_the_plain_head(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    chunked = models.load_model(ModelConfig(str(tiny_model_dir)), torch.float32, 2).module
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.tensor([[5, 9, 11, 20]])
    with torch.no_grad():
        torch.testing.assert_close(chunked(ids).logits, plain(ids).logits)
