"""Wall-time cost of validation during training: the same experiment with and without
``RunConfig.eval_every``, compared from their metrics.jsonl. Not a test; a table on
stdout and ``--json``.

    python experiments/bench/validation_cost.py                    # the demo, twice
    python experiments/bench/validation_cost.py --steps 20 --json out.json

Runs ``gin/experiments/tiny_grpo.gin`` (no validation) and ``tiny_grpo_val.gin`` (64
held-out prompts every 10 steps) as two ``polyrl train`` processes, then reports the
steps' time, the validation time, how much of the first evaluation is vLLM's first-call
warm-up (that run's step-0 generate is shorter by it), the cost of validation (every
evaluation at the median time of the warm ones: the warm-up is paid with or without
validation, and comparing two runs' totals on a shared machine is noisier than the
cost itself), and whether the training metrics are identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from polyrl.loop.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
RUNS = {"plain": "gin/experiments/tiny_grpo.gin", "val": "gin/experiments/tiny_grpo_val.gin"}


def run(gin_file: str, run_dir: Path, steps: int) -> list[dict]:
    cmd = [sys.executable, "-m", "polyrl.cli", "train", "--gin_file", gin_file]
    for binding in (
        f"polyrl.RunConfig.run_dir = {str(run_dir)!r}",
        f"polyrl.RunConfig.total_steps = {steps}",
    ):
        cmd += ["--gin_param", binding]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return read_jsonl(run_dir / "metrics.jsonl")


def training(row: dict) -> dict:
    wall_clock = ("time/", "startup/", "sync/seconds")
    return {k: v for k, v in row.items() if not k.startswith(("val/", *wall_clock))}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="valcost-") as tmp:
        rows = {name: run(gin, Path(tmp, name), args.steps) for name, gin in RUNS.items()}
    plain, val = rows["plain"], rows["val"]
    evals = [r["time/validate"] for r in val if "time/validate" in r]
    warmup = plain[0]["time/generate"] - val[0]["time/generate"]
    out = {
        "steps": args.steps,
        "plain_step_s": sum(r["time/step"] for r in plain),
        "val_step_s": sum(r["time/step"] for r in val if "time/step" in r),
        "evaluations": len(evals),
        "validate_s": sum(evals),
        "first_validate_s": evals[0],
        "warmup_moved_s": warmup,
        "warm_validate_s_median": statistics.median(evals[1:] or evals),
        "validate_s_each": evals,
        "training_metrics_identical": [training(r) for r in val if "time/step" in r]
        == [training(r) for r in plain],
    }
    out["validation_cost_s"] = len(evals) * out["warm_validate_s_median"]
    out["validation_cost_pct"] = 100 * out["validation_cost_s"] / out["plain_step_s"]
    width = max(len(k) for k in out)
    for key, value in out.items():
        shown = [round(v, 3) for v in value] if isinstance(value, list) else value
        print(
            f"{key:<{width}}  {shown:.3f}"
            if isinstance(shown, float)
            else f"{key:<{width}}  {shown}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
