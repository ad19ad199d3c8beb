"""experiments/bench/profiling.py: the --profile traces of the benchmarks and their tables."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments" / "bench"))
from profiling import format_top, phase_table, profile_actors, profile_call  # noqa: E402


def test_phase_table_sums_the_measured_steps(tmp_path):
    def span(name, tid, ts, dur, step):
        return {"name": name, "ph": "X", "pid": 0, "tid": tid, "ts": ts, "dur": dur,
                "args": {"step": step}}  # fmt: skip

    events = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "rollout"}},
        span("generate", 0, 0, 5_000_000, 1),  # step 1: warm-up, left out
        span("generate", 0, 10_000_000, 2_000_000, 2),
        span("reference", 2, 12_000_000, 1_000_000, 2),  # at once with old_log_probs
        span("old_log_probs", 3, 12_000_000, 500_000, 2),
        span("update_actor", 3, 13_000_000, 1_000_000, 2),
        span("actor.sync_weights", 9, 14_000_000, 3_000_000, None),  # a worker's, no step
        span("generate", 0, 20_000_000, 9_000_000, 3),  # step 3: past last_step, left out
    ]
    # A running run's file: the array is not closed yet (polyrl.observe.timeline).
    path = tmp_path / "timeline.json"
    path.write_text("[\n" + ",\n".join(json.dumps(e) for e in events))
    prof = phase_table(path, tmp_path / "prof", skip_steps=1, last_step=2)
    # Step 2 spans 10 s .. 14 s: 4 s; generate 2 s = 50%.
    assert prof["wall_s"] == pytest.approx(4.0)
    assert [(r["name"], r["ms"]) for r in prof["top"]] == [
        ("generate", 2000.0),
        ("reference", 1000.0),
        ("update_actor", 1000.0),
        ("old_log_probs", 500.0),
    ]
    assert prof["top"][0]["share"] == pytest.approx(0.5)
    with gzip.open(prof["trace"], "rt") as f:
        assert json.load(f) == events
    assert "generate" in "\n".join(format_top(prof, "phase"))
    # Without last_step every step after the first counts: 10 s .. 29 s.
    everything = phase_table(path, tmp_path / "prof", skip_steps=1)
    assert everything["wall_s"] == pytest.approx(19.0)
    assert everything["top"][0] == {"name": "generate", "ms": 11000.0, "share": 11 / 19}


def test_torch_profile_names_the_matmul(tmp_path):
    import torch

    a = torch.randn(512, 512)
    prof = profile_call("torch", tmp_path, "mm", lambda: [a @ a for _ in range(20)])
    assert prof["top"][0]["name"] == "aten::mm"
    assert 0 < prof["top"][0]["share"] <= 1 and 0 <= prof["outside_share"] < 1
    with gzip.open(prof["trace"], "rt") as f:
        assert any(e.get("name") == "aten::mm" for e in json.load(f)["traceEvents"])


def test_cuda_op_times_count_each_kernel_once():
    """On CUDA a CPU op's self device time is its kernels' time again: the ops table sums
    to the GPU time that torch's own table totals, not twice that."""
    import re

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    from polyrl.observe.profiler import _torch_ops

    def event(i, name, start, end, device=DeviceType.CPU):
        return FunctionEvent(i, name, thread=0, start_us=start, end_us=end, use_device="cuda",
                             device_type=device, stack=[], input_shapes=[])  # fmt: skip

    mm = event(0, "aten::mm", 0, 100)
    mm.append_kernel("gemm_kernel", 0, 80)
    events = EventList(
        [mm, event(1, "gemm_kernel", 10, 90, DeviceType.CUDA), event(2, "aten::relu", 100, 130)],
        use_device="cuda",
    )
    events._build_tree()
    averages = events.key_averages()
    total_us = float(re.search(r"Self CUDA time total: ([\d.]+)us", averages.table())[1])
    ops = _torch_ops(averages, cuda=True)
    assert ops == {"gemm_kernel": pytest.approx(0.08)}
    assert sum(ops.values()) == pytest.approx(total_us / 1e3)


def test_jax_profile_writes_a_perfetto_trace(tmp_path):
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((256, 256))
    f(x).block_until_ready()
    prof = profile_call("jax", tmp_path, "step", lambda: f(x).block_until_ready())
    assert Path(prof["trace"]).name == "perfetto_trace.json.gz"
    assert prof["top"] and all(0 <= r["share"] <= 1 for r in prof["top"])


def test_profile_actors_traces_inside_the_actor(ray_session, tmp_path):
    """The ops run in the Ray actor's process, not here: the trace must hold them."""
    import ray

    class Matmuls:
        def run(self) -> int:
            import torch

            a = torch.randn(384, 384)
            for _ in range(20):
                a = torch.tanh(a @ a)
            return 1

    actor = ray.remote(num_cpus=0)(Matmuls).remote()
    try:
        prof = profile_actors([actor], tmp_path, "mm", lambda: ray.get(actor.run.remote()))
    finally:
        ray.kill(actor)
    assert {"aten::mm", "aten::tanh"} <= {r["name"] for r in prof["top"]}
    assert Path(prof["trace"]) == tmp_path.resolve() / "mm_0.pt.trace.json.gz"
    with gzip.open(prof["trace"], "rt") as f:
        assert any(e.get("name") == "aten::mm" for e in json.load(f)["traceEvents"])
