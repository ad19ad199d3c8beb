"""Benchmark: what the per-worker timeline costs (docs/debugging.md "The timeline").

Two numbers, on real Ray actors built like polyrl's role workers (``polyrl.observe.timeline.Traced``
with a ``polyrl.observe.debug.place`` method, as EngineWorker, RewardWorker, RolloutServer):

- the cost ``place`` adds to one role method call (it records a span: two clock reads
  and a tuple appended), against the same method undecorated, in the worker;
- the driver's ``Timeline.flush()`` at a step's end: ask every worker for its spans and
  append them to the file, with every worker idle, and with one worker busy (a rollout
  server generating ahead: the flush does not wait for it).

Prints a table, then one JSON object (also written to --out)::

    python experiments/bench/timeline_overhead.py --workers 6 --calls 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from polyrl.observe.debug import place
from polyrl.observe.timeline import Timeline, Traced


class Worker(Traced):
    @place("forward")
    def forward(self, seconds: float) -> None:
        time.sleep(seconds)

    def raw(self, seconds: float) -> None:
        time.sleep(seconds)

    def call_cost(self, n: int) -> dict[str, float]:
        """Median seconds of a no-op method call, with and without ``place``."""

        def median(f) -> float:
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                f(0.0)
                times.append(time.perf_counter() - t0)
            return statistics.median(times)

        out = {"placed": median(self.forward), "raw": median(self.raw)}
        self.spans()  # forget the no-op spans
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=6, help="role workers (actors)")
    ap.add_argument("--calls", type=int, default=20, help="method calls per worker per step")
    ap.add_argument("--steps", type=int, default=20, help="flushes timed")
    ap.add_argument("--out", default="timeline_overhead.json")
    args = ap.parse_args()
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    workers = [ray.remote(Worker).options(num_cpus=0).remote() for _ in range(args.workers)]
    cost = ray.get(workers[0].call_cost.remote(20_000))
    with tempfile.TemporaryDirectory() as tmp:
        timeline = Timeline(
            Path(tmp) / "timeline.json", lambda: [("actor", i, w) for i, w in enumerate(workers)]
        )

        def flushes(busy: bool) -> list[float]:
            times = []
            for _ in range(args.steps):
                ray.get([w.forward.remote(0.0) for w in workers for _ in range(args.calls)])
                if busy:  # worker 0 generates ahead while the driver flushes
                    ahead = workers[0].forward.remote(0.2)
                t0 = time.perf_counter()
                timeline.flush()
                times.append(time.perf_counter() - t0)
                if busy:
                    ray.get(ahead)
            return times

        idle, busy = flushes(False), flushes(True)
        timeline.close()
        events = json.loads((Path(tmp) / "timeline.json").read_text())
    spans = sum(e["ph"] == "X" for e in events)
    result = {
        "workers": args.workers,
        "calls_per_step": args.calls * args.workers,
        "place_overhead_us": (cost["placed"] - cost["raw"]) * 1e6,
        "flush_idle_ms_median": statistics.median(idle) * 1e3,
        "flush_busy_ms_median": statistics.median(busy) * 1e3,
        "spans_written": spans,
        "spans_expected": 2 * args.steps * args.calls * args.workers + args.steps,
    }
    print(f"{'measure':<36}{'value':>12}")
    print(f"{'place() per call (us, in the worker)':<36}{result['place_overhead_us']:>12.2f}")
    print(f"{'flush, all idle (ms, median)':<36}{result['flush_idle_ms_median']:>12.2f}")
    print(f"{'flush, one busy (ms, median)':<36}{result['flush_busy_ms_median']:>12.2f}")
    print(f"{'spans written / expected':<36}{spans:>6} / {result['spans_expected']}")
    print(json.dumps(result))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    ray.shutdown()


if __name__ == "__main__":
    main()
