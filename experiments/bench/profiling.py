"""``--profile DIR`` for the benchmarks: a profiler trace of one measured step and a
short table of where its time goes.

- torch: ``torch.profiler`` (CPU, and CUDA kernels on GPU) -> ``DIR/<name>.pt.trace.json.gz``
  (Chrome trace: https://ui.perfetto.dev or chrome://tracing); the table is the top ops
  by self time on the device (GPU) or the host (CPU), from the profiler's own averages.
- jax: ``jax.profiler.trace`` -> ``DIR/<name>/plugins/profile/<run>/`` with
  ``*.xplane.pb`` (TensorBoard's profile plugin; dropped above 16 MB) and
  ``perfetto_trace.json.gz``
  (ui.perfetto.dev); the table sums the trace's op spans on the device (GPU) or on XLA's
  host threads (CPU) by name.
- phases: a ``polyrl train`` run's ``timeline.json`` (``polyrl.timeline``: each phase of
  each role as spans), copied to ``DIR``, with each phase's share of the traced steps.

Traces are of one step, so they stay a few MB and come back from a lent GPU machine.
"""

from __future__ import annotations

import gzip
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["profile_call", "profile_actors", "phase_table", "format_top"]

TOP = 15
MAX_XPLANE_MB = 16


def profile_call(framework: str, out_dir: str | Path, name: str, fn: Callable[[], Any]) -> dict:
    """Run ``fn()`` once under ``framework``'s profiler ("torch" or "jax"); the trace goes
    under ``out_dir``. Returns ``{"trace": path, "wall_s": s, "top": [{name, ms, share}]}``
    (share: of the profiled call's wall time)."""
    import time

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if framework == "jax":
        import jax

        t0 = time.perf_counter()
        with jax.profiler.trace(str(out / name), create_perfetto_trace=True):
            fn()
        wall = time.perf_counter() - t0
        trace = max((out / name).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
        ops = _jax_ops(trace)
        for xplane in trace.parent.glob("*.xplane.pb"):  # the same events, TensorBoard's format
            if xplane.stat().st_size > MAX_XPLANE_MB * 1e6:
                xplane.unlink()  # too big to bring back from a lent machine: keep the perfetto one
    else:
        import torch
        from torch.profiler import ProfilerActivity, profile

        cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        raw = out / f"{name}.pt.trace.json"
        prof.export_chrome_trace(str(raw))
        trace = raw.with_suffix(".json.gz")
        with raw.open("rb") as src, gzip.open(trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        attr = "self_device_time_total" if cuda else "self_cpu_time_total"
        ops = {e.key: getattr(e, attr) / 1e3 for e in prof.key_averages()}
    return _summary(trace, wall, ops, outside=True)


def _torch_start(actor: Any) -> None:
    """Inside a Ray actor (``__ray_call__``): start torch.profiler in its process."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    actor._bench_profile = profile(activities=activities)
    actor._bench_profile.__enter__()
    actor._bench_profile_t0 = time.perf_counter()


def _torch_stop(actor: Any, path: str) -> dict:
    """Inside the actor: stop the profiler, write its gzipped Chrome trace to ``path``,
    return the wall time and each op's self time (device on GPU, else host)."""
    import time

    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - actor._bench_profile_t0
    prof = actor._bench_profile
    prof.__exit__(None, None, None)
    raw = Path(path)
    prof.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(raw.with_suffix(".json.gz"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    return {"wall": wall, "ops": {e.key: getattr(e, attr) / 1e3 for e in prof.key_averages()}}


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
    ray.get([a.__ray_call__.remote(_torch_start) for a in actors])
    try:
        fn()
    finally:
        paths = [out / f"{name}_{i}.pt.trace.json" for i in range(len(actors))]
        got = ray.get([a.__ray_call__.remote(_torch_stop, str(p)) for a, p in zip(actors, paths)])
    return _summary(paths[0].with_suffix(".json.gz"), got[0]["wall"], got[0]["ops"], outside=True)


def _summary(trace: Path, wall: float, ms: dict[str, float], outside: bool) -> dict:
    """The top entries of ``ms`` (name -> milliseconds) with shares of ``wall``; with
    ``outside``, also the share of the wall time in no entry at all (entries that do not
    overlap: self times, or one device's kernels): host Python, Ray and waits, or an idle
    GPU."""
    top = sorted(ms.items(), key=lambda kv: -kv[1])[:TOP]
    out = {
        "trace": str(trace),
        "trace_mb": trace.stat().st_size / 1e6,
        "wall_s": wall,
        "top": [{"name": n, "ms": v, "share": v / 1e3 / wall} for n, v in top],
    }
    if outside:
        out["outside_share"] = max(0.0, 1 - sum(ms.values()) / 1e3 / wall)
    return out


def _jax_ops(trace: Path) -> dict[str, float]:
    """Op spans summed by name on the GPU streams (or, on CPU, XLA's host threads)."""
    with gzip.open(trace) as f:
        data = json.loads(f.read())
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {
        (e.get("pid"), e.get("tid")): e["args"].get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    procs = {
        e.get("pid"): e["args"].get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    gpu = {pid for pid, n in procs.items() if "/device:GPU" in n}

    def ops(e: dict) -> bool:
        if gpu:
            return e.get("pid") in gpu and "Stream" in names.get((e.get("pid"), e.get("tid")), "")
        return "XLA" in names.get((e.get("pid"), e.get("tid")), "") or "Xla" in names.get(
            (e.get("pid"), e.get("tid")), ""
        )

    sums: dict[str, float] = {}
    for e in events:  # (XLA:CPU's ThunkExecutor spans wrap the ops: not ops themselves)
        if e.get("ph") == "X" and ops(e) and not e["name"].startswith("ThunkExecutor"):
            sums[e["name"]] = sums.get(e["name"], 0.0) + float(e.get("dur", 0)) / 1e3
    return sums


def phase_table(timeline: str | Path, out_dir: str | Path, skip_steps: int = 1) -> dict:
    """Copy a run's ``timeline.json`` to ``out_dir`` and sum its phase spans over the steps
    after the first ``skip_steps`` (share: of those steps' wall time, first span to last)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = Path(timeline).read_text().rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    # Phase spans carry their step; worker-level spans (no step) stay in the trace only.
    steps = [(e, (e.get("args") or {}).get("step")) for e in events if e.get("ph") == "X"]
    spans = [e for e, step in steps if isinstance(step, int) and step > skip_steps]
    trace = out / "timeline.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump(events, f)
    if not spans:
        return _summary(trace, 1.0, {}, outside=False)
    wall = (max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)) / 1e6
    sums: dict[str, float] = {}
    for e in spans:  # phases of different roles may overlap: no "outside" share
        sums[e["name"]] = sums.get(e["name"], 0.0) + e["dur"] / 1e3
    return _summary(trace, wall, sums, outside=False)


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
