"""Cost of the three-way log-prob check (``RunConfig.shadow_every``, docs/diagnosis.md)
per training step: one run with the check every ``--every`` steps, read from its
metrics.jsonl. Not a test; a table on stdout and ``--json``.

    python experiments/bench/shadow_cost.py                      # tiny GRPO on CPU, 30 steps
    python experiments/bench/shadow_cost.py --gin gin/experiments/gpu_grpo_0p5b.gin --steps 30

The check's time is its own phase (``time/shadow``: weights to the shadow engine, its
forward, the metrics and the dumps), so one run gives both numbers: the steps without a
check (their median) and each check. Cost per step = total check time / steps, as a
share of the median step without a check (the goal is <= 3% at every 10 steps). The
first check is shown apart: it pays the shadow engine's first compile (JAX) or warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from polyrl.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gin", default="gin/experiments/tiny_grpo.gin")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--gin_param", action="append", default=[], help="more bindings")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="shadowcost-") as tmp:
        cmd = [sys.executable, "-m", "polyrl.cli", "train", "--gin_file", args.gin]
        for binding in (
            f"polyrl.RunConfig.run_dir = {str(Path(tmp, 'run'))!r}",
            f"polyrl.RunConfig.total_steps = {args.steps}",
            f"polyrl.RunConfig.shadow_every = {args.every}",
            "polyrl.RunConfig.tensorboard = False",
            *args.gin_param,
        ):
            cmd += ["--gin_param", binding]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        rows = read_jsonl(Path(tmp, "run", "metrics.jsonl"))
    checks = [r["time/shadow"] for r in rows if "time/shadow" in r]
    plain = [r["time/step"] for r in rows if "time/shadow" not in r][1:]  # step 1 warms up
    step_s = statistics.median(plain)
    warm = checks[1:] or checks
    out = {
        "gin": args.gin,
        "steps": args.steps,
        "every": args.every,
        "step_s_median_without_check": step_s,
        "checks": len(checks),
        "check_s_each": checks,
        "check_s_first": checks[0],
        "check_s_warm_median": statistics.median(warm),
        # every check at the warm median, spread over the steps
        "cost_per_step_s": statistics.median(warm) / args.every,
    }
    out["cost_pct_of_step"] = 100 * out["cost_per_step_s"] / step_s
    out["cost_pct_with_first_check"] = 100 * sum(checks) / len(rows) / step_s
    width = max(len(k) for k in out)
    for key, value in out.items():
        shown = [round(v, 3) for v in value] if isinstance(value, list) else value
        print(
            f"{key:<{width}}  {shown:.3f}"
            if isinstance(shown, float)
            else f"{key:<{width}}  {shown}"
        )
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
