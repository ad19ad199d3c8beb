"""Benchmark: wall time of the same sweep with 1 and with 2 trials at a time.

Runs ``polyrl sweep`` on gin/sweeps/tiny_grpo_lr.gin (four learning rates, 16 steps,
one CPU per trial) without early stopping, once with
``SweepConfig.max_concurrent_trials = 1`` and once with 0 (as many as the cluster holds:
two on a 2-core machine), prints a table and writes JSON to --out.

    python experiments/bench/sweep_concurrency.py --out runs/bench_sweep.json
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(concurrent: int, work: Path) -> dict:
    root = work / f"concurrent_{concurrent}"
    cmd = [sys.executable, "-m", "polyrl.cli", "sweep"]
    cmd += ["--gin_file", "gin/sweeps/tiny_grpo_lr.gin"]
    for binding in (
        f"polyrl.RunConfig.run_dir = {str(root)!r}",
        'polyrl.SweepConfig.scheduler = "fifo"',
        f"polyrl.SweepConfig.max_concurrent_trials = {concurrent}",
    ):
        cmd += ["--gin_param", binding]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rows = list(csv.DictReader((root / "results.csv").open()))
    return {
        "max_concurrent_trials": concurrent or "cluster (2)",
        "trials": len(rows),
        "steps": sum(int(r["steps"]) for r in rows),
        "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/bench_sweep_concurrency.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="polyrl-sweep-bench-") as work:
        results = [run(1, Path(work)), run(0, Path(work))]
    print(f"{'trials at once':<16} {'trials':>6} {'steps':>6} {'wall s':>8}")
    for r in results:
        print(
            f"{r['max_concurrent_trials']!s:<16} {r['trials']:>6} {r['steps']:>6} {r['wall_s']:>8}"
        )
    print(f"speed-up: {results[0]['wall_s'] / results[1]['wall_s']:.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
