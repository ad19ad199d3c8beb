"""A warm session's host process and ``polyrl session start|status|stop``
(``polyrl.cluster.session`` describes the session; docs/sessions.md).

The host (``python -m polyrl.configure.session_host HOST DIR ...``, in a process session of
its own) parses and checks the config, starts a private local Ray in the session's
namespace and builds the run's loop as ``polyrl train`` would, with its kept workers named
(``polyrl.cluster.session.serving``); then writes ``session.json`` and waits for SIGTERM,
when it ends its workers and its Ray. While starting, ``session.json`` holds its pid and
the start-up phase it is in: ``polyrl session start`` names that phase when it ends a host
not up within ``--start-timeout``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polyrl.cluster.session import (
    HOST_MODULE,
    NAMESPACE,
    STATE,
    Session,
    actor_name,
    fingerprint,
    host_process,
    kept,
    serving,
    session_dir,
)

__all__ = ["start", "status", "stop"]


def _write_state(where: Path, state: dict[str, Any]) -> None:
    tmp = where / (STATE + ".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(where / STATE)


def _checked(
    where: Path, gin_files: Sequence[str], gin_params: Sequence[str], imports: Sequence[str]
) -> tuple[Any, Any]:
    """The session's config, checked as a run's is; its run dir is ``<where>/host``."""
    from polyrl.configure.launch import parse_config, prepare

    cfg, _ = parse_config(gin_files, gin_params, imports=imports)
    cfg = dataclasses.replace(cfg, run_dir=str(where / "host"), tensorboard=False)
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    return prepare(cfg)


def _host(where: Path, gin_files: list[str], gin_params: list[str], imports: list[str]) -> None:
    """The session's host process: build the loop with named workers, record them, wait."""
    import ray

    from polyrl.configure.launch import _components, init_run_ray
    from polyrl.loop.metrics import StartupLog
    from polyrl.loop.trainer import LOOPS

    t0 = time.perf_counter()
    _write_state(where, {"pid": os.getpid()})  # starting: polyrl session stop can end it

    def starting(phase: str) -> None:  # the phase `polyrl session start` names if it hangs
        _write_state(where, {"pid": os.getpid(), "phase": phase, "phase_at": time.time()})

    startup = StartupLog(on_phase=starting)
    try:
        with startup.phase("checks"):
            cfg, spec = _checked(where, gin_files, gin_params, imports)
        with startup.phase("ray"):
            init_run_ray(cfg, namespace=NAMESPACE)
        with serving():
            components = _components(cfg, spec, startup=startup)
            loop = LOOPS[spec.objective](cfg, spec, components)
    except BaseException as e:
        _write_state(where, {"pid": os.getpid(), "error": f"{type(e).__name__}: {e}"})
        raise
    # Up: SIGTERM ends the workers and Ray in order (while starting it ended the host at
    # once, and the watchdog of polyrl.cluster.ray_session what the host had started).
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    actors = [actor_name(r, i) for r, i, _ in loop.role_workers() if kept(r)]
    _write_state(
        where,
        {
            "pid": os.getpid(),
            "address": ray.get_runtime_context().gcs_address,
            "job": ray.get_runtime_context().get_job_id(),
            # a local Ray turns token authentication on (the token: ~/.ray/auth_token)
            "auth_mode": os.environ.get("RAY_AUTH_MODE", ""),
            "actors": actors,
            "fingerprint": fingerprint(cfg, spec),
            "gin_files": gin_files,
            "ready_s": round(time.perf_counter() - t0, 1),
        },
    )
    stop.wait()
    loop.shutdown()
    ray.shutdown()


# ---------------------------------------------------------------------- the CLI
START_TIMEOUT_S = 900.0  # polyrl session start --start-timeout: a cold GPU start, with room


def start(
    gin_files: Sequence[str],
    gin_params: Sequence[str],
    imports: Sequence[str],
    timeout_s: float = START_TIMEOUT_S,
) -> Session:
    """``polyrl session start``: check the config here (a refused one starts nothing), start
    the host and wait until its workers are up; raises RuntimeError with the host's last
    lines if it fails, or, past ``timeout_s`` from the host's start, once it has ended the
    host and every process the host started, naming the start-up phase that did not
    finish."""
    from polyrl.configure.launch import find_gin

    where = session_dir()
    pid = _host_pid(where)
    if pid is not None and host_process(pid) is not None:
        raise RuntimeError(
            f"a session is already running in {where} (host pid {pid}); stop it first: "
            f"polyrl session stop"
        )
    _checked(where, gin_files, gin_params, imports)  # every check a run makes first
    (where / STATE).unlink(missing_ok=True)
    files = [str(find_gin(f)) for f in gin_files]
    cmd = [sys.executable, "-m", HOST_MODULE, "HOST", str(where), json.dumps(files)]
    cmd += [json.dumps(list(gin_params)), json.dumps(list(imports))]
    log = (where / "host.log").open("w")
    host = subprocess.Popen(
        cmd, start_new_session=True, stdin=subprocess.DEVNULL, stdout=log, stderr=log
    )
    print(f"[session] starting in {where}: host pid {host.pid} ({where / 'host.log'})", flush=True)
    deadline = time.monotonic() + timeout_s
    while True:
        s = Session.read(where)
        if s is not None:
            return s
        if time.monotonic() > deadline:
            raise RuntimeError(_ended_at_time_limit(where, host, timeout_s))
        if host.poll() is not None:
            tail = (where / "host.log").read_text().strip().splitlines()[-5:]
            said = f"; {where / 'host.log'} ends with:\n  " + "\n  ".join(tail) if tail else ""
            raise RuntimeError(
                f"the session's host ended (exit {host.returncode}) before its workers were "
                f"up{said}"
            )
        time.sleep(0.2)


def _ended_at_time_limit(where: Path, host: subprocess.Popen, timeout_s: float) -> str:
    """End a host that did not come up in time (and all it started); what to tell."""
    try:
        state = json.loads((where / STATE).read_text())
    except (OSError, ValueError):
        state = {}
    phase = state.get("phase", "imports")  # (before its first phase: importing polyrl)
    since = f" (in it for {time.time() - state['phase_at']:.0f} s)" if "phase_at" in state else ""
    found = host_process(host.pid)
    ended = _end(found) if found is not None else 0
    host.wait()
    (where / STATE).unlink(missing_ok=True)
    return (
        f"the session's host did not come up within --start-timeout {timeout_s:g} s: its "
        f"start-up phase {phase!r} did not finish{since}; ended it and the {max(ended - 1, 0)} "
        f"processes it had started. Check {where / 'host.log'} and its workers' logs "
        f"({where / 'host' / 'logs'}); if the start is only slow, raise --start-timeout"
    )


def status() -> tuple[Session | None, str]:
    """``polyrl session status``: the session and one line about it."""
    where = session_dir()
    s = Session.read(where)
    if s is None:
        pid = _host_pid(where)
        if pid is not None and host_process(pid) is not None:
            return None, f"starting in {where}: host pid {pid} ({where / 'host.log'})"
        return None, f"no session in {where}"
    why = s.gone()
    fp = s.fingerprint
    what = f"{fp['model_path']} on {fp['backend']} ({' '.join(s.gin_files)})"
    if why is not None:
        return s, f"the session in {where} is gone: {why}; clear it with polyrl session stop"
    return (
        s,
        f"up in {where}: host pid {s.pid}, Ray {s.address}, {what}, actors {', '.join(s.actors)}",
    )


def _host_pid(where: Path) -> int | None:
    """The host's pid as the session's state says (starting, up or failed); None: none."""
    try:
        return int(json.loads((where / STATE).read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def stop(timeout_s: float = 60.0) -> str:
    """``polyrl session stop``: end the host (starting or up) and wait until every process of
    the session (the host, its Ray, its workers and their vLLM engines) is gone; clears
    the state."""
    where = session_dir()
    pid = _host_pid(where)
    if pid is None:
        return f"no session in {where}"
    host = host_process(pid)
    if host is None:
        (where / STATE).unlink(missing_ok=True)
        return f"the session in {where} was already gone (host {pid} ended); cleared"
    ended = _end(host, timeout_s)
    (where / STATE).unlink(missing_ok=True)
    return f"stopped the session in {where} ({ended} processes ended)"


def _end(host: Any, timeout_s: float = 60.0) -> int:
    """SIGTERM to the host (a ``psutil.Process``), then wait until it and every process
    under it have exited, killing what is left after ``timeout_s``; how many there were."""
    import psutil

    family = [host, *host.children(recursive=True)]
    host.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(family, timeout=timeout_s)
    for p in alive:  # (the watchdog does this too, once the host is gone)
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=10)
    return len(family)


def main(argv: list[str]) -> Any:
    if len(argv) == 5 and argv[0] == "HOST":
        return _host(Path(argv[1]), *(json.loads(a) for a in argv[2:]))
    raise SystemExit(
        "usage: python -m polyrl.configure.session_host HOST DIR GIN_FILES PARAMS IMPORTS"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
