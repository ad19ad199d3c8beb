"""Buckets from the two training backends' ``export_weights`` reach the rollout servers:
after pushing unrelated random weights and then an engine's export of the checkpoint,
the servers' log-probs equal transformers' on the checkpoint (same tolerance and
reference as test_pool.py)."""

from __future__ import annotations

import numpy as np
import pytest
from rollout_reference import LOGPROB_ATOL, hf_log_probs, load_hf, prompts_batch, push

from polyrl.config import ModelConfig, ParallelConfig
from polyrl.rollout import SamplingSpec


def _engine(name: str):
    from polyrl.backends.base import get_engine

    return get_engine(name)


@pytest.mark.parametrize(
    "backend, mesh",
    [
        ("torch_fsdp", {"data": 1, "fsdp": 1, "tensor": 1}),
        ("jax_pjit", {"data": 1, "fsdp": 4, "tensor": 1}),  # params sharded over 4 host devices
    ],
)
def test_engine_export_reaches_servers(pool, padded_model_dir, backend, mesh):
    engine = _engine(backend)()
    engine.init(
        ModelConfig(path=str(padded_model_dir), role="reference"), None, ParallelConfig(mesh=mesh)
    )
    push(pool, load_hf(padded_model_dir, seed=31))  # something else first
    stats = pool.update_weights(engine.export_weights(bucket_bytes=96 * 1024))
    assert stats.buckets > 1 and stats.tensors >= 2 * 12 + 2  # 2 layers x 12 + embed + norm

    out = pool.generate(
        prompts_batch([7, 40], seed=9), SamplingSpec(n=2, temperature=0.8, max_tokens=8, seed=1)
    )
    ref = hf_log_probs(load_hf(padded_model_dir), out, temperature=0.8, vocab=58)
    np.testing.assert_allclose(out["rollout_log_probs"], ref, atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["torch_fsdp", "jax_pjit"])
def test_trainer_log_probs_equal_rollout_log_probs(pool, padded_model_dir, backend):
    """On-policy means the trainer scores the sampled tokens exactly as the sampler drew
    them: with ModelConfig.sampling_vocab_size = the pool's, an engine's forward equals
    rollout_log_probs; over the whole padded embedding it does not."""
    engine_cls = _engine(backend)
    # The JAX engine's mesh spans the process's 4 host devices.
    par = ParallelConfig(mesh={"fsdp": 4 if backend == "jax_pjit" else 1})
    pool.update_weights(engine_cls_export(engine_cls, padded_model_dir, par))
    out = pool.generate(
        prompts_batch([5, 33, 61], seed=4), SamplingSpec(n=2, temperature=0.7, max_tokens=8, seed=3)
    )
    masked = engine_cls()
    masked.init(
        ModelConfig(
            path=str(padded_model_dir),
            role="reference",
            sampling_vocab_size=pool.sampling_vocab_size,
        ),
        None,
        par,
    )
    ours = masked.forward(out, temperature=0.7)["log_probs"]
    np.testing.assert_allclose(ours, out["rollout_log_probs"], atol=LOGPROB_ATOL, rtol=0)
    full = engine_cls()
    full.init(ModelConfig(path=str(padded_model_dir), role="reference"), None, par)
    gap = np.abs(full.forward(out, temperature=0.7)["log_probs"] - out["rollout_log_probs"]).max()
    assert gap > 10 * LOGPROB_ATOL, "the padded rows carry probability, so the mask must matter"


def engine_cls_export(engine_cls, path, par):
    engine = engine_cls()
    engine.init(ModelConfig(path=str(path), role="reference"), None, par)
    return list(engine.export_weights(bucket_bytes=1 << 20))
