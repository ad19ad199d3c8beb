"""The run's Ray session: started or joined in one place, quiet, and ended with the driver.

* ``RAY_ADDRESS`` set: join that cluster (a sweep trial joins its sweep's). Otherwise
  polyrl starts its own local Ray (``address="local"``: never a cluster another program
  started on the machine).
* A local Ray's processes (GCS, raylet, agents, workers) are the driver's descendants. A
  watchdog process (``python -m polyrl.cluster.ray_session WATCH PID``, in its own session, so
  a Ctrl-C or a SIGKILL of the driver does not reach it) records them while the driver
  lives and ends them (SIGTERM, then SIGKILL) as soon as it is gone, however it died.
* Worker output: without ``--verbose`` every worker's stdout/stderr is copied whole
  into ``<run_dir>/logs/`` and only lines that matter reach the terminal (errors,
  tracebacks, warnings other than the known vLLM-on-CPU start-up notices), prefixed
  ``(Role pid=N)`` as Ray does. With ``--verbose`` Ray prints everything itself.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "init_ray",
    "copy_worker_logs",
    "local_cpus",
    "verbose",
    "VERBOSE_ENV",
    "worker_line_matters",
]

# Set by ``--verbose`` (and inherited by a sweep's trials): phase lines, all worker output.
VERBOSE_ENV = "POLYRL_VERBOSE"

# Worker lines that are noise at WARNING level: the vLLM CPU build's start-up notices
# (no Triton, no tcmalloc/iomp preload, eager mode, NUMA binding, thread pinning, the
# chunked prefill polyrl turns off on CPU: docs/rollout.md) and deprecation notices from
# libraries. Everything else at WARNING or above is shown.
BENIGN = (
    "does not officially support disabling chunked prefill",
    "Triton",
    "triton",
    "LD_PRELOAD",
    "Enforce eager set",
    "Inductor compilation was disabled",
    "Reset SSM cache type",
    "The global random seed is set",
    "torch.set_num_threads",
    "NUMA binding",
    "FutureWarning",
    "DeprecationWarning",
    "Token authentication is enabled",
)
# Python's report of a weakref callback that ran while a worker's interpreter shut down
# (Ray Tune's trial actors at the end of a sweep): harmless, and it reads like a crash.
SHUTDOWN_NOISE = "Exception ignored in: <function WeakSet.__init__.<locals>._remove"
_MATTERS = re.compile(r"\b(WARNING|WARN|ERROR|CRITICAL|FATAL|Traceback|\w*Error|\w*Exception)\b")


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def worker_line_matters(line: str) -> bool:
    """Whether a worker's output line is shown without ``--verbose``."""
    return bool(_MATTERS.search(line)) and not any(b in line for b in BENIGN)


def init_ray(
    run_dir: str | Path,
    num_cpus: float | None,
    imports: Iterable[str] = (),
    debug: Any = None,
    cache_dir: str | None = None,
    copy_logs: bool = True,
    address: str | None = None,
    namespace: str | None = None,
) -> None:
    """Join the Ray cluster at ``address`` (a warm session's: ``polyrl.cluster.session``)
    or named by ``RAY_ADDRESS`` (``host:port`` of a ``ray start
    --head``, or ``auto``: docs/scaling.md), else start a private local one of
    ``num_cpus`` CPUs (never a cluster some other ``ray start`` left on the machine),
    watched so that it ends with the driver. ``debug``: a ``polyrl.observe.debug.DebugConfig``
    (docs/debugging.md); with it enabled every worker line reaches the driver.
    ``cache_dir``: ``RunConfig.cache_dir``, the compile caches of the driver and every
    worker (``polyrl.compile_cache``). ``copy_logs=False``: :func:`copy_worker_logs`
    later (once the run dir may be written). ``namespace``: Ray's, where named actors
    are found (a session's)."""
    import ray

    from polyrl.cluster.user_code import runtime_env
    from polyrl.compile_cache import use_cache

    address = address or os.environ.get("RAY_ADDRESS") or "local"
    local: dict[str, Any] = {"num_cpus": local_cpus(num_cpus)} if address == "local" else {}
    env = runtime_env(imports)
    env["env_vars"].update(use_cache(cache_dir))
    debugging = debug is not None and debug.enabled
    if debugging:
        env["env_vars"].update(debug.env())
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every log point's line, each step
        local |= {"dashboard_host": debug.host} if address == "local" else {}
    loud = verbose() or debugging
    if not loud:  # Ray's own driver-side notices (token auth on a local start): benign
        for handler in logging.getLogger("ray").handlers:
            handler.addFilter(lambda r: worker_line_matters(f"WARNING {r.getMessage()}"))
    term = signal.getsignal(signal.SIGTERM)
    ray.init(
        address=address,
        include_dashboard=debugging,
        log_to_driver=loud,
        logging_level=logging.INFO if loud else logging.WARNING,
        runtime_env=env,
        namespace=namespace,
        **local,
    )
    if term is not None and threading.current_thread() is threading.main_thread():
        # ray.init swaps the driver's SIGTERM handler for its own (sys.exit(15)): keep
        # the caller's, e.g. polyrl train's "end the run like Ctrl-C" (a sweep stopping a
        # trial sends SIGTERM).
        signal.signal(signal.SIGTERM, term)
    if address == "local":
        _start_watchdog(os.getpid())
    if copy_logs:
        copy_worker_logs(run_dir, debug)


def copy_worker_logs(
    run_dir: str | Path, debug: Any = None, session_job: str | None = None
) -> None:
    """Copy the Ray job's worker output into ``<run_dir>/logs/`` and show the lines that
    matter (not with ``--verbose`` or the debugger: Ray prints every line itself).
    ``session_job``: a warm session's job too (its workers serve this run), from the
    current end of each of its files on."""
    import ray

    if not (verbose() or (debug is not None and debug.enabled)):
        logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
        job = ray.get_runtime_context().get_job_id()
        _WorkerLogs(logs, job, Path(run_dir) / "logs").start()
        if session_job is not None:
            _WorkerLogs(logs, session_job, Path(run_dir) / "logs", from_end=True).start()


def local_cpus(num_cpus: float | None) -> int | None:
    """Logical CPUs of a local Ray start, rounded up to a whole number: a raylet given a
    fractional or float count (e.g. 13.0) never registered on a 32-core GPU host, and
    ``ray.init`` timed out after 30 s (seen with Ray 2.60 on 2 x H200)."""
    return None if num_cpus is None else math.ceil(num_cpus)


def end_actors(actors: Iterable[Any], timeout_s: float = 30.0) -> None:
    """Kill ``actors`` and wait (at most ``timeout_s``) until their processes are gone,
    so the devices and memory they held are free when this returns. ``ray.kill`` only
    asks, and Ray reports an actor dead before its process has exited: a run started
    next in the same Ray session could find the GPU still full. Processes on this node
    are watched by PID; on other nodes, Ray's report is the best there is."""
    import psutil
    import ray

    actors = list(actors)
    here = ray.get_runtime_context().get_node_id()
    refs = [a.__ray_call__.remote(_node_and_pid) for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=5.0)
    ids = [_value(r) if r in ready else None for r in refs]  # None: dead or busy
    for a in actors:
        ray.kill(a, no_restart=True)
    deadline = time.monotonic() + timeout_s
    for a, where in zip(actors, ids):
        left = max(0.0, deadline - time.monotonic())
        if where is not None and where[0] == here:
            with contextlib.suppress(psutil.Error):
                psutil.Process(where[1]).wait(timeout=left)
        else:
            with contextlib.suppress(ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                ray.get(a.__ray_ready__.remote(), timeout=left)


def _value(ref: Any) -> Any:
    """A finished call's value; None if it failed (the actor died: already gone)."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayError:
        return None


def _node_and_pid(_actor: Any) -> tuple[str, int]:
    import ray

    return ray.get_runtime_context().get_node_id(), os.getpid()


def _start_watchdog(pid: int) -> None:
    subprocess.Popen(
        [sys.executable, "-m", "polyrl.cluster.ray_session", "WATCH", str(pid)],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
    )


def _watch(pid: int, poll_s: float = 0.5) -> None:
    """Record the driver's descendants while it lives; end them when it is gone."""
    import psutil

    me = os.getpid()
    try:
        driver = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    known: dict[int, psutil.Process] = {}
    while driver.is_running() and driver.status() != psutil.STATUS_ZOMBIE:
        with contextlib.suppress(psutil.Error):
            for p in driver.children(recursive=True):
                if p.pid != me:
                    known.setdefault(p.pid, p)
        time.sleep(poll_s)
    # The same Process objects: is_running() is False for a reused PID.
    alive = [p for p in known.values() if p.is_running()]
    for p in list(alive):
        with contextlib.suppress(psutil.Error):
            alive += [c for c in p.children(recursive=True) if c.pid != me]
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(alive, timeout=5)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


class _WorkerLogs(threading.Thread):
    """Copies this job's worker log files into the run dir and echoes lines that matter."""

    def __init__(
        self,
        logs_dir: Path,
        job_id: str,
        out_dir: Path,
        poll_s: float = 0.5,
        from_end: bool = False,
    ):
        super().__init__(name="polyrl-worker-logs", daemon=True)
        self.logs_dir, self.job_id, self.out_dir, self.poll_s = logs_dir, job_id, out_dir, poll_s
        self.offsets: dict[Path, int] = {}
        self.names: dict[Path, str] = {}
        self.partial: dict[Path, str] = {}
        self.shutdown_noise: set[Path] = set()  # inside a SHUTDOWN_NOISE block
        for path in self.files() if from_end else ():  # what is there: earlier runs' lines
            data = path.read_bytes()
            self.offsets[path] = len(data)
            for line in data.decode(errors="replace").split("\n"):
                if line.startswith(":actor_name:"):
                    self.names[path] = line.split(":", 2)[2]

    def files(self) -> list[Path]:
        # worker-<worker id>-<job id>-<pid>.out/.err: this job's workers only.
        return sorted(self.logs_dir.glob(f"worker-*-{self.job_id}-*.[oe][ur][tr]"))

    def run(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        while True:
            with contextlib.suppress(OSError):
                self.poll()
            time.sleep(self.poll_s)

    def poll(self) -> None:
        for path in self.files():
            start = self.offsets.get(path, 0)
            with path.open("rb") as f:
                f.seek(start)
                data = f.read()
            if not data:
                continue
            self.offsets[path] = start + len(data)
            with (self.out_dir / path.name).open("ab") as f:
                f.write(data)
            text = self.partial.pop(path, "") + data.decode(errors="replace")
            lines = text.split("\n")
            if lines[-1]:
                self.partial[path] = lines[-1]
            for line in lines[:-1]:
                self.echo(path, line)

    def echo(self, path: Path, line: str) -> None:
        if line.startswith(":actor_name:"):
            self.names[path] = line.split(":", 2)[2]
            return
        if line.startswith(SHUTDOWN_NOISE) or path in self.shutdown_noise:
            # its traceback's lines, up to and with the exception's own line
            done = not line.startswith(("Exception ignored", "Traceback", " "))
            (self.shutdown_noise.discard if done else self.shutdown_noise.add)(path)
            return
        if line.startswith(":") or not worker_line_matters(line):
            return
        pid = path.stem.rsplit("-", 1)[-1]
        print(f"({self.names.get(path, 'worker')} pid={pid}) {line}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> Any:
    if len(argv) == 2 and argv[0] == "WATCH":
        return _watch(int(argv[1]))
    raise SystemExit("usage: python -m polyrl.cluster.ray_session WATCH DRIVER_PID")


if __name__ == "__main__":
    main(sys.argv[1:])
