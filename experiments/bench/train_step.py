"""Benchmark one training step of a backend: tokens/s, step time, peak memory (and MFU
on GPU) for a model shape and batch. Not a test; numbers go to stdout and ``--json``.

The backend is a registered name (``polyrl.backends.get_engine``), so every backend runs
the same script: same random Qwen2 model (an HF directory built with transformers, no
download), same batch, same loss (token-mean NLL written with ``polyrl.tensor``).

    python experiments/bench/train_step.py                       # tiny model, CPU
    python experiments/bench/train_step.py --hidden 896 --layers 24 --heads 14 \\
        --kv-heads 2 --intermediate 4864 --vocab 151936 --batch 8 --prompt-len 1024 \\
        --response-len 1024 --dtype bfloat16 --grad-ckpt --json out.json   # 0.5B shape
    torchrun --nproc-per-node 2 experiments/bench/train_step.py ...       # FSDP over 2 GPUs

Under torchrun each rank gets ``--batch / WORLD_SIZE`` samples and the mesh is
``fsdp = WORLD_SIZE`` unless ``--mesh`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from polyrl.backends import ENGINES, get_engine
from polyrl.batch import Batch, from_token_lists
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig
from polyrl.tensor import masked_sum

# Dense bf16 peak of the accelerators we measure on (TFLOP/s), for MFU.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="torch_fsdp", choices=sorted(ENGINES))
    shape = p.add_argument_group("model shape (default: the tiny test model)")
    for name in ("hidden", "layers", "heads", "kv-heads", "intermediate", "vocab"):
        shape.add_argument(f"--{name}", type=int)
    p.add_argument("--model", help="an existing HF model directory instead of a random one")
    p.add_argument("--batch", type=int, default=16, help="samples per step, all ranks")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing")
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument("--mesh", help='e.g. "data=1,fsdp=2" (default: fsdp = world size)')
    p.add_argument("--json", help="write the result here")
    return p.parse_args(argv)


def build_model(args, root: Path) -> Path:
    """The model directory: --model, the tiny model, or a random Qwen2 of the given shape."""
    if args.model:
        return Path(args.model)
    from polyrl.data.tiny import ensure_tiny_model

    tiny = ensure_tiny_model(root / "tiny")
    if args.hidden is None:
        return tiny
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, set_seed

    config = Qwen2Config(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers or 2,
        num_attention_heads=args.heads or max(1, args.hidden // 64),
        num_key_value_heads=args.kv_heads or args.heads or max(1, args.hidden // 64),
        intermediate_size=args.intermediate or 4 * args.hidden,
        vocab_size=args.vocab or 64,
        max_position_embeddings=args.prompt_len + args.response_len,
        tie_word_embeddings=True,
    )
    out = root / "random-qwen2"
    set_seed(0)  # every rank builds the same weights
    Qwen2ForCausalLM(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)  # ids only need a pad token
    return out


def make_batch(n: int, prompt_len: int, response_len: int, vocab: int, seed: int) -> Batch:
    """Full-length random samples (no padding), so every token is real work."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(1, vocab, (n, prompt_len)).tolist()
    responses = rng.integers(1, vocab, (n, response_len)).tolist()
    return from_token_lists(prompts, responses, pad_id=0)


def nll_loss(outputs, batch, ctx):
    """Token-mean NLL (loss contract of polyrl.backends.base), any array namespace."""
    loss = -masked_sum(outputs["log_probs"], batch["response_mask"]) / ctx.global_tokens
    return loss, {}


def peak_memory() -> dict[str, float]:
    """Host peak RSS and, when a framework is loaded on a GPU, its peak device memory (GiB)."""
    out = {"host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        out["device_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    jax = sys.modules.get("jax")
    if jax is not None and jax.devices()[0].platform == "gpu":
        stats = jax.devices()[0].memory_stats() or {}
        out["device_peak_gib"] = stats.get("peak_bytes_in_use", 0) / 2**30
    return out


def accelerator() -> tuple[str, float | None]:
    """(device name, dense bf16 peak TFLOP/s or None when unknown / CPU)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return name, next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)", None


def train_flops(cfg: dict, tokens: int, seq_len: int) -> float:
    """6 * params * tokens for the matmuls + 12 * layers * hidden * seq_len * tokens for
    attention scores (forward + backward; no recompute counted: MFU, not HFU)."""
    h, layers, inter, vocab = (
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
    )
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter
    params = layers * per_layer + h * vocab
    return 6.0 * params * tokens + 12.0 * layers * h * seq_len * tokens


def run(args) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    mesh = {"fsdp": world}
    if args.mesh:
        mesh = {k: int(v) for k, v in (kv.split("=") for kv in args.mesh.split(","))}
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be a multiple of WORLD_SIZE={world}")
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(args, Path(os.environ.get("POLYRL_BENCH_DIR", tmp)))
        config = json.loads((path / "config.json").read_text())
        engine = get_engine(args.backend)()
        engine.init(
            ModelConfig(str(path), dtype=args.dtype, gradient_checkpointing=args.grad_ckpt),
            OptimConfig(lr=1e-5),
            ParallelConfig(
                mesh=mesh, micro_batch_size=args.micro_batch, cpu_offload=args.cpu_offload
            ),
        )
    local = args.batch // world
    batch = make_batch(args.batch, args.prompt_len, args.response_len, config["vocab_size"], 0)
    shard = batch.take(slice(rank * local, (rank + 1) * local))
    for _ in range(args.warmup):
        engine.train_step(shard, nll_loss)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        metrics = engine.train_step(shard, nll_loss)  # returns host floats: synchronised
        times.append(time.perf_counter() - start)
    step = float(np.median(times))
    tokens = args.batch * (args.prompt_len + args.response_len)
    device, peak = accelerator()
    flops = train_flops(config, tokens, args.prompt_len + args.response_len)
    result = {
        "backend": args.backend,
        "device": device,
        "world_size": world,
        "mesh": mesh,
        "model": {
            k: config[k]
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "intermediate_size",
                "vocab_size",
            )
        },
        "dtype": args.dtype,
        "grad_ckpt": args.grad_ckpt,
        "batch": args.batch,
        "micro_batch": args.micro_batch,
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "step_s_median": step,
        "step_s_all": times,
        "tokens_per_s": tokens / step,
        "train_tflops_per_s": flops / step / 1e12,
        "mfu": flops / step / (peak * 1e12 * world) if peak else None,
        "last_loss": metrics["loss"],
        **peak_memory(),
    }
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    result = run(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
