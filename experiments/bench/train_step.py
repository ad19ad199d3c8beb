"""Benchmark one training step of a backend: tokens/s, step time, peak memory (and MFU
on GPU) for a model shape and batch. Not a test; numbers go to stdout and ``--json``.

The backend is a registered name (``polyrl.backends.get_engine``), so every backend runs
the same script: same random Qwen2 model (an HF directory built with transformers, no
download), same batch, same loss (token-mean NLL written with ``polyrl.tensor``).
``--backend hf_torch`` is the limit to compare with: the loop a user writes by hand
(transformers model in ``--dtype`` on one device, HF's own loss, fused AdamW on GPU, the
same micro-batches and checkpointing). ``--suite torch_fsdp,jax_pjit,hf_torch`` runs each
in its own process on the same arguments and prints one table (``jax_pjit:bfc`` runs the
JAX backend with ``XLA_PYTHON_CLIENT_ALLOCATOR=bfc`` instead of the backend's default):

    python experiments/bench/train_step.py --suite torch_fsdp,jax_pjit,hf_torch --json t.json

    python experiments/bench/train_step.py                       # tiny model, CPU
    python experiments/bench/train_step.py --hidden 896 --layers 24 --heads 14 \\
        --kv-heads 2 --intermediate 4864 --vocab 151936 --batch 8 --prompt-len 1024 \\
        --response-len 1024 --dtype bfloat16 --grad-ckpt --json out.json   # 0.5B shape
    torchrun --nproc-per-node 2 experiments/bench/train_step.py ...       # FSDP over 2 GPUs
    python experiments/bench/train_step.py --suite torch_fsdp,jax_pjit --profile prof/

LoRA vs full fine-tuning (docs/performance.md, "LoRA"): ``--lora`` trains adapters of
``--lora-rank`` (alpha = 2 x rank) on ``--lora-targets`` (default: every projection) on
the frozen base; ``+lora`` in a suite entry does the same per run. The table's
``trained`` column is the optimizer's parameter count:

    python experiments/bench/train_step.py --hidden 1536 --layers 28 --heads 12 \
        --kv-heads 2 --intermediate 8960 --vocab 151936 --batch 8 --prompt-len 1024 \
        --response-len 1024 --dtype bfloat16 --grad-ckpt --steps 3 --warmup 1 \
        --suite torch_fsdp,torch_fsdp+lora,jax_pjit,jax_pjit+lora --json lora.json

``--split`` (``+split`` in a suite entry) times the Tinker API's step instead:
``TrainEngine.forward_backward`` then ``optim_step`` (docs/tinker.md), the same work as
``train_step`` split in two calls.

``--profile DIR`` traces one more step after the timed ones with the backend's profiler
(torch.profiler / jax.profiler, ``profiling.py``) and prints its top ops by time.

Attention and padding (docs/performance.md, "Attention kernels and packing"): ``--attn``
is ``ModelConfig.attn_implementation`` (torch: ``sdpa``, ``polyrl_varlen``,
``flex_attention``; JAX: ``sdpa`` = cuDNN where it applies, else XLA, ``cudnn``, ``xla``),
``--pack`` turns on ``ParallelConfig.pack_sequences`` and ``--ragged`` draws each
sample's prompt length in [P/2, P] and response length in [R/8, R] (a padded batch
whose padding packing removes; tokens/s and MFU count real tokens only). ``--compile``
turns on ``ModelConfig.compile`` (torch: ``torch.compile`` per decoder layer and LM-head
chunk; the warm-up steps absorb the compile time). A suite entry may carry them per run:
``BACKEND[:ALLOCATOR][@ATTN][+pack][+compile][+lora][+budget=F]`` (``budget=F``:
``--grad-ckpt --ckpt-policy budget --memory-budget F`` for that run), e.g.

    python experiments/bench/train_step.py --ragged --suite \
        torch_fsdp,torch_fsdp@polyrl_varlen+pack+compile,jax_pjit,jax_pjit@auto+pack,hf_torch

``--grad-ckpt`` turns on ``ModelConfig.gradient_checkpointing`` and ``--ckpt-policy`` picks
its ``checkpoint_policy`` (docs/backends.md, "Activation checkpointing"): ``full``
recomputes each decoder layer, ``selective`` keeps its matmul and attention outputs and
recomputes the elementwise work (``hf_torch`` passes the same SAC policy to HF's
``gradient_checkpointing_enable``), ``budget`` keeps at most ``--memory-budget`` of the
activations (torch with ``--compile``: the compiler's partitioner chooses; JAX: that
share of the layers keeps everything, the rest recompute whole). The JSON and the
suite's table record the policy.

Under torchrun each rank gets ``--batch / WORLD_SIZE`` samples and the mesh is
``fsdp = WORLD_SIZE`` unless ``--mesh`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from polyrl.backends import ENGINES, get_engine
from polyrl.batch import Batch, from_token_lists
from polyrl.config import LoraConfig, ModelConfig, OptimConfig, ParallelConfig
from polyrl.tensor import masked_sum

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profiling import format_top, profile_call  # noqa: E402

SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
)
# Dense bf16 peak of the accelerators we measure on (TFLOP/s), for MFU.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="torch_fsdp", choices=[*sorted(ENGINES), "hf_torch"])
    p.add_argument("--suite", help="comma-separated backends, each run in its own process")
    p.add_argument("--max-tokens", type=int, help="ParallelConfig.max_tokens_per_micro_batch")
    p.add_argument("--attn", default="sdpa", help="ModelConfig.attn_implementation")
    p.add_argument("--pack", action="store_true", help="ParallelConfig.pack_sequences")
    p.add_argument("--compile", action="store_true", help="ModelConfig.compile")
    p.add_argument("--ragged", action="store_true", help="ragged prompt/response lengths")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (ModelConfig.lora)")
    p.add_argument(
        "--split",
        action="store_true",
        help="time TrainEngine.forward_backward + optim_step (the Tinker API's step, "
        "docs/tinker.md) instead of train_step",
    )
    p.add_argument("--lora-rank", type=int, default=16, help="LoraConfig.rank (alpha = 2 x rank)")
    p.add_argument(
        "--lora-targets",
        default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        help="LoraConfig.target_modules, comma-separated",
    )
    p.add_argument(
        "--logits-chunk", type=int, default=1024, help="ParallelConfig.logits_chunk_tokens"
    )
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
    p.add_argument(
        "--ckpt-policy",
        default="full",
        choices=["full", "selective", "budget"],
        help="ModelConfig.checkpoint_policy: what --grad-ckpt keeps per layer",
    )
    p.add_argument(
        "--memory-budget",
        type=float,
        default=0.6,
        help="ModelConfig.activation_memory_budget: with --ckpt-policy budget, the fraction "
        "of the activations each layer keeps (torch: the compiler's choice, needs --compile)",
    )
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument("--mesh", help='e.g. "data=1,fsdp=2" (default: fsdp = world size)')
    p.add_argument("--json", help="write the result here")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="trace one more step with the backend's profiler into DIR (profiling.py)",
    )
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
    if (out / "config.json").exists() and all(
        json.loads((out / "config.json").read_text())[k] == v
        for k, v in config.to_dict().items()
        if k in SHAPE_KEYS
    ):
        return out  # built by an earlier run of the suite
    set_seed(0)  # every rank builds the same weights
    Qwen2ForCausalLM(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(out)  # ids only need a pad token
    return out


def make_batch(
    n: int, prompt_len: int, response_len: int, vocab: int, seed: int, ragged: bool = False
) -> Batch:
    """Random samples: full length (no padding, every token is real work), or with
    ``ragged`` prompt lengths in [P/2, P] and response lengths in [R/8, R]."""
    rng = np.random.default_rng(seed)
    p_lens = (
        rng.integers(max(1, prompt_len // 2), prompt_len + 1, n) if ragged else [prompt_len] * n
    )
    r_lens = (
        rng.integers(max(1, response_len // 8), response_len + 1, n)
        if ragged
        else [response_len] * n
    )
    prompts = [rng.integers(1, vocab, int(k)).tolist() for k in p_lens]
    responses = [rng.integers(1, vocab, int(k)).tolist() for k in r_lens]
    return from_token_lists(
        prompts, responses, pad_id=0, prompt_len=prompt_len, response_len=response_len
    )


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
    torch, jax = sys.modules.get("torch"), sys.modules.get("jax")
    name = None
    if torch is not None and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
    elif jax is not None and jax.devices()[0].platform == "gpu":  # a JAX run without torch
        name = jax.devices()[0].device_kind
    if name is not None:
        return name, next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)", None


def train_flops(cfg: dict, lengths: np.ndarray, frozen_base: bool = False) -> float:
    """6 * params * tokens for the matmuls + 12 * layers * hidden * sum(length^2) for
    attention scores (forward + backward; no recompute counted: MFU, not HFU), over the
    real tokens of sequences of ``lengths``. ``frozen_base`` (LoRA): 4 * params * tokens,
    since frozen weights get no gradient (the forward and the activations' gradients;
    the adapters' own FLOPs are left out, under 1% at rank 16)."""
    h, layers, inter, vocab = (
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
    )
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter
    params = layers * per_layer + h * vocab
    tokens, squares = float(lengths.sum()), float((lengths.astype(np.float64) ** 2).sum())
    return (4.0 if frozen_base else 6.0) * params * tokens + 12.0 * layers * h * squares


def attention_kernel(args, engine) -> str:
    """The attention kernel that ran: torch's ``polyrl_varlen`` kernels by their call
    counts, the JAX backend's cuDNN/XLA choice (with XLA's reason when cuDNN was wanted),
    else the ``--attn`` name given to transformers."""
    torch_attn = sys.modules.get("polyrl.backends.torch_fsdp.attention")
    if torch_attn is not None and torch_attn.kernel_calls:
        return ",".join(sorted(torch_attn.kernel_calls))
    jax_attn = sys.modules.get("polyrl.backends.jax_pjit.attention")
    if jax_attn is not None and engine is not None:
        if jax_attn.fallbacks:
            return "xla (" + "; ".join(jax_attn.fallbacks) + ")"
        return "xla" if engine.attention == "xla" else "cudnn"
    return args.attn


def hf_torch_step(args, path: Path, batch: Batch):
    """The hand-written reference: a transformers model on one device, HF's own
    cross-entropy over the response tokens, AdamW (fused on GPU). Returns step()."""
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
    ).to(device)
    mask = torch.from_numpy(batch["attention_mask"]).long().to(device)
    model.config.use_cache = False
    model.train()  # from_pretrained returns eval mode, where HF skips checkpointing
    if args.grad_ckpt:
        if args.ckpt_policy == "budget":
            raise SystemExit("hf_torch has no 'budget' checkpointing (a polyrl policy)")
        kwargs = {"use_reentrant": False}
        if args.ckpt_policy == "selective":  # torch's SAC, with the backend's policy
            from polyrl.backends.torch_fsdp.recompute import selective_contexts

            kwargs["context_fn"] = selective_contexts
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device == "cuda")
    ids = torch.from_numpy(batch["input_ids"]).long().to(device)
    labels = torch.full_like(ids, -100)  # the loss covers the real response tokens
    response = torch.from_numpy(batch["response_mask"]).bool().to(device)
    labels[:, -response.shape[1] :][response] = ids[:, -response.shape[1] :][response]
    rows = args.micro_batch

    def step() -> dict:
        for i in range(0, len(ids), rows):
            part = slice(i, i + rows)
            loss = model(input_ids=ids[part], attention_mask=mask[part], labels=labels[part]).loss
            (loss * len(ids[i : i + rows]) / len(ids)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {"loss": loss.item()}  # .item() synchronises

    return step


def lora_config(args) -> LoraConfig | None:
    """``--lora``: adapters of ``--lora-rank`` (alpha = 2 x rank) on ``--lora-targets``."""
    if not args.lora:
        return None
    targets = tuple(args.lora_targets.split(","))
    return LoraConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank, target_modules=targets)


def run(args) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    mesh = {"fsdp": world}
    if args.mesh:
        mesh = {k: int(v) for k, v in (kv.split("=") for kv in args.mesh.split(","))}
    budget = args.memory_budget if args.grad_ckpt and args.ckpt_policy == "budget" else None
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be a multiple of WORLD_SIZE={world}")
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(args, Path(os.environ.get("POLYRL_BENCH_DIR", tmp)))
        config = json.loads((path / "config.json").read_text())
        batch = make_batch(
            args.batch, args.prompt_len, args.response_len, config["vocab_size"], 0, args.ragged
        )
        engine = None
        if args.backend == "hf_torch":
            step = hf_torch_step(args, path, batch)
        else:
            engine = get_engine(args.backend)()
            engine.init(
                ModelConfig(
                    str(path),
                    dtype=args.dtype,
                    gradient_checkpointing=args.grad_ckpt,
                    checkpoint_policy=args.ckpt_policy,
                    activation_memory_budget=args.memory_budget,
                    attn_implementation=args.attn,
                    compile=args.compile,
                    lora=lora_config(args),
                ),
                OptimConfig(lr=1e-5),
                ParallelConfig(
                    mesh=mesh,
                    micro_batch_size=args.micro_batch,
                    cpu_offload=args.cpu_offload,
                    max_tokens_per_micro_batch=args.max_tokens,
                    logits_chunk_tokens=args.logits_chunk,
                    pack_sequences=args.pack,
                ),
            )
            local = args.batch // world
            shard = batch.take(slice(rank * local, (rank + 1) * local))
            if args.split:  # the Tinker API's step: forward_backward, then optim_step
                optim = OptimConfig(lr=1e-5)

                def step() -> dict:
                    out = engine.forward_backward(shard, nll_loss)
                    del out["log_probs"]
                    return {**out, **engine.optim_step(optim)}

            else:
                step = lambda: engine.train_step(shard, nll_loss)  # noqa: E731
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        metrics = step()  # returns host floats: synchronised
        times.append(time.perf_counter() - start)
    step_s = float(np.median(times))
    profiled = None
    if args.profile:
        framework = "jax" if args.backend.startswith("jax") else "torch"
        profiled = profile_call(framework, args.profile, f"rank{rank}", step)
    lengths = batch["attention_mask"].sum(1)
    tokens = int(lengths.sum())  # real tokens: padding is not work
    device, peak = accelerator()
    flops = train_flops(config, lengths, frozen_base=args.lora)
    result = {
        "backend": args.backend,
        "device": device,
        "world_size": world,
        "mesh": mesh,
        "model": {k: config[k] for k in SHAPE_KEYS},
        "dtype": args.dtype,
        "grad_ckpt": args.grad_ckpt,
        "ckpt_policy": args.ckpt_policy if args.grad_ckpt else None,
        "batch": args.batch,
        "micro_batch": args.micro_batch,
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "max_tokens_per_micro_batch": args.max_tokens,
        "attn_implementation": args.attn,
        "attention_kernel": attention_kernel(args, engine),
        "pack_sequences": args.pack,
        "compile": args.compile,
        "memory_budget": budget,
        "lora": None if not args.lora else {"rank": args.lora_rank, "targets": args.lora_targets},
        "trained_params": trained_params(engine),
        "ragged": args.ragged,
        "split": args.split,
        "real_tokens": tokens,
        "padded_tokens": int(batch["attention_mask"].size),
        "xla_allocator": os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR"),
        "step_s_median": step_s,
        "step_s_all": times,
        "tokens_per_s": tokens / step_s,
        "train_tflops_per_s": flops / step_s / 1e12,
        "mfu": flops / step_s / (peak * 1e12 * world) if peak else None,
        "last_loss": metrics["loss"],
        **peak_memory(),
    }
    if profiled is not None:
        result["profile"] = profiled
        if rank == 0:
            print("\n".join(format_top(profiled, f"{args.backend}: top ops")), file=sys.stderr)
    return result


def trained_params(engine) -> int | None:
    """Parameters the optimizer updates (all of them, or LoRA's adapters); None for hf_torch."""
    if engine is None:
        return None
    if hasattr(engine, "opt_state"):  # jax_pjit: the trained parameter dict
        return int(sum(np.prod(v.shape) for v in engine.params.values()))
    return int(sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"]))


def suite(args, argv: list[str]) -> dict:
    """Run each backend of ``--suite`` in its own process on the same arguments; a table."""
    child_argv, skip = [], False
    for a in argv:  # the same flags minus --suite/--json
        if skip:
            skip = False
        elif a in ("--suite", "--json", "--profile"):
            skip = True
        elif not a.startswith(("--suite=", "--json=", "--profile=")):
            child_argv.append(a)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        shared = os.environ.get("POLYRL_BENCH_DIR", tmp)  # the model is built once
        for entry in args.suite.split(","):
            name, *flags = entry.split("+")
            budget = [f for f in flags if f.startswith("budget=")]
            flags = [f for f in flags if f not in budget]
            if set(flags) - {"pack", "compile", "lora", "split"}:
                raise SystemExit(
                    f"--suite entry {entry!r}: flags after '+' are pack, compile, lora, split, "
                    "budget=F"
                )
            name, _, attn = name.partition("@")
            name, _, allocator = name.partition(":")
            out = Path(tmp) / f"{len(runs)}.json"
            env = {**os.environ, "POLYRL_BENCH_DIR": shared}
            if allocator:
                env["XLA_PYTHON_CLIENT_ALLOCATOR"] = allocator
            extra = ["--attn", attn] * bool(attn) + [f"--{flag}" for flag in flags]
            for b in budget:  # the compiler's (torch) or the layers' (JAX) budget
                extra += ["--grad-ckpt", "--ckpt-policy", "budget", "--memory-budget", b[7:]]
            cmd = [sys.executable, __file__, *child_argv, *extra, "--backend", name]
            cmd += ["--json", str(out)]
            if args.profile:
                cmd += ["--profile", str(Path(args.profile) / re.sub(r"[:@+]", "_", entry))]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode or not out.exists():
                runs.append({"backend": entry, "error": proc.stderr[-2000:]})
            else:
                runs.append({**json.loads(out.read_text()), "backend": entry})
    ref = next((r for r in runs if r["backend"] == "hf_torch" and "error" not in r), None)
    width = max(14, *(len(r["backend"]) for r in runs))
    lines = [
        f"{'backend':<{width}} {'tokens/s':>10} {'MFU':>6} {'step s':>7} {'peak GiB':>9} "
        f"{'vs hf_torch':>12} {'ckpt':>9} {'trained':>9}  attention"
    ]
    for r in runs:
        if "error" in r:
            lines.append(f"{r['backend']:<{width}} FAILED: {r['error'].strip().splitlines()[-1:]}")
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        vs = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else "-"
        peak = r.get("device_peak_gib", r["host_peak_rss_gib"])
        lines.append(
            f"{r['backend']:<{width}} {r['tokens_per_s']:>10.0f} {mfu:>6} {r['step_s_median']:>7.3f} "
            f"{peak:>9.1f} {vs:>12} {_ckpt(r):>9} "
            f"{_millions(r.get('trained_params')):>9}  {r.get('attention_kernel', '-')}"
        )
    for r in runs:
        if "profile" in r:
            lines += format_top(r["profile"], f"{r['backend']}: top ops")
    print("\n".join(lines))
    return {"runs": runs, "reference": "hf_torch", "table": lines}


def _ckpt(run: dict) -> str:
    """What a run recomputes: its checkpoint policy, or the compiler's memory budget."""
    if run.get("ckpt_policy") == "budget":
        return f"budget {run['memory_budget']:g}"
    return run.get("ckpt_policy") or "-"


def _millions(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.1f}M"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    result = suite(args, argv) if args.suite else run(args)
    if int(os.environ.get("RANK", "0")) == 0:
        if not args.suite:
            print(json.dumps(result, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
