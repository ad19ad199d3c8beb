"""The Tinker service's training call on tinker-cookbook's guess_number rows, in the
process (docs/performance.md "JAX's training call on tinker-cookbook's guess_number"): the
engine's ``forward_backward`` + ``optim_step`` as the service's worker runs them (a new
``importance_sampling`` loss object a call, LoRA on every projection, micro-batches of
``--mbs`` rows) on datums shaped like one step of the recipe: ``--episodes`` episodes of
``--turns`` turns, one datum a turn, each a 1-token prompt (the service's layout) and a
response of ~120 tokens more a turn (~26,000 tokens at the defaults), new lengths every
call. ``--shapes`` also times ``--mbs`` rows of each of a few fixed lengths. Not a test;
numbers go to stdout and ``--json``.

    python experiments/bench/tinker_train_call.py --backend torch_fsdp
    python experiments/bench/tinker_train_call.py --backend jax_pjit --shapes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="jax_pjit", choices=("torch_fsdp", "jax_pjit"))
    p.add_argument("--calls", type=int, default=4, help="training calls (the first compiles)")
    p.add_argument("--episodes", type=int, default=4)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--mbs", type=int, default=4, help="ParallelConfig.micro_batch_size")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank (the recipe's default)")
    p.add_argument("--shapes", action="store_true", help="also --mbs rows of fixed lengths")
    p.add_argument("--model-dir", default="runs/bench_models", help="where the tiny model goes")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()

    import numpy as np

    from polyrl.algos.tinker_losses import tinker_loss
    from polyrl.backends.base import engine_on_one_device
    from polyrl.batch import from_token_lists
    from polyrl.config import LoraConfig, ModelConfig, OptimConfig, ParallelConfig
    from polyrl.data.tiny import TinyModelSpec, ensure_tiny_model

    if args.backend == "torch_fsdp":
        import torch

        torch.set_num_threads(1)  # as in the service's worker (a half-CPU Ray actor)
    # gin/experiments/tinker_cookbook.gin's model
    spec = TinyModelSpec(max_position_embeddings=2048, initializer_range=0.1)
    path = ensure_tiny_model(args.model_dir, spec)
    modules = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    lora = LoraConfig(rank=args.rank, alpha=32, target_modules=modules)
    optim = OptimConfig(lr=1e-4, betas=(0.9, 0.95), eps=1e-12, grad_clip=None)
    engine = engine_on_one_device(args.backend)
    engine.init(
        ModelConfig(str(path), role="actor", lora=lora),
        optim,
        ParallelConfig(micro_batch_size=args.mbs),
    )
    rng = np.random.default_rng(0)

    def batch(lengths: list[int]):
        rows = [rng.integers(3, 50, n + 1).tolist() for n in lengths]
        b = from_token_lists([r[:1] for r in rows], [r[1:] for r in rows], pad_id=0)
        mask = b["response_mask"].astype(np.float32)
        advantages = rng.normal(0, 1, (len(rows), 1)) * mask
        return b.with_columns(
            {"sampling_logprobs": -4.0 * mask, "advantages": advantages.astype(np.float32)}
        )

    def call(b) -> float:
        t0 = time.perf_counter()
        engine.forward_backward(b, tinker_loss("importance_sampling"))
        engine.optim_step(optim)
        return time.perf_counter() - t0

    calls = []
    for i in range(args.calls):
        lengths = [
            100 + 120 * t + int(rng.integers(0, 40))
            for _ in range(args.episodes)
            for t in range(args.turns)
        ]
        calls.append(call(batch(lengths)))
        print(
            f"{args.backend} call {i}: {len(lengths)} datums, {sum(lengths)} tokens: "
            f"{calls[-1]:.2f} s (compilations so far: {getattr(engine, 'compile_count', '-')})",
            flush=True,
        )
    out = {"calls_s": calls, "median_after_first_s": statistics.median(calls[1:] or calls)}
    print(f"{args.backend}: median after the first call {out['median_after_first_s']:.2f} s")
    if args.shapes:
        out["shapes_s"] = {}
        for n in (1020, 1200, 1536, 2040):
            b = batch([n] * args.mbs)
            call(b)  # compiles on JAX
            out["shapes_s"][n] = min(call(b) for _ in range(2))
            print(f"{args.backend} {args.mbs} x {n} tokens: {out['shapes_s'][n]:.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **out}, f, indent=1)


if __name__ == "__main__":
    main()
