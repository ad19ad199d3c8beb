"""Benchmark: trainer -> rollout weight sync, and rollout throughput through the pool.

Prints one JSON object (and writes it to --out), the top ops of each profiled push
(--profile), and last a table of the syncs (time as a multiple of a plain copy of the
same bytes: "x copy"), the load alone and the goal ratios. The JSON holds:

* ``sync``: per transport, per source backend (torch tensors / jax arrays, the latter
  exported like the JAX engine does: ``export_buckets`` of the params, stored in HF's
  names and layout) and per load path on the servers (``plan``: the workers' load
  plan, ``polyrl.rollout.load_plan``; ``load_weights``: vLLM's per-parameter loaders;
  vLLM-CPU always reloads layer-wise, so on CPU only ``load_weights`` runs) the bytes,
  median seconds over --repeats pushes and GB/s of ``RolloutPool.update_weights``, next
  to a plain copy of the same tensors in this process (``memcpy_gbps``) and the ratio,
  and ``server_seconds``: what server 0 spent in the last push by part (``begin``,
  ``load`` over every bucket, ``finish``; ``RolloutServer.update_timings``; the table's
  "server s" is their sum): the push's wall time minus it is the calls' latency and
  this process's own work. The servers generate nothing between pushes, as in the
  colocated loop, whose push follows the rollout's sleep (which resets the prefix
  cache): ``prefix_reset`` says whether the last push's begin reset it (~3 ms on an
  H200 when a generation came before; docs/rollout.md). ``pusher_seconds``: the last
  push from this process's side (``SyncStats``): ``pack`` (packing and sending the
  buckets), ``wait`` (for the servers' answers), ``to_begin`` / ``from_finish`` (wall
  time from the push's start to server 0's begin, and from its finish to the push's
  end); the table's "pack s" and "wait s".
* ``load``: the load alone, in this process, on vLLM's model class built outside an
  engine on this device (``load_plan.bare_vllm_model``): one push of flat buckets through
  ``load_weights`` vs through a learned ``LoadPlanner``, next to a copy of the same bytes.
* ``export``: the JAX engine's export alone, as (name, array) pairs and packed into flat
  buckets (the CUDA IPC / NCCL form; ``export_buckets``: cast and gathered onto one
  device, bucket by bucket, nothing transposed), what the jax source adds.
* ``goals``: the issue's ratios — the planned CUDA IPC sync from torch over a copy of the
  same bytes (goal <= 3), from JAX over from torch (goal <= 1.5), and load_weights over
  the plan, for the sync and for the load alone.
* ``rollout``: generated tokens/s through ``RolloutPool.generate`` and through vLLM
  alone on the same requests (``bench_rollout``: inside each pool call, on the server's
  own engine in its process, and in a Ray actor of its own with the same engine
  arguments and resources as a server), and the ratios.

The model is a random Qwen2 of the requested shape (tiny tokenizer, --dtype, fp32 by
default) built under --work; the GPU run uses Qwen2.5-1.5B's shape in bf16 (--hidden 1536
--layers 28 --heads 12 --kv-heads 2 --intermediate 8960 --vocab 151936: 3.09 GB; a tied
``lm_head.weight`` is not sent). On CPU only the object-store transport exists; on a GPU host add
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
import sys
import time
from pathlib import Path

from profiling import format_top


def build_model(work: Path, args) -> Path:
    """A random Qwen2 of the requested shape; heads, KV heads and MLP width default to a
    head dim of 32 (what vLLM-CPU supports) and 8/3 of the width; ``--vocab`` pads the tiny
    tokenizer's vocabulary to that many embedding rows (the 1.5B shape: 151936)."""
    from polyrl.data.tiny import TinyModelSpec, ensure_tiny_model

    hidden = args.hidden
    spec = TinyModelSpec(
        hidden_size=hidden,
        intermediate_size=args.intermediate or hidden * 8 // 3 // 32 * 32,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads or hidden // 32,
        num_key_value_heads=args.kv_heads or max(1, hidden // 64),
        vocab_multiple=args.vocab or 1,
    )
    return ensure_tiny_model(work, spec)


def state_dicts(model_dir: Path, device: str, dtype: str):
    """The model's weights as torch tensors on ``device`` and as jax arrays on JAX's first
    device, as the JAX engine holds them (``{HF name: array}``, HF's layout)."""
    import jax
    import jax.numpy as jnp
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    # A tied lm_head.weight is the embedding again: vLLM skips it (and vLLM-CPU refuses a
    # load_weights call holding it without embed_tokens), so it is not sent.
    tied = model.config.tie_word_embeddings
    sd = {
        k: v.detach().to(device).contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    # JAX owns its copy, as in training
    jax_params = {name: jnp.array(jax.dlpack.from_dlpack(t), copy=True) for name, t in sd.items()}
    return {"torch": sd, "jax": jax_params}


def buckets(source: str, sd: dict, bucket_bytes: int):
    """One push's buckets, as the source backend's ``export_weights`` yields them."""
    from polyrl.backends.jax_pjit.weights import export_buckets
    from polyrl.weight_sync import iter_buckets

    if source == "jax":
        return export_buckets(sd, bucket_bytes)
    return iter_buckets(sd.items(), bucket_bytes)


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
    """One row per transport, source and load path; ``profile``: a directory to trace one
    more push of each into (this process's side of it: bucketing, copies, IPC handles,
    sends)."""
    import ray
    from profiling import profile_call

    rows = []
    loads = ["plan", "load_weights"] if _on_gpu() else ["load_weights"]
    copy = memcpy_gbps(sources["torch"], repeats)
    for transport in transports:
        for backend, sd in sources.items():
            if transport != "object_store" and backend == "jax" and not _on_gpu():
                continue  # the jax arrays here are host arrays; GPU transports need device ones
            for load in loads:
                ray.get([s.set_load_plan.remote(load == "plan") for s in pool.servers])
                pool.update_weights(buckets(backend, sd, bucket_bytes), transport)  # warm-up
                runs = [
                    pool.update_weights(buckets(backend, sd, bucket_bytes), transport)
                    for _ in range(repeats)
                ]
                seconds = statistics.median(r.seconds for r in runs)
                gbps = runs[0].bytes / seconds / 1e9
                # the last push seen from server 0: its own work, the rest is call latency
                server = ray.get(pool.servers[0].update_timings.remote())
                last = runs[-1]
                rows.append(
                    {
                        "transport": transport,
                        "source": backend,
                        "load": load,
                        "bytes": runs[0].bytes,
                        "buckets": runs[0].buckets,
                        "seconds": seconds,
                        "gbps": gbps,
                        "memcpy_gbps": copy,
                        "ratio_to_memcpy": gbps / copy,
                        "server_seconds": {
                            k: server[k] for k in ("begin", "load", "finish") if k in server
                        },
                        "prefix_reset": bool(server["prefix_reset"]),
                        # the last push from this side: packing/sending vs waiting, and the
                        # wall time from its start to server 0's begin, from server 0's
                        # finish to its end (calls' latency at both ends)
                        "pusher_seconds": {
                            "pack": last.pack_seconds,
                            "wait": last.wait_seconds,
                            "to_begin": server["began_at"] - last.started_at,
                            "from_finish": last.started_at + last.seconds - server["finished_at"],
                            "push": last.seconds,
                        },
                    }
                )
                if profile:
                    rows[-1]["profile"] = profile_call(
                        "jax" if backend == "jax" else "torch",
                        profile,
                        f"sync_{transport}_{backend}_{load}",
                        lambda b=backend, sd=sd, t=transport: pool.update_weights(
                            buckets(b, sd, bucket_bytes), t
                        ),
                    )
    ray.get([s.set_load_plan.remote(True) for s in pool.servers])
    return rows


def bench_export(jax_params: dict, bucket_bytes: int, repeats: int) -> dict:
    """The JAX engine's export alone, median of ``repeats`` after a warm-up, two ways:
    ``seconds``: the buckets' ``(name, array)`` pairs (``export_buckets``: cast and
    gathered onto one device; what the object store sends); ``packed_seconds``: each
    bucket packed into its flat buffer (``pack_flat``: one program casts and writes the
    bytes; what CUDA IPC and NCCL send)."""
    import jax
    import torch

    from polyrl.weight_sync import pack_flat

    def pairs() -> int:
        arrays = [x for bucket in buckets("jax", jax_params, bucket_bytes) for _, x in bucket]
        jax.block_until_ready(arrays)
        return len(arrays)

    def packed() -> int:
        flats = [pack_flat(bucket)[0] for bucket in buckets("jax", jax_params, bucket_bytes)]
        if flats[0].is_cuda:
            torch.cuda.synchronize(flats[0].device)
        return len(flats)

    def median_s(run) -> float:
        run()  # compiles each bucket layout once
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    nbytes = sum(int(x.size) * x.dtype.itemsize for x in jax_params.values())
    return {
        "tensors": len(jax_params),
        "bytes": nbytes,
        "seconds": median_s(pairs),
        "packed_seconds": median_s(packed),
    }


def bench_load(model_dir: Path, sd: dict, dtype: str, bucket_bytes: int, repeats: int) -> dict:
    """One push's load alone, in this process: load_weights vs a learned plan."""
    import torch

    from polyrl.rollout.load_plan import LoadPlanner, bare_vllm_model, vllm_parallel
    from polyrl.weight_sync import iter_buckets, pack_flat, unpack_flat

    device = next(iter(sd.values())).device
    packed = [pack_flat(b) for b in iter_buckets(sd.items(), bucket_bytes)]
    push = [(unpack_flat(flat, metas), flat, metas) for flat, metas in packed]

    def timed(load) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for weights, flat, metas in push:
            load(weights, flat, metas)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    with vllm_parallel():
        model, load_weights = bare_vllm_model(str(model_dir), dtype, device.type)
        planner = LoadPlanner(model, load_weights)

        def plain(weights, flat, metas) -> None:
            load_weights(weights)

        timed(plain), timed(planner.load)  # warm-up; the plan learns every layout here
        times: dict[str, list[float]] = {"plain": [], "plan": []}
        for _ in range(repeats):  # interleaved, so load changes hit both alike
            times["plain"].append(timed(plain))
            times["plan"].append(timed(planner.load))
        plain_s, planned = (statistics.median(times[k]) for k in ("plain", "plan"))
        copies = sum(p.copies for p in planner.plans.values() if p is not None)
        stats = dict(planner.stats)
        del model, planner
    nbytes = sum(int(t.nbytes) for t in sd.values())
    copy = nbytes / memcpy_gbps(sd, repeats) / 1e9
    return {
        "device": device.type,
        "bytes": nbytes,
        "tensors": len(sd),
        "buckets": len(packed),
        "plan_copies": copies,
        "plan_stats": stats,
        "load_weights_s": plain_s,
        "plan_s": planned,
        "copy_s": copy,
        "plan_x_copy": planned / copy,
        "load_weights_x_copy": plain_s / copy,
    }


def goals(rows: list[dict], load: dict | None) -> dict:
    """The issue's ratios from the rows (None where this run has no such row)."""

    def seconds(transport: str, source: str, load_path: str) -> float | None:
        for r in rows:
            if (r["transport"], r["source"], r["load"]) == (transport, source, load_path):
                return r["seconds"]
        return None

    out: dict = {}
    if load and "error" not in load:
        out["load_alone_load_weights_over_plan"] = load["load_weights_s"] / load["plan_s"]
        out["load_alone_plan_x_copy"] = load["plan_x_copy"]
    if not rows:
        return out
    transport = (
        "cuda_ipc" if any(r["transport"] == "cuda_ipc" for r in rows) else rows[0]["transport"]
    )
    best = "plan" if seconds(transport, "torch", "plan") is not None else "load_weights"
    torch_s, jax_s = seconds(transport, "torch", best), seconds(transport, "jax", best)
    copy_s = next(r["bytes"] / r["memcpy_gbps"] / 1e9 for r in rows if r["transport"] == transport)
    out["transport"], out["load"] = transport, best
    out["torch_x_copy"] = torch_s / copy_s if torch_s else None  # goal <= 3 (cuda_ipc)
    out["jax_over_torch"] = jax_s / torch_s if jax_s and torch_s else None  # goal <= 1.5
    plain = seconds(transport, "torch", "load_weights")
    out["sync_load_weights_over_plan"] = plain / torch_s if best == "plan" and plain else None
    return out


def _generate_with(engine, mask, prompts: list, spec) -> tuple[int, float]:
    """``engine.generate`` (``polyrl.rollout.engines``: the server's kind of vLLM engine)
    on the servers' own requests for ``prompts``
    (``polyrl.rollout.server.vllm_requests``: one seeded sample per request, the same
    vocabulary mask): generated tokens and seconds. Text as vLLM gives it when
    ``spec.detokenize``: detokenized token by token in its loop."""
    from polyrl.rollout.server import vllm_requests

    requests = [(i * spec.n + j, p) for i, p in enumerate(prompts) for j in range(spec.n)]
    inputs, params = vllm_requests(requests, spec, mask)
    for p in params:
        p.detokenize = spec.detokenize
    start = time.perf_counter()
    outs = engine.generate(inputs, params)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - start


class DirectEngine:
    """The pool's kind of vLLM engine (``RolloutConfig.engine``) with its engine
    arguments, in a Ray actor with the same resources and environment as a rollout
    server, given the same requests as the servers, so the comparison is like for like
    but for the process."""

    def __init__(self, config, on_gpu: bool) -> None:
        from polyrl.rollout.engines import make_engine
        from polyrl.rollout.server import engine_kwargs, vocab_mask

        self.engine = make_engine(config.asynchronous, engine_kwargs(config, on_gpu))
        vocab = int(self.engine.model_config.get_vocab_size())
        self.mask = vocab_mask(len(self.engine.tokenizer), vocab, config)

    def timed_generate(self, prompts: list, spec) -> tuple[int, float]:
        return _generate_with(self.engine, self.mask, prompts, spec)

    def limits(self) -> dict[str, int]:
        """The scheduler limits its engine runs at (as the servers report theirs)."""
        from polyrl.rollout.engines import scheduler_limits

        return scheduler_limits(self.engine.vllm_config)


def _engine_generate(server, prompts: list, spec) -> tuple[int, float]:
    """Inside a rollout server (``__ray_call__``): its own vLLM engine called directly,
    with no polyrl code around it: same engine, same process as the pool's calls."""
    server._cached_prefixes = True  # the weight protocol's flag: this fills the cache too
    return _generate_with(server.engine, server._mask, prompts, spec)


def _process_stats(_actor) -> dict:
    """Inside an actor: its process's CPU seconds so far (every thread), involuntary
    context switches (a busy CPU took it off), threads, and the CPU it runs on now."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    with open("/proc/self/stat") as f:  # field 39: the CPU last run on
        cpu = int(f.read().rsplit(")", 1)[1].split()[36])
    return {
        "cpu_s": r.ru_utime + r.ru_stime,
        "nivcsw": r.ru_nivcsw,
        "threads": len(os.listdir("/proc/self/task")),
        "cpu": cpu,
    }


PROFILE_TOKENS = 64


def bench_rollout(pool, args, profile: str | None = None, detokenize: bool = False) -> dict:
    """Generated tokens/s (median of --repeats): pool.generate vs vllm.LLM.generate in its
    own actor (``direct``) and, with one server, on the server's engine in its process
    (``engine``); per pool call, vLLM's own seconds in it over the call's; per call, the
    generating process's CPU seconds and involuntary context switches (server 0 for
    ``pool`` and ``engine``).
    ``detokenize``: both return text too (the pool decodes each response once, vLLM
    detokenizes token by token), as a training run's rollout does.
    ``profile``: a directory for torch.profiler traces of one more call of each (at most
    ``PROFILE_TOKENS`` new tokens), taken inside the rollout servers and inside the
    direct engine's actor."""
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
        detokenize=detokenize,
    )
    batch = Batch(meta={"prompt_ids": prompts})

    def through_pool(spec=spec) -> tuple[int, float]:
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
    server = pool.servers[0]
    from ray import cloudpickle

    # The actors cannot import this script's directory: send its functions by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.get(direct.timed_generate.remote(prompts[:2], spec))  # start-up + warm-up
    through_pool()  # warm-up
    # Three sides: the pool; vLLM alone in its own actor; and vLLM alone on the server's
    # own engine in its own process (one server: the pool's whole batch), which tells
    # polyrl's cost from the difference between two processes on a shared host.
    sides = {
        "pool": (server, through_pool),
        "direct": (direct, lambda: ray.get(direct.timed_generate.remote(prompts, spec))),
    }
    if pool.config.num_servers == 1:
        sides["engine"] = (
            server,
            lambda: ray.get(server.__ray_call__.remote(_engine_generate, prompts, spec)),
        )
    rows = {side: [] for side in sides}
    stats = {side: [] for side in sides}
    names = list(sides)
    vllm_share = []  # per pool call: vLLM's own seconds in it (the servers' spans) / its wall
    # Interleaved, each side first in turn: load changes hit all alike.
    for i in range(args.repeats):
        for side in names[i % len(names) :] + names[: i % len(names)]:
            actor, call = sides[side]
            before = ray.get(actor.__ray_call__.remote(_process_stats))
            rows[side].append(call())
            after = ray.get(actor.__ray_call__.remote(_process_stats))
            stats[side].append(
                {k: after[k] - before[k] for k in ("cpu_s", "nivcsw")}
                | {k: after[k] for k in ("threads", "cpu")}
            )
            if side == "pool":
                spans = ray.get([s.spans.remote() for s in pool.servers])
                engine_s = max(
                    [sec for m, _, sec, _ in got if m == "generate.vllm"][-1] for got in spans
                )
                vllm_share.append(engine_s / rows["pool"][-1][1])
    traces = {}
    if profile:
        import dataclasses

        from profiling import profile_actors

        # At most PROFILE_TOKENS new tokens: the same decode steps, a trace of a few MB.
        short = dataclasses.replace(spec, max_tokens=min(spec.max_tokens, PROFILE_TOKENS))
        traces["profile_pool"] = profile_actors(
            pool.servers, profile, "pool", lambda: through_pool(short)
        )
        traces["profile_direct"] = profile_actors(
            [direct],
            profile,
            "direct",
            lambda: ray.get(direct.timed_generate.remote(prompts, short)),
        )
    # the engines' scheduler limits, read back: each side's tokens/s is at these
    limits = {"pool": pool.limits, "direct": ray.get(direct.limits.remote())}
    ray.kill(direct)
    rate = {k: statistics.median(n / s for n, s in v) for k, v in rows.items()}
    per_call = {k: [n / s for n, s in v] for k, v in rows.items()}
    out = {
        "prompts": args.prompts,
        "n": args.n,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "servers": pool.config.num_servers,
        "tokens_per_call": rows["pool"][0][0],
        "detokenize": detokenize,
        "rollout_limits": limits,
        **{f"{k}_tok_s": v for k, v in rate.items()},
        # every timed call, in order: the noise beside the median
        "calls_tok_s": per_call,
        # per call, of the process that generated (the server for pool and engine)
        "process": stats,
        # per pool call, vLLM's seconds inside it over the call's: the pool's tokens/s
        # over its own engine's in the same call, free of the host's drift between calls
        "pool_to_its_vllm": vllm_share,
        "pool_to_its_vllm_median": statistics.median(vllm_share),
    }
    for ref in ("direct", "engine"):
        if ref in rate:
            # Each round's calls ran back to back: their ratio cancels load that drifts
            # between rounds, which the ratio of the medians does not.
            paired = [a / b for a, b in zip(per_call["pool"], per_call[ref])]
            out |= {
                f"ratio_pool_to_{ref}": rate["pool"] / rate[ref],
                f"paired_ratios_{ref}": paired,
                f"paired_ratio_median_{ref}": statistics.median(paired),
            }
    return traces | out


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


def table(rows: list[dict], load: dict | None, ratios: dict) -> str:
    """The sync rows, the load alone and the goal ratios as text (the JSON follows it)."""
    head = (
        f"{'transport':<13}{'source':<7}{'load':<13}{'MB':>9}{'seconds':>10}{'GB/s':>9}"
        f"{'copy GB/s':>11}{'x copy':>8}{'server s':>10}{'pack s':>8}{'wait s':>8}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['transport']:<13}{r['source']:<7}{r['load']:<13}{r['bytes'] / 1e6:>9.1f}"
            f"{r['seconds']:>10.4f}{r['gbps']:>9.2f}{r['memcpy_gbps']:>11.1f}"
            f"{r['memcpy_gbps'] / r['gbps']:>8.1f}{sum(r['server_seconds'].values()):>10.4f}"
            f"{r['pusher_seconds']['pack']:>8.4f}{r['pusher_seconds']['wait']:>8.4f}"
        )
    if load and "error" in load:
        lines.append(f"load alone: failed ({load['error']})")
    elif load:
        lines.append(
            f"load alone ({load['device']}, {load['bytes'] / 1e6:.1f} MB, {load['tensors']} tensors"
            f" -> {load['plan_copies']} copies): load_weights {load['load_weights_s']:.4f} s,"
            f" plan {load['plan_s']:.4f} s, copy {load['copy_s']:.4f} s"
        )
    lines.append(
        "goals: "
        + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in ratios.items()
        )
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
    p.add_argument("--heads", type=int, default=None, help="default: hidden / 32")
    p.add_argument("--kv-heads", type=int, default=None, help="default: hidden / 64")
    p.add_argument("--intermediate", type=int, default=None, help="default: 8/3 hidden")
    p.add_argument("--vocab", type=int, default=None, help="embedding rows (default: tokenizer)")
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--transports", default="object_store")
    p.add_argument("--bucket-mb", type=float, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--num-cpus", type=int, default=os.cpu_count())
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--sections",
        default="sync,load,rollout",
        help="comma list of: sync (through the pool, per transport), load (the load alone, "
        "in this process, no Ray), rollout (pool vs vLLM directly), export (the JAX "
        "engine's export alone)",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--profile", metavar="DIR", help="trace one more push per row (profiling.py)")
    args = p.parse_args()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # vLLM shares the GPU
    sections = set(args.sections.split(","))

    model_dir = build_model(Path(args.work), args)
    on_gpu = _on_gpu()
    bucket_bytes = int(args.bucket_mb * 2**20)
    result: dict = {"device": "cuda" if on_gpu else "cpu", "sync": [], "load": None}
    if "export" in sections:
        jax_params = state_dicts(model_dir, "cuda" if on_gpu else "cpu", args.dtype)["jax"]
        result["export"] = bench_export(jax_params, bucket_bytes, args.repeats)
        del jax_params
    if sections & {"sync", "rollout"}:
        result.update(bench_pool(args, model_dir, sections, bucket_bytes))
    if "load" in sections:  # last, with the servers gone: vLLM's model class in this process
        sd = state_dicts(model_dir, "cuda" if on_gpu else "cpu", args.dtype)["torch"]
        try:
            result["load"] = bench_load(model_dir, sd, args.dtype, bucket_bytes, args.repeats)
        except Exception as e:  # noqa: BLE001 - the sync rows above must still be reported
            print(f"load section failed: {e!r}", file=sys.stderr)
            result["load"] = {"error": repr(e)}
        del sd
    result["goals"] = goals(result["sync"], result["load"])
    text = json.dumps(result, indent=1)
    print(text)
    for row in result["sync"]:
        if "profile" in row:
            title = f"{row['transport']} {row['source']} {row['load']}: top ops"
            print("\n".join(format_top(row["profile"], title)))
    if "export" in result:
        e = result["export"]
        print(
            f"jax export alone: {e['seconds']:.4f} s as (name, array) pairs, "
            f"{e['packed_seconds']:.4f} s packed into flat buckets; {e['tensors']} tensors, "
            f"{e['bytes'] / 1e6:.1f} MB"
        )
    print(table(result["sync"], result["load"], result["goals"]))  # last: what tail shows
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


def bench_pool(args, model_dir: Path, sections: set[str], bucket_bytes: int) -> dict:
    """The sections that need rollout servers: sync and rollout."""
    import ray

    from polyrl.rollout import RolloutConfig, RolloutPool

    on_gpu = _on_gpu()
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    pool = RolloutPool(
        RolloutConfig(
            model_path=str(model_dir),
            num_servers=args.servers,
            dtype=args.dtype,
            max_model_len=256,
            kv_cache_gib=1.0,
            gpu_memory_utilization=0.3,
            num_gpus=0.3 if on_gpu else None,
        )
    )
    out: dict = {}
    if "sync" in sections:
        device = "cuda" if on_gpu else "cpu"
        if "nccl" in args.transports.split(","):
            device = _other_gpu(pool) if on_gpu else "cpu"  # NCCL: one rank per device
        sources = state_dicts(model_dir, device, args.dtype)
        out["model"] = {
            "path": str(model_dir),
            "hidden": args.hidden,
            "layers": args.layers,
            "params": sum(int(t.numel()) for t in sources["torch"].values()),
            "dtype": args.dtype,
        }
        transports = args.transports.split(",")
        out["sync"] = bench_sync(
            pool, sources, transports, bucket_bytes, args.repeats, args.profile
        )
        del sources
    if "rollout" in sections:
        out["rollout"] = bench_rollout(pool, args, args.profile)
    pool.shutdown()
    ray.shutdown()
    return out


if __name__ == "__main__":
    main()
