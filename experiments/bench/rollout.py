"""Benchmark: rollout inside polyrl (``RolloutPool.generate``) against vLLM alone
(``vllm.LLM.generate``) on the same requests (one seeded sample per request, the same
allowed token ids, as the servers build them): generated tokens/s of each and their
ratios. vLLM alone is measured three ways: inside each pool call (the server's
``generate.vllm`` span: the pool's tokens/s over its own engine's in the same call), on
the server's own engine called directly in its process (one server), and in a Ray actor
of its own with the same engine arguments and resources. Two processes running the same
vLLM call can differ by more than the goal's 3% on a shared host; the per-call CPU
seconds, involuntary context switches and CPUs printed for each side show it.

The comparison itself is ``weight_sync.bench_rollout`` (one implementation for both
benchmarks); this script sets the engine up like a training run's rollout (model, dtype,
``max_model_len``, ``gpu_memory_utilization``) and prints a table. The defaults are the
shipped GPU experiment's rollout (gin/experiments/gpu_grpo_0p5b.gin: 64 prompts x n=8 x
512 new tokens, 0.35 of the GPU); on CPU pass small numbers:

    python experiments/bench/rollout.py --prompts 8 --n 2 --prompt-len 16 --new-tokens 16 \\
        --dtype float32 --max-model-len 64
    python experiments/bench/rollout.py --model /tmp/models/qwen2-0.5b-random --json r.json
    # with text, as a training run's rollout: the pool decodes each response once, the
    # direct engine lets vLLM detokenize every token in its loop
    python experiments/bench/rollout.py --model /tmp/models/qwen2-0.5b-random --detokenize
    # vLLM's engine core in its own process (RolloutConfig.in_process_engine=False), both sides
    python experiments/bench/rollout.py --model /tmp/models/qwen2-0.5b-random --in-process-engine 0

``--profile DIR`` adds a torch.profiler trace of one more call of each (64 new tokens at
most, so the trace stays a few MB), taken inside the rollout server and inside the direct
engine's actor (``profiling.profile_actors``; with the in-process engine that is where
vLLM runs), and prints their top ops.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profiling import format_top  # noqa: E402
from weight_sync import bench_rollout  # noqa: E402

# Issue 11: rollout inside polyrl at least this fraction of vLLM alone's tokens/s.
GOAL = 0.97


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF model directory (default: the tiny model)")
    p.add_argument("--work", default="runs/bench_rollout")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    p.add_argument(
        "--repeats",
        type=int,
        default=4,
        help="timed calls of each side, interleaved; the medians are compared (single calls "
        "moved by up to 40%% from one to the next on a lent H200's busy host)",
    )
    p.add_argument(
        "--detokenize",
        action="store_true",
        help="return text too, as a training run's rollout does (the pool decodes each "
        "response once; the direct engine lets vLLM detokenize token by token)",
    )
    p.add_argument(
        "--in-process-engine",
        type=int,
        choices=(0, 1),
        default=1,
        help="RolloutConfig.in_process_engine of the servers and of the direct engine",
    )
    p.add_argument(
        "--engine",
        choices=("sync", "async"),
        default="sync",
        help="RolloutConfig.engine of the servers (runs take async unless they bind sync)",
    )
    p.add_argument("--num-cpus", type=int, default=os.cpu_count())
    p.add_argument("--json", help="write the result here")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="torch.profiler traces of one more call of each, inside the server / engine actor",
    )
    args = p.parse_args(argv)

    import ray
    import torch

    from polyrl.data.tiny import ensure_tiny_model
    from polyrl.rollout import RolloutConfig, RolloutPool

    model = args.model or str(ensure_tiny_model(Path(args.work) / "tiny"))
    on_gpu = torch.cuda.is_available()
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    pool = RolloutPool(
        RolloutConfig(
            model_path=model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization,
            in_process_engine=bool(args.in_process_engine),
            engine=args.engine,
            num_gpus=0.5 if on_gpu else None,  # the direct engine takes the other half
        )
    )
    try:
        result = {
            "model": model,
            "dtype": args.dtype,
            **bench_rollout(pool, args, args.profile, args.detokenize),
        }
    finally:
        pool.shutdown()
        ray.shutdown()
    result["goal_ratio"] = GOAL
    labels = {
        "pool": "polyrl RolloutPool",
        "engine": "vLLM alone, server's engine",
        "direct": "vLLM alone, own actor",
    }
    lines = [f"{'rollout':<30} {'tokens/s':>10} {'pool / it':>10}  goal"]
    for side, label in labels.items():
        if f"{side}_tok_s" not in result:
            continue
        row = f"{label:<30} {result[f'{side}_tok_s']:>10.0f}"
        if side != "pool":
            ratio = result[f"ratio_pool_to_{side}"]
            result[f"meets_goal_{side}"] = ratio >= GOAL
            row += f" {ratio:>10.3f}  >= {GOAL}: {'met' if ratio >= GOAL else 'MISSED'}"
        lines.append(row)
    share = result["pool_to_its_vllm_median"]
    result["meets_goal_in_call"] = share >= GOAL
    lines.append(
        f"{'vLLM inside the pool calls':<30} {result['pool_tok_s'] / share:>10.0f} "
        f"{share:>10.3f}  >= {GOAL}: {'met' if share >= GOAL else 'MISSED'}"
    )
    lines.append("  calls, tokens/s (rounds in order, each side first in turn):")
    lines += [
        f"    {side:<7} " + ", ".join(f"{t:.0f}" for t in calls)
        for side, calls in result["calls_tok_s"].items()
    ]
    lines += [
        f"  round by round, pool / {side}: "
        + ", ".join(f"{r:.3f}" for r in result[f"paired_ratios_{side}"])
        + f" (median {result[f'paired_ratio_median_{side}']:.3f})"
        for side in ("engine", "direct")
        if f"paired_ratios_{side}" in result
    ]
    lines.append(
        "  pool calls, vLLM's share of each: "
        + ", ".join(f"{r:.3f}" for r in result["pool_to_its_vllm"])
    )
    lines.append(
        "  scheduler limits (max_num_seqs, max_num_batched_tokens): "
        + "; ".join(
            f"{side} {lim['max_num_seqs']}, {lim['max_num_batched_tokens']}"
            for side, lim in result["rollout_limits"].items()
        )
    )
    lines.append("  per call, the generating process (median): CPU s, involuntary switches; CPUs")
    for side, calls in result["process"].items():
        cpu_s = statistics.median(c["cpu_s"] for c in calls)
        switches = statistics.median(c["nivcsw"] for c in calls)
        cpus = sorted({c["cpu"] for c in calls})
        lines.append(
            f"    {side:<7} {cpu_s:.2f} s, {switches:.0f}; on CPUs {cpus}, "
            f"{calls[-1]['threads']} threads"
        )
    for key, label in (
        ("profile_pool", "RolloutPool (server)"),
        ("profile_direct", "vLLM directly"),
    ):
        if key in result:
            lines += format_top(result[key], f"{label}: top ops")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({**result, "table": lines}, indent=1))


if __name__ == "__main__":
    main()
