"""Benchmark: the asynchronous mode's step time against its limit, in one run.

Runs the same experiment twice with ``polyrl train`` (each in its own process):
synchronous (``RunConfig.max_staleness = 0``), which measures generation alone
(``time/generate``) and training alone (the rest of the step), then asynchronous
(``max_staleness = --staleness``, default 1). The
one-step off-policy step cannot beat the longer of the two; the goal (issue 11) is an
async step <= 1.1x that limit. Steady state: the median over steps >= ``--skip``.

Prints a table, then one JSON object (also written to --out)::

    # 2 x H200: rollout on GPU 1, actor + reference on GPU 0
    python experiments/bench/async_step.py --gin_param "polyrl.RunConfig.model_path = '/tmp/models/qwen2-0.5b-random'"
    # CPU smoke test on the tiny model (2 cores: generation and training share them)
    python experiments/bench/async_step.py --gin gin/experiments/tiny_grpo.gin --steps 6

``--profile DIR`` keeps both runs' ``timeline.json`` (every phase of every role as spans;
ui.perfetto.dev) under DIR and prints each phase's share of the measured steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step import rollout_limits  # noqa: E402
from profiling import format_top, phase_table  # noqa: E402


def run(gin: str, params: list[str], run_dir: Path, staleness: int, steps: int) -> list[dict]:
    bindings = [
        *params,
        f"polyrl.RunConfig.run_dir = '{run_dir}'",
        f"polyrl.RunConfig.total_steps = {steps}",
        f"polyrl.RunConfig.async_rollout = {staleness > 0}",
        f"polyrl.RunConfig.max_staleness = {staleness}",
        "polyrl.RunConfig.tensorboard = False",
    ]
    cmd = [sys.executable, "-m", "polyrl.cli", "train", "--gin_file", gin]
    for b in bindings:
        cmd += ["--gin_param", b]
    subprocess.run(cmd, check=True)
    from polyrl.loop.metrics import read_jsonl

    return read_jsonl(run_dir / "metrics.jsonl")


def median(rows: list[dict], key: str, skip: int) -> float:
    return statistics.median(r[key] for r in rows[skip:])


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gin", default="gin/experiments/gpu_grpo_0p5b_async.gin")
    p.add_argument("--gin_param", action="append", default=[])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument(
        "--staleness", type=int, default=1, help="RunConfig.max_staleness of the async run"
    )
    p.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the medians")
    p.add_argument("--work", default="runs/bench_async_step")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", metavar="DIR", help="keep both runs' timeline traces here")
    args = p.parse_args()
    work = Path(args.work)
    sync = run(args.gin, args.gin_param, work / "sync", 0, args.steps)
    ahead = run(args.gin, args.gin_param, work / "async", args.staleness, args.steps)
    gen = median(sync, "time/generate", args.skip)
    train = statistics.median(r["time/step"] - r["time/generate"] for r in sync[args.skip :])
    step_sync, step_async = (
        median(sync, "time/step", args.skip),
        median(ahead, "time/step", args.skip),
    )
    limit = max(gen, train)
    hidden = [r["async/generate_s"] - r["async/wait_s"] for r in ahead if "async/wait_s" in r]
    result = {
        "gin": args.gin,
        "gin_params": args.gin_param,
        "steps": args.steps,
        "skip": args.skip,
        "sync": {"step_s": step_sync, "generate_s": gen, "train_s": train},
        "async": {
            "step_s": step_async,
            "generate_ahead_s": median(ahead[:-1], "async/generate_s", args.skip),
            "hidden_s": statistics.median(hidden[args.skip :]) if hidden[args.skip :] else None,
            "staleness_mean": median(ahead, "rollout/staleness_mean", args.skip),
        },
        "limit_s": limit,
        "async_over_limit": step_async / limit,
        # the rollout engines' scheduler limits (step 1's row), each run's
        "rollout_limits": {
            name: rollout_limits(next(r for r in rows if "time/step" in r))
            for name, rows in (("sync", sync), ("async", ahead))
        },
        "goal": 1.1,
        "meets_goal": step_async / limit <= 1.1,
    }
    print(f"{'':<28}{'seconds':>10}")
    for label, value in (
        ("sync step", step_sync),
        ("  generation alone", gen),
        ("  training alone (rest)", train),
        ("limit = max(gen, train)", limit),
        ("async step", step_async),
    ):
        print(f"{label:<28}{value:>10.2f}")
    print(f"async / limit = {step_async / limit:.3f} (goal <= 1.1)")
    print(f"rollout limits: {result['rollout_limits']}")
    if args.profile:  # where each run's step went, phase by phase (sync's phases run in turn)
        for name in ("sync", "async"):
            prof = phase_table(work / name / "timeline.json", Path(args.profile) / name, args.skip)
            result[f"profile_{name}"] = prof
            print("\n".join(format_top(prof, f"{name} run: phase or worker call (all tracks)")))
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
