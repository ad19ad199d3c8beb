"""Cost of the three-way log-prob check (``RunConfig.shadow_every``, docs/diagnosis.md)
per training step: one run with the check every ``--every`` steps, read from its
metrics.jsonl. Not a test; a table on stdout and ``--json``.

    python experiments/bench/shadow_cost.py                      # tiny GRPO on CPU, 30 steps
    python experiments/bench/shadow_cost.py --gin gin/experiments/gpu_grpo_0p5b.gin --steps 30
    python experiments/bench/shadow_cost.py --repeats 5                  # mean and spread

The check's time is its own phase (``time/shadow``: weights to the shadow engine, its
forward, the metrics and the dumps), so one run gives both numbers: the steps without a
check (their median) and each check. Cost per step = the checks' median after the first
/ ``--every``, as a share of the median step without a check (the goal is <= 3% at every 10 steps); with
``--repeats`` its mean and spread over runs. The first check is shown apart: it pays
the shadow engine's first compile (JAX) or warm-up.
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


def one_run(args) -> dict:
    """One run with the check every ``--every`` steps: its step and check times."""
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
        # its progress lines to our stderr: a run cut by a time-out shows how far it got
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=sys.stderr)
        rows = read_jsonl(Path(tmp, "run", "metrics.jsonl"))
    checks = [r["time/shadow"] for r in rows if "time/shadow" in r]
    plain_rows = [r for r in rows if "time/shadow" not in r][1:]  # step 1 warms up
    plain = [r["time/step"] for r in plain_rows]
    step_s = statistics.median(plain)
    phases = sorted({k for r in plain_rows for k in r if k.startswith("time/")})
    warm = statistics.median(checks[1:] or checks)
    return {
        "step_s_median_without_check": step_s,
        "check_s_each": checks,
        "check_s_warm_median": warm,
        # each phase's median over the same steps (the step time's breakdown)
        "phases_s_median_without_check": {
            k[5:]: statistics.median(r[k] for r in plain_rows if k in r) for k in phases
        },
        # every check at the warm median, spread over the steps
        "cost_pct_of_step": 100 * warm / args.every / step_s,
        "cost_pct_with_first_check": 100 * sum(checks) / len(rows) / step_s,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gin", default="gin/experiments/tiny_grpo.gin")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--repeats", type=int, default=1, help="runs; mean and spread over them")
    p.add_argument("--gin_param", action="append", default=[], help="more bindings")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    runs = [one_run(args) for _ in range(args.repeats)]
    out: dict = {"gin": args.gin, "steps": args.steps, "every": args.every, "runs": runs}
    for key in ("step_s_median_without_check", "check_s_warm_median", "cost_pct_of_step"):
        values = [r[key] for r in runs]
        out[key + "_mean"] = statistics.fmean(values)
        out[key + "_stdev"] = statistics.stdev(values) if len(values) > 1 else 0.0
        out[key + "_range"] = [min(values), max(values)]
    out["check_s_first_each"] = [r["check_s_each"][0] for r in runs]
    for i, r in enumerate(runs, 1):
        print(
            f"run {i}: step {r['step_s_median_without_check']:.3f} s, check (warm median) "
            f"{r['check_s_warm_median']:.3f} s, first check {r['check_s_each'][0]:.2f} s, cost "
            f"{r['cost_pct_of_step']:.2f}% of a step at every {args.every}"
        )
        phases = r["phases_s_median_without_check"].items()
        print(
            "  phases (median s, steps without a check): "
            + ", ".join(f"{k} {v:.3f}" for k, v in phases)
        )
    print(
        f"cost per step at every {args.every}: {out['cost_pct_of_step_mean']:.2f}% "
        f"+- {out['cost_pct_of_step_stdev']:.2f} (mean +- stdev over {len(runs)} runs; "
        f"range {out['cost_pct_of_step_range'][0]:.2f}-{out['cost_pct_of_step_range'][1]:.2f})"
    )
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
