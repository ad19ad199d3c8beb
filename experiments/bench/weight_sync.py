"""Benchmark: trainer -> rollout weight sync, and rollout throughput through the pool.

Prints a table of the syncs (time as a multiple of a plain copy of the same bytes: "x
copy"), then one JSON object (and writes it to --out):

* ``sync``: per transport and per source backend (torch tensors / jax arrays) the bytes,
  median seconds over --repeats pushes and GB/s of ``RolloutPool.update_weights``, next
  to a plain memcpy of the same tensors in this process (``memcpy_gbps``) and the ratio.
* ``rollout``: generated tokens/s through ``RolloutPool.generate`` and through a bare
  ``vllm.LLM`` with the same engine arguments (in a Ray actor with the same resources
  as a server), on the same prompts, and the ratio.

The model is a random Qwen2 of the requested shape (tiny tokenizer, fp32) built under
--work. On CPU only the object-store transport exists; on a GPU host add
``--transports object_store,cuda_ipc`` (colocated) or ``nccl`` (needs 2 GPUs: the
servers on one, this process - the trainer's rank 0 - and its tensors on the other; on
CPU ``nccl`` runs the same broadcast group over gloo).

    python experiments/bench/weight_sync.py --hidden 512 --layers 8 --out runs/bench_sync.json
    python experiments/bench/weight_sync.py --transports object_store,cuda_ipc --profile prof/

``--profile DIR`` traces one more push of each row with torch.profiler (jax.profiler for
the jax source) and prints its top ops (profiling.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from profiling import format_top


def build_model(work: Path, hidden: int, layers: int) -> Path:
    from polyrl.data.tiny import TinyModelSpec, ensure_tiny_model

    spec = TinyModelSpec(
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 32 * 32,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=max(1, hidden // 64),
    )
    return ensure_tiny_model(work, spec)


def state_dicts(model_dir: Path, device: str):
    """The model's weights as torch tensors on ``device`` and as jax arrays (same values)."""
    import jax.numpy as jnp
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sd = {k: v.detach().to(device).contiguous() for k, v in model.state_dict().items()}
    return {"torch": sd, "jax": {k: jnp.asarray(v.cpu().numpy()) for k, v in sd.items()}}


def memcpy_gbps(tensors: dict, repeats: int) -> float:
    """GB/s of copying every tensor once into preallocated memory (the floor to beat).

    Host tensors are copied with numpy (one thread, no OpenMP: on a loaded host torch's
    parallel copy of MB-sized tensors waits on its thread barrier and measures the load,
    not the memory); device tensors with ``copy_``.
    """
    import numpy as np
    import torch

    from polyrl.weight_sync import to_torch

    src = [to_torch(t) for t in tensors.values()]
    on_device = src[0].is_cuda
    if not on_device:
        src = [t.contiguous().reshape(-1).view(torch.uint8).numpy() for t in src]
    dst = [torch.empty_like(t) if on_device else np.empty_like(t) for t in src]
    copy = (lambda d, s: d.copy_(s)) if on_device else np.copyto
    times = []
    for _ in range(repeats + 1):  # the first pass faults the destination pages in
        start = time.perf_counter()
        for d, s in zip(dst, src):
            copy(d, s)
        if on_device:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sum(t.nbytes for t in src) / statistics.median(times[1:]) / 1e9


def bench_sync(
    pool,
    sources: dict,
    transports: list[str],
    bucket_bytes: int,
    repeats: int,
    profile: str | None = None,
) -> list:
    """One row per transport and source; ``profile``: a directory to trace one more push
    of each into (this process's side of it: bucketing, copies, IPC handles, sends)."""
    from profiling import profile_call

    from polyrl.weight_sync import iter_buckets

    rows = []
    for transport in transports:
        for backend, sd in sources.items():
            if transport != "object_store" and backend == "jax":
                continue  # the jax arrays here are host arrays; GPU transports need device ones
            runs = [
                pool.update_weights(iter_buckets(sd.items(), bucket_bytes), transport)
                for _ in range(repeats)
            ]
            seconds = statistics.median(r.seconds for r in runs)
            copy = memcpy_gbps(sd, repeats)
            gbps = runs[0].bytes / seconds / 1e9
            rows.append(
                {
                    "transport": transport,
                    "source": backend,
                    "bytes": runs[0].bytes,
                    "buckets": runs[0].buckets,
                    "seconds": seconds,
                    "gbps": gbps,
                    "memcpy_gbps": copy,
                    "ratio_to_memcpy": gbps / copy,
                }
            )
            if profile:
                rows[-1]["profile"] = profile_call(
                    "jax" if backend == "jax" else "torch",
                    profile,
                    f"sync_{transport}_{backend}",
                    lambda sd=sd, t=transport: pool.update_weights(
                        iter_buckets(sd.items(), bucket_bytes), t
                    ),
                )
    return rows


class DirectEngine:
    """``vllm.LLM`` with the pool's engine arguments, in a Ray actor with the same
    resources and environment as a rollout server, so the comparison is like for like."""

    def __init__(self, config, on_gpu: bool) -> None:
        from vllm import LLM

        from polyrl.rollout.server import engine_kwargs

        self.llm = LLM(**engine_kwargs(config, on_gpu))

    def timed_generate(self, prompts: list, spec) -> tuple[int, float]:
        from vllm import SamplingParams

        params = SamplingParams(
            n=spec.n,
            temperature=spec.temperature,
            max_tokens=spec.max_tokens,
            seed=spec.seed,
            ignore_eos=True,
            logprobs=0,
            detokenize=False,
        )
        start = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs), time.perf_counter() - start


def bench_rollout(pool, args) -> dict:
    """Generated tokens/s (median of --repeats): pool.generate vs vllm.LLM.generate."""
    import numpy as np
    import ray

    from polyrl.batch import Batch
    from polyrl.rollout import SamplingSpec
    from polyrl.rollout.server import server_env

    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 58, size=args.prompt_len).tolist() for _ in range(args.prompts)]
    spec = SamplingSpec(
        n=args.n,
        temperature=1.0,
        max_tokens=args.new_tokens,
        seed=0,
        ignore_eos=True,
        detokenize=False,
    )
    batch = Batch(meta={"prompt_ids": prompts})

    def through_pool() -> tuple[int, float]:
        start = time.perf_counter()
        out = pool.generate(batch, spec)
        return int(out["response_lengths"].sum()), time.perf_counter() - start

    res = pool._resources()
    direct = (
        ray.remote(DirectEngine)
        .options(
            num_cpus=res["num_cpus"],
            num_gpus=res["num_gpus"],
            runtime_env={"env_vars": server_env(pool.config)},
        )
        .remote(pool.config, _on_gpu())
    )
    ray.get(direct.timed_generate.remote(prompts[:2], spec))  # start-up + warm-up
    through_pool()  # warm-up
    rows = {"pool": [], "direct": []}
    for _ in range(args.repeats):  # interleaved, so load changes hit both alike
        rows["pool"].append(through_pool())
        rows["direct"].append(ray.get(direct.timed_generate.remote(prompts, spec)))
    ray.kill(direct)
    rate = {k: statistics.median(n / s for n, s in v) for k, v in rows.items()}
    return {
        "prompts": args.prompts,
        "n": args.n,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "servers": pool.config.num_servers,
        "tokens_per_call": rows["pool"][0][0],
        "pool_tok_s": rate["pool"],
        "direct_tok_s": rate["direct"],
        "ratio_pool_to_direct": rate["pool"] / rate["direct"],
    }


def _other_gpu(pool) -> str:
    """A GPU no rollout server uses (this process is the trainer's rank 0 of the group)."""
    import torch

    used = {info["device_uuid"] for info in pool.infos}
    free = [
        i
        for i in range(torch.cuda.device_count())
        if str(torch.cuda.get_device_properties(i).uuid) not in used
    ]
    if not free:
        raise SystemExit("--transports nccl needs a GPU besides the servers' (2 GPUs)")
    torch.cuda.set_device(free[0])
    return f"cuda:{free[0]}"


def table(rows: list[dict]) -> str:
    """The sync rows as a fixed-width table (the JSON follows it)."""
    head = f"{'transport':<13}{'source':<7}{'MB':>9}{'seconds':>10}{'GB/s':>9}{'copy GB/s':>11}{'x copy':>8}"
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['transport']:<13}{r['source']:<7}{r['bytes'] / 1e6:>9.1f}{r['seconds']:>10.4f}"
            f"{r['gbps']:>9.2f}{r['memcpy_gbps']:>11.1f}{r['memcpy_gbps'] / r['gbps']:>8.1f}"
        )
    return "\n".join(lines)


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--work", default="runs/bench_weight_sync")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--transports", default="object_store")
    p.add_argument("--bucket-mb", type=float, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--num-cpus", type=int, default=os.cpu_count())
    p.add_argument("--out", default=None)
    p.add_argument("--profile", metavar="DIR", help="trace one more push per row (profiling.py)")
    args = p.parse_args()

    import ray

    from polyrl.rollout import RolloutConfig, RolloutPool

    work = Path(args.work)
    model_dir = build_model(work, args.hidden, args.layers)
    on_gpu = _on_gpu()
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    pool = RolloutPool(
        RolloutConfig(
            model_path=str(model_dir),
            num_servers=args.servers,
            dtype="float32",
            max_model_len=256,
            kv_cache_gib=1.0,
            gpu_memory_utilization=0.3,
            num_gpus=0.3 if on_gpu else None,
        )
    )
    device = "cuda" if on_gpu else "cpu"
    if "nccl" in args.transports.split(","):
        device = _other_gpu(pool) if on_gpu else "cpu"  # NCCL: one rank per device
    sources = state_dicts(model_dir, device)
    result = {
        "device": "cuda" if on_gpu else "cpu",
        "model": {
            "path": str(model_dir),
            "hidden": args.hidden,
            "layers": args.layers,
            "params": sum(int(t.numel()) for t in sources["torch"].values()),
        },
        "sync": bench_sync(
            pool,
            sources,
            args.transports.split(","),
            int(args.bucket_mb * 2**20),
            args.repeats,
            args.profile,
        ),
        "rollout": bench_rollout(pool, args),
    }
    pool.shutdown()
    ray.shutdown()
    text = json.dumps(result, indent=1)
    print(table(result["sync"]))
    for row in result["sync"]:
        if "profile" in row:
            print(
                "\n".join(
                    format_top(row["profile"], f"{row['transport']} {row['source']}: top ops")
                )
            )
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
