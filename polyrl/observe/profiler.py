"""Op-level traces with a framework's own profiler, and the table of where their time goes.

- ``"torch"``: ``torch.profiler`` (host ops, and CUDA kernels on GPU) ->
  ``DIR/<name>.pt.trace.json.gz`` (Chrome trace: https://ui.perfetto.dev); the table is
  each op's self time on the device (GPU) or the host (CPU), from the profiler's averages.
- ``"jax"``: ``jax.profiler`` -> ``DIR/<name>/plugins/profile/<run>/`` with
  ``perfetto_trace.json.gz`` (ui.perfetto.dev) and ``*.xplane.pb`` (TensorBoard's profile
  plugin; dropped above 16 MB); the table sums the trace's op spans on the GPU streams
  (or, on CPU, XLA's host threads) by name.

``RunConfig.profile_steps`` records the trainer roles' workers through whole steps with
this (``polyrl.loop.trainer``, ``EngineWorker.profile_start``); the benchmarks'
``--profile`` records single calls (experiments/bench/profiling.py). Imports its
framework only when a recording starts.
"""

from __future__ import annotations

import gzip
import json
import shutil
import time
from pathlib import Path
from typing import Any

__all__ = ["FRAMEWORKS", "Recording", "start", "summary"]

FRAMEWORKS = ("torch", "jax")
TOP = 15
MAX_XPLANE_MB = 16


def start(framework: str, out_dir: str | Path, name: str) -> Recording:
    """Start ``framework``'s profiler in this process; :meth:`Recording.stop` ends it and
    writes the trace under ``out_dir`` as ``name``."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"profiler: framework={framework!r} is not one of {list(FRAMEWORKS)}")
    return Recording(framework, Path(out_dir), name)


class Recording:
    """One running profiler (see :func:`start`)."""

    def __init__(self, framework: str, out_dir: Path, name: str):
        self.framework, self.out, self.name = framework, out_dir, name
        self.out.mkdir(parents=True, exist_ok=True)
        if framework == "jax":
            import jax

            jax.profiler.start_trace(str(self.out / name), create_perfetto_trace=True)
        else:
            import torch
            from torch.profiler import ProfilerActivity, profile

            self.cuda = torch.cuda.is_available()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = profile(activities=activities)
            self.prof.__enter__()
        self.t0 = time.perf_counter()

    def stop(self) -> dict[str, Any]:
        """End the recording, write its trace; :func:`summary` of it. The wall time runs
        from the start to the stop (on a CUDA torch, to the end of the queued kernels; the
        calls recorded return host values, so JAX's work is done by then)."""
        if self.framework == "jax":
            import jax

            wall = time.perf_counter() - self.t0
            jax.profiler.stop_trace()
            trace = max(
                (self.out / self.name).rglob("perfetto_trace.json.gz"),
                key=lambda p: p.stat().st_mtime,
            )
            ops = _jax_ops(trace)
            for xplane in trace.parent.glob("*.xplane.pb"):  # the same events, TensorBoard's
                if xplane.stat().st_size > MAX_XPLANE_MB * 1e6:
                    xplane.unlink()  # too big to bring back from a lent machine
            return summary(trace, wall, ops, outside=True)
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        raw = self.out / f"{self.name}.pt.trace.json"
        self.prof.export_chrome_trace(str(raw))
        trace = raw.with_suffix(".json.gz")
        with raw.open("rb") as src, gzip.open(trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        return summary(trace, wall, _torch_ops(self.prof.key_averages(), self.cuda), outside=True)


def summary(trace: Path, wall: float, ms: dict[str, float], outside: bool) -> dict[str, Any]:
    """``{"trace", "trace_mb", "wall_s", "top": [{name, ms, share}]}``: the top entries of
    ``ms`` (name -> milliseconds) with shares of ``wall``; with ``outside``, also
    ``outside_share``, the share of the wall time in no entry (entries that do not overlap:
    self times, or one device's kernels): host Python, Ray and waits, or an idle GPU."""
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


def _torch_ops(averages, cuda: bool) -> dict[str, float]:
    """Milliseconds by name: on CUDA the device's own events (kernels, copies, memsets), as
    torch's table totals them (a CPU op's self device time is its kernels' time again, so
    counting both would count the GPU's work twice); on CPU the ops' self times."""
    if not cuda:
        return {e.key: e.self_cpu_time_total / 1e3 for e in averages}
    from torch.autograd import DeviceType

    return {
        e.key: e.self_device_time_total / 1e3 for e in averages if e.device_type != DeviceType.CPU
    }


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
        thread = names.get((e.get("pid"), e.get("tid")), "")
        if gpu:
            return e.get("pid") in gpu and "Stream" in thread
        return "XLA" in thread or "Xla" in thread

    sums: dict[str, float] = {}
    for e in events:  # (XLA:CPU's ThunkExecutor spans wrap the ops: not ops themselves)
        if e.get("ph") == "X" and ops(e) and not e["name"].startswith("ThunkExecutor"):
            sums[e["name"]] = sums.get(e["name"], 0.0) + float(e.get("dur", 0)) / 1e3
    return sums
