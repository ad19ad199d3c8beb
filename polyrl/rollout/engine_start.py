"""A server's engine start, safe against GPU memory that other processes release meanwhile.

vLLM sizes its KV cache from a memory profile: a snapshot of the device's free memory
when its worker starts, a dummy forward pass, then free memory again. It counts memory
that other processes hold as theirs to keep, and asserts that free memory did not grow
in between ("Error in memory profiling ... other processes sharing the same container
release GPU memory while vLLM is profiling", ``determine_available_memory`` of vLLM's
GPU worker). A run's own processes share the servers' GPUs while they start: the role
workers load and warm up side by side with the servers, and a run that just ended may
still be releasing its memory. Memory that they *take* meanwhile only shrinks the KV
cache; memory that they *release* fails the start.

:func:`start_engine` makes that overlap safe without giving it up (ordering the servers
after every worker would lengthen each start-up by the workers' start): it waits, at most
``QUIET_TIMEOUT_S``, until no process has released memory on the server's GPUs for
``QUIET_S``, starts the engine, and when the start failed while another process released
memory (vLLM's message says so, or the GPUs have more free memory once the failed engine
is gone than before it started), it cleans up, waits for quiet again and starts again, at
most ``RETRIES`` times, with one warning line each time (docs/rollout.md "Start-up").
"""

from __future__ import annotations

import gc
import logging
import os
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = [
    "RETRIES",
    "START_TIMES",
    "describe",
    "free_gpu_memory",
    "profiling_race",
    "release_failed_engine",
    "start_engine",
    "wait_quiet",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
GIB = 2**30
# vLLM's assertion text (vllm/v1/worker/gpu_worker.py), the same in 0.26 and 0.32
PROFILING_RACE = "release GPU memory while vLLM is profiling"
RETRIES = 2  # engine starts after the first, each after a release of memory by another process
QUIET_S = 0.5  # no release of GPU memory for this long before an engine starts
QUIET_TIMEOUT_S = 30.0  # then it starts anyway (a retry follows if the release hit it)
TOLERANCE = 128 * 2**20  # free memory moving less than this is no release
INTERVAL_S = 0.1
# what start_engine's ``record`` holds: seconds spent waiting for the GPUs' memory to
# settle, seconds in the engine's starts (each attempt's), and the number of attempts
START_TIMES = ("memory_wait_s", "engine_s", "engine_starts")


def free_gpu_memory() -> tuple[int, ...]:
    """Free bytes of each GPU this process sees (``CUDA_VISIBLE_DEVICES``), read with NVML,
    which creates no CUDA context; () where NVML cannot tell (no GPU, a MIG slice)."""
    try:
        try:
            from vllm.third_party import pynvml  # vLLM's own copy of NVIDIA's wrapper
        except ImportError:
            import pynvml
        pynvml.nvmlInit()
    except Exception:
        return ()
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            ids: Sequence[str] = [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        else:
            ids = [d.strip() for d in visible.split(",") if d.strip()]
        free = []
        for device in ids:
            if device.isdigit():
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(device))
            else:
                handle = pynvml.nvmlDeviceGetHandleByUUID(device)
            free.append(int(pynvml.nvmlDeviceGetMemoryInfo(handle).free))
        return tuple(free)
    except Exception:
        return ()
    finally:
        pynvml.nvmlShutdown()


def release_failed_engine() -> None:
    """Free what a failed engine left in this process: its objects and, where its worker
    ran here (an in-process engine core: this process holds a CUDA context), vLLM's
    distributed state and the GPU memory it cached."""
    gc.collect()
    import torch

    if torch.cuda.is_initialized():
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


def wait_quiet(
    read: Callable[[], tuple[int, ...]],
    quiet_s: float = QUIET_S,
    timeout_s: float = QUIET_TIMEOUT_S,
    interval_s: float = INTERVAL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[int, ...]:
    """Read the GPUs' free memory (``read``) until none has risen by more than
    ``TOLERANCE`` above its lowest reading for ``quiet_s``, at most ``timeout_s``;
    the last reading. Memory taken by others (free memory falling) does not delay it."""
    start = quiet_since = clock()
    low = last = read()
    while last and clock() - quiet_since < quiet_s and clock() - start < timeout_s:
        sleep(interval_s)
        last = read()
        if any(now > lowest + TOLERANCE for now, lowest in zip(last, low)):
            quiet_since, low = clock(), last
        else:
            low = tuple(map(min, low, last))
    return last


def profiling_race(error: BaseException | None) -> bool:
    """Whether ``error`` (or one it was raised from) is vLLM's failed memory profile."""
    while error is not None:
        if PROFILING_RACE in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def start_engine(
    build: Callable[[], T],
    read: Callable[[], tuple[int, ...]],
    name: str,
    cleanup: Callable[[], None] = release_failed_engine,
    retries: int = RETRIES,
    record: dict[str, float] | None = None,
    **quiet: Any,
) -> T:
    """``build()`` once no process releases memory on the GPUs (``read``); again, after
    ``cleanup()``, when it failed while another process released memory, at most
    ``retries`` more times (module docstring). ``name`` names the server in the warning
    lines; ``quiet``: :func:`wait_quiet`'s timings. ``record``: filled with where the
    start's time went (:data:`START_TIMES`), on the clock of ``quiet``."""
    clock = quiet.get("clock", time.monotonic)
    times = record if record is not None else {}
    times.update(dict.fromkeys(START_TIMES, 0.0))

    def timed(key: str, fn: Callable[[], Any]) -> Any:
        t0 = clock()
        try:
            return fn()
        finally:
            times[key] += clock() - t0

    attempt = 0
    while True:
        before = timed("memory_wait_s", lambda: wait_quiet(read, **quiet))
        times["engine_starts"] += 1
        try:
            return timed("engine_s", build)
        except Exception as e:
            failure = e
        # the failed engine's objects live on in its frames' locals until cleared
        traceback.clear_frames(failure.__traceback__)
        cleanup()
        after = timed("memory_wait_s", lambda: wait_quiet(read, **quiet))
        released, b, a = max(((a - b, b, a) for a, b in zip(after, before)), default=(0, 0, 0))
        if not (profiling_race(failure) or released > TOLERANCE):
            raise failure
        change = f" (free GPU memory {b / GIB:.2f} -> {a / GIB:.2f} GiB)" if a else ""
        attempt += 1
        if attempt > retries:
            raise RuntimeError(
                f"{name}: its engine failed to start {retries + 1} times while other processes "
                f"released GPU memory{change}, which vLLM's memory profiling does not allow. "
                "Check what else runs on the server's GPUs (nvidia-smi): a run that has "
                "not ended, or workers that free memory while they start"
            ) from failure
        logger.warning(
            "%s: the engine failed to start while another process freed GPU memory%s, "
            "which vLLM's memory profiling does not allow; "
            "retrying (%d/%d) once no process frees GPU memory for %.1f s",
            name,
            change,
            attempt,
            retries,
            quiet.get("quiet_s", QUIET_S),
        )


def describe(times: dict[str, float]) -> str:
    """``start_engine``'s ``record`` for the start-up line: the engine's start, its number
    of starts when it took more than one, and the wait for other processes' GPU memory."""
    parts = [f"vLLM engine {times['engine_s']:.1f} s"]
    if times["engine_starts"] > 1:
        parts.append(f"{int(times['engine_starts'])} starts")
    if times["memory_wait_s"] >= 0.05:
        parts.append(f"{times['memory_wait_s']:.1f} s waiting for GPU memory to settle")
    return ", ".join(parts)
