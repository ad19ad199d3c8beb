"""Benchmark: how a LoRA actor's weights reach vLLM, per weight version. Not a test; a table
on stdout and one JSON object (``--json``).

Two ways, on a random Qwen2 of the requested shape (``weight_sync.py``'s ``build_model``):

* ``merged`` (what polyrl does, docs/training.md "LoRA"): the trainer exports
  ``W + scale * B @ A`` under the HF names and the servers load them in place. The
  first push after start is every tensor (``full``); later pushes only what training
  changes (``delta``: ``export_weights(trained_only=True)``, the target projections and
  those vLLM fuses with them, ``LoraConfig.changes``).
* ``adapters``: the trainer writes the adapters as a PEFT directory (``save_adapters``)
  and vLLM, started with ``enable_lora``, loads them as a new ``LoRARequest`` (a new
  adapter id per version); generation then runs vLLM's LoRA kernels on top of the base.

Measured per version: the trainer side (export, or writing the adapter directory; the
torch engine, a world of one, in this process) and the vLLM side (loading the tensors
through polyrl's worker extension, or the first request of a new adapter id minus a
request of an adapter already loaded), each the median of ``--repeats``; and generated
tokens/s of the same requests on the merged model and with the adapter. Each vLLM runs
in a child process of its own (``--mode``), from files the parent wrote.

    python experiments/bench/lora_sync.py                                  # CPU, 512 x 8
    python experiments/bench/lora_sync.py --hidden 1536 --layers 28 --heads 12 \\
        --kv-heads 2 --intermediate 8960 --vocab 151936 --dtype bfloat16 --json lora_sync.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from weight_sync import build_model  # noqa: E402


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def trainer_side(args, model_dir: Path, work: Path) -> dict:
    """A torch LoRA actor moved by one update; writes full.safetensors, delta.safetensors
    and adapters/ under ``work`` and times each export."""
    import numpy as np
    from safetensors.torch import save_file

    from polyrl.algos.registry import get_algorithm
    from polyrl.backends import get_engine
    from polyrl.batch import from_token_lists
    from polyrl.config import LoraConfig, ModelConfig, OptimConfig, ParallelConfig

    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank, target_modules=args.targets)
    engine = get_engine("torch_fsdp")()
    engine.init(
        ModelConfig(str(model_dir), lora=lora, dtype=args.dtype),
        OptimConfig(lr=1e-2),
        ParallelConfig(micro_batch_size=8),
    )
    rng = np.random.default_rng(0)
    batch = from_token_lists(
        [list(rng.integers(4, 58, 12)) for _ in range(8)],
        [list(rng.integers(4, 58, 8)) for _ in range(8)],
        pad_id=0,
    )
    mask = batch["response_mask"]
    batch = batch.with_columns(
        {
            "old_log_probs": (-4.0 * mask).astype(np.float32),
            "advantages": (rng.normal(0, 1, (8, 1)) * mask).astype(np.float32),
        }
    )
    loss = get_algorithm("grpo").make_actor_loss(use_kl_loss=False, entropy_coef=0.0)
    engine.train_step(batch, loss, temperature=1.0)  # B leaves zero: merged != base

    def export(trained_only: bool) -> dict:
        return {
            n: t.detach().to("cpu", copy=True)
            for bucket in engine.export_weights(1 << 26, trained_only=trained_only)
            for n, t in bucket
        }

    out = {}
    for kind, only in (("full", False), ("delta", True)):
        out[f"export_{kind}_s"] = _median_time(lambda o=only: export(o), args.repeats)
        tensors = export(only)
        out[f"{kind}_tensors"] = len(tensors)
        out[f"{kind}_bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(
            {n: t.contiguous() for n, t in tensors.items()}, str(work / f"{kind}.safetensors")
        )
    out["save_adapters_s"] = _median_time(
        lambda: engine.save_adapters(str(work / "adapters")), args.repeats
    )
    out["adapter_bytes"] = (work / "adapters" / "adapter_model.safetensors").stat().st_size
    return out


def vllm_side(args, model_dir: Path, work: Path) -> dict:
    """``--mode merged|adapters``: one vLLM engine in this process (a child)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from safetensors.torch import load_file
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from polyrl.rollout import RolloutConfig
    from polyrl.rollout.server import engine_kwargs

    on_gpu = torch.cuda.is_available()
    cfg = RolloutConfig(
        model_path=str(model_dir),
        dtype=args.dtype,
        max_model_len=args.prompt_len + args.new_tokens + 8,
        kv_cache_gib=1.0,
        gpu_memory_utilization=0.5,
    )
    kwargs = engine_kwargs(cfg, on_gpu)
    if args.mode == "adapters":
        kwargs.update(enable_lora=True, max_lora_rank=args.rank, max_loras=1)
    from vllm import LLM

    llm = LLM(**kwargs)
    prompts = [
        {"prompt_token_ids": [4 + (i * 7 + j) % 50 for j in range(args.prompt_len)]}
        for i in range(args.prompts)
    ]
    gen = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True, logprobs=0)
    one = SamplingParams(temperature=0, max_tokens=1)
    out: dict = {}

    def load(name: str) -> None:
        weights = list(load_file(str(work / name)).items())
        llm.collective_rpc("polyrl_load_bucket", args=(weights,))
        llm.collective_rpc("polyrl_finish_update")
        llm.reset_prefix_cache()

    request = None
    if args.mode == "merged":
        load("full.safetensors")
        out["load_full_s"] = _median_time(lambda: load("full.safetensors"), args.repeats)
        out["load_delta_s"] = _median_time(lambda: load("delta.safetensors"), args.repeats)
    else:
        ids = iter(range(1, 10_000))

        def fresh() -> None:
            llm.generate(prompts[:1], one, lora_request=LoRARequest("v", next(ids), adapters))
            llm.reset_prefix_cache()

        adapters = str(work / "adapters")
        fresh()  # the first adapter warms the LoRA kernels
        request = LoRARequest("v", next(ids), adapters)
        llm.generate(prompts[:1], one, lora_request=request)
        loaded = _median_time(
            lambda: (
                llm.generate(prompts[:1], one, lora_request=request),
                llm.reset_prefix_cache(),
            ),
            args.repeats,
        )
        out["load_adapter_s"] = max(_median_time(fresh, args.repeats) - loaded, 0.0)
    llm.generate(prompts, gen, lora_request=request)  # warm-up
    start = time.perf_counter()
    results = llm.generate(prompts, gen, lora_request=request)
    seconds = time.perf_counter() - start
    out["generate_tok_s"] = sum(len(r.outputs[0].token_ids) for r in results) / seconds
    from polyrl.rollout.engines import scheduler_limits

    out["rollout_limits"] = scheduler_limits(llm.llm_engine.vllm_config)  # it ran at these
    out["logprobs"] = [
        [next(iter(step.values())).logprob for step in r.outputs[0].logprobs] for r in results
    ]
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="runs/bench_lora_sync")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=None, help="default: hidden / 32")
    p.add_argument("--kv-heads", type=int, default=None, help="default: hidden / 64")
    p.add_argument("--intermediate", type=int, default=None, help="default: 8/3 hidden")
    p.add_argument("--vocab", type=int, default=None, help="embedding rows (default: tokenizer)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument(
        "--targets",
        type=lambda s: tuple(s.split(",")),
        default=("q_proj", "k_proj", "v_proj", "o_proj"),
        help="comma-separated LoraConfig.target_modules",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--mode", choices=["merged", "adapters"], help=argparse.SUPPRESS)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_model(work / "model", args)
    if args.mode:  # a child: one vLLM engine, its numbers as the last line
        print(json.dumps(vllm_side(args, model_dir, work)))
        return {}
    out: dict = {"shape": {k: getattr(args, k) for k in ("hidden", "layers", "dtype", "rank")}}
    out["targets"] = list(args.targets)
    out["trainer"] = trainer_side(args, model_dir, work)
    given = list(argv if argv is not None else sys.argv[1:])
    if "--json" in given:  # the parent writes it
        del given[given.index("--json") : given.index("--json") + 2]
    for mode in ("merged", "adapters"):
        child = subprocess.run(
            [sys.executable, __file__, *given, "--work", str(work), "--mode", mode],
            capture_output=True,
            text=True,
        )
        lines = child.stdout.strip().splitlines()
        if child.returncode or not lines:
            out[mode] = {"error": (child.stderr or child.stdout).strip().splitlines()[-3:]}
        else:
            out[mode] = json.loads(lines[-1])
    t, m, a = out["trainer"], out["merged"], out["adapters"]
    if "error" not in m:
        m["per_version_delta_s"] = t["export_delta_s"] + m["load_delta_s"]
        m["per_version_full_s"] = t["export_full_s"] + m["load_full_s"]
    if "error" not in a:
        a["per_version_s"] = t["save_adapters_s"] + a["load_adapter_s"]
    if "error" not in m and "error" not in a:
        gap = [
            abs(x - y)
            for xs, ys in zip(m.pop("logprobs"), a.pop("logprobs"))
            for x, y in zip(xs, ys)
        ]
        out["greedy_logprob_gap_max"] = max(gap)
    print(
        f"trainer: full {t['full_tensors']} tensors {t['full_bytes'] / 1e6:.1f} MB export "
        f"{t['export_full_s']:.3f} s; delta {t['delta_tensors']} tensors "
        f"{t['delta_bytes'] / 1e6:.1f} MB export {t['export_delta_s']:.3f} s; adapters "
        f"{t['adapter_bytes'] / 1e6:.2f} MB written in {t['save_adapters_s']:.3f} s"
    )
    if "error" in m:
        print(f"merged: failed: {m['error']}")
    else:
        print(
            f"merged: load full {m['load_full_s']:.3f} s, delta {m['load_delta_s']:.3f} s; "
            f"per version (export + load) full {m['per_version_full_s']:.3f} s, delta "
            f"{m['per_version_delta_s']:.3f} s; generate {m['generate_tok_s']:.0f} tok/s "
            f"(scheduler limits {m['rollout_limits']})"
        )
    if "error" in a:
        print(f"adapters: failed: {a['error']}")
    else:
        print(
            f"adapters: load {a['load_adapter_s']:.3f} s; per version (write + load) "
            f"{a['per_version_s']:.3f} s; generate {a['generate_tok_s']:.0f} tok/s "
            f"(scheduler limits {a['rollout_limits']})"
        )
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
