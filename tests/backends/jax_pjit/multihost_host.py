"""One host of a 2-process JAX run (tests/backends/jax_pjit/test_multihost.py starts two).

Usage: python multihost_host.py MODEL_DIR OUT.npz CKPT_ONE CKPT_TWO, with the POLYRL_JAX_*
variables of ``polyrl.backends.base`` in the environment. The host joins jax.distributed,
builds the actor engine on a global data=2 mesh (one CPU device per process), feeds its
half of the batch, and writes its forward log-probs, the step metrics and the exported
weights. Then the checkpoint round trip, every part on both hosts: save to CKPT_TWO,
offload, reload, one more step; a fresh engine loads CKPT_ONE (written by one process
driving both devices) and then CKPT_TWO, one more step.
"""

from __future__ import annotations

import os
import sys

import numpy as np


def rl_batch(seed: int = 0, n: int = 8):
    """A rollout-like batch with the columns GRPO's loss reads (ragged prompts/responses)."""
    from polyrl.batch import from_token_lists

    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(3, 58, rng.integers(1, 10))) for _ in range(n)]
    resps = [list(rng.integers(3, 58, rng.integers(1, 13))) for _ in range(n)]
    b = from_token_lists(prompts, resps, pad_id=0)
    shape, mask = b["responses"].shape, b["response_mask"]
    old = (rng.normal(-4.0, 0.3, shape) * mask).astype(np.float32)
    ref = (rng.normal(-4.0, 0.3, shape) * mask).astype(np.float32)
    adv = np.repeat(rng.normal(0, 1, (n, 1)), shape[1], axis=1).astype(np.float32) * mask
    return b.with_columns({"old_log_probs": old, "ref_log_probs": ref, "advantages": adv})


def _loss():
    from polyrl.algos.registry import get_algorithm

    return get_algorithm("grpo").make_actor_loss(entropy_coef=0.01)


def weights(engine, prefix: str = "w/") -> dict[str, np.ndarray]:
    """The engine's exported weights (what a weight sync pushes), as numpy."""
    return {
        f"{prefix}{k}": np.asarray(v)
        for bucket in engine.export_weights(1 << 20)
        for k, v in bucket
    }


def step(engine, batch, prefix: str) -> dict[str, np.ndarray]:
    """One more GRPO step: its loss and the weights after it, under ``prefix``."""
    loss = engine.train_step(batch, _loss(), entropy=True)["loss"]
    return {f"{prefix}loss": np.array(loss), **weights(engine, f"{prefix}w/")}


def run(engine, batch, steps: int = 2) -> dict[str, np.ndarray]:
    """Forward, then ``steps`` GRPO actor steps; what the test compares."""
    out = {"log_probs": engine.forward(batch)["log_probs"]}
    metrics = [engine.train_step(batch, _loss(), entropy=True) for _ in range(steps)]
    out["loss"] = np.array([m["loss"] for m in metrics])
    out["grad_norm"] = np.array([m["grad_norm"] for m in metrics])
    out.update(weights(engine))
    return out


def main(model_dir: str, out_path: str, ckpt_one: str, ckpt_two: str) -> None:
    from polyrl.backends.jax_pjit.engine import JaxPjitEngine
    from polyrl.config import ModelConfig, OptimConfig, ParallelConfig

    rank = int(os.environ["POLYRL_JAX_PROCESS_ID"])

    def engine():
        e = JaxPjitEngine()
        optim = OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=0.5)
        e.init(ModelConfig(model_dir), optim, ParallelConfig(mesh={"data": 2}, micro_batch_size=2))
        return e

    shard = rl_batch().split(2)[rank]
    first = engine()
    out = run(first, shard)
    first.save(ckpt_two)
    first.offload()
    first.reload()
    out.update(step(first, shard, "reloaded/"))
    fresh = engine()
    fresh.load(ckpt_one)
    out["from_one/step"] = np.array(fresh.step)
    out.update(weights(fresh, "from_one/w/"))
    out.update(step(fresh, shard, "from_one/next/"))
    fresh.load(ckpt_two)
    out.update(weights(fresh, "loaded/w/"))
    out.update(step(fresh, shard, "resumed/"))
    np.savez(out_path, **out)


if __name__ == "__main__":
    main(*sys.argv[1:5])
