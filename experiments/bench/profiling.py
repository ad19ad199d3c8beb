"""``--profile DIR`` for the benchmarks: a profiler trace of one measured step and a
short table of where its time goes.

- torch / jax: the framework's profiler around one call (:func:`profile_call`) or inside
  Ray actors (:func:`profile_actors`), by ``polyrl.observe.profiler`` (what each writes, and how
  its table is made).
- phases: a ``polyrl train`` run's ``timeline.json`` (``polyrl.observe.timeline``: each phase of
  each role as spans), copied to ``DIR``, with each phase's share of the traced steps.

Traces are of one step, so they stay a few MB and come back from a lent GPU machine.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from polyrl.observe import profiler
from polyrl.observe.profiler import summary

__all__ = ["profile_call", "profile_actors", "phase_table", "format_top"]


def profile_call(framework: str, out_dir: str | Path, name: str, fn: Callable[[], Any]) -> dict:
    """Run ``fn()`` once under ``framework``'s profiler ("torch" or "jax"); the trace goes
    under ``out_dir``. Returns ``{"trace": path, "wall_s": s, "top": [{name, ms, share}]}``
    (share: of the profiled call's wall time)."""
    recording = profiler.start(framework, out_dir, name)
    try:
        fn()
    finally:
        result = recording.stop()
    return result


def _torch_start(actor: Any, out_dir: str, name: str) -> None:
    """Inside a Ray actor (``__ray_call__``): start torch.profiler in its process."""
    actor._bench_profile = profiler.start("torch", out_dir, name)


def _torch_stop(actor: Any) -> dict:
    """Inside the actor: stop the profiler and write its trace; its summary."""
    return actor._bench_profile.stop()


def profile_actors(actors: list, out_dir: str | Path, name: str, fn: Callable[[], Any]) -> dict:
    """Run ``fn()`` with torch.profiler running inside each Ray actor of ``actors`` (e.g.
    rollout servers: with the in-process engine that is where vLLM runs); one trace per
    actor (``DIR/<name>_<i>.pt.trace.json.gz``, written on the actor's node), the table
    of the first."""
    import sys

    import ray
    from ray import cloudpickle

    # The actors cannot import this script's directory: send these functions by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = [f"{name}_{i}" for i in range(len(actors))]
    ray.get([a.__ray_call__.remote(_torch_start, str(out), n) for a, n in zip(actors, names)])
    try:
        fn()
    finally:
        got = ray.get([a.__ray_call__.remote(_torch_stop) for a in actors])
    return got[0]


def phase_table(
    timeline: str | Path, out_dir: str | Path, skip_steps: int = 1, last_step: int | None = None
) -> dict:
    """Copy a run's ``timeline.json`` to ``out_dir`` and sum its phase spans over the steps
    after the first ``skip_steps`` up to ``last_step`` (None: the last one) (share: of
    those steps' wall time, first span to last)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = Path(timeline).read_text().rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    # Phase spans carry their step; worker-level spans (no step) stay in the trace only.
    steps = [(e, (e.get("args") or {}).get("step")) for e in events if e.get("ph") == "X"]
    end = float("inf") if last_step is None else last_step
    spans = [e for e, step in steps if isinstance(step, int) and skip_steps < step <= end]
    trace = out / "timeline.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump(events, f)
    if not spans:
        return summary(trace, 1.0, {}, outside=False)
    wall = (max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)) / 1e6
    sums: dict[str, float] = {}
    for e in spans:  # phases of different roles may overlap: no "outside" share
        sums[e["name"]] = sums.get(e["name"], 0.0) + e["dur"] / 1e3
    return summary(trace, wall, sums, outside=False)


def format_top(profile: dict, what: str = "op") -> list[str]:
    """The table printed under a benchmark's own: top entries by time, with shares."""
    lines = [
        f"profile: {profile['trace']} ({profile.get('trace_mb', 0):.1f} MB, "
        f"{profile['wall_s']:.3f} s traced)",
        f"  {what:<48} {'ms':>10} {'share':>7}",
    ]
    for row in profile["top"]:
        lines.append(f"  {row['name'][:48]:<48} {row['ms']:>10.2f} {100 * row['share']:>6.1f}%")
    if "outside_share" in profile:
        share = profile["outside_share"]
        lines.append(
            f"  {'(outside every op: Python, Ray, waits / GPU idle)':<48} "
            f"{1e3 * share * profile['wall_s']:>10.2f} {100 * share:>6.1f}%"
        )
    return lines
