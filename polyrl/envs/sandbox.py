"""The Python sandbox: run a model's code in a fresh, limited subprocess.

``run_python(code, limits)`` writes ``code`` to ``main.py`` in a new temporary directory
and runs it with ``sys.executable -I -S`` (isolated mode: no user site, no ``PYTHON*``
variables; no ``site`` module: the caller's site-packages directories are put on the
path as they are, without running their ``.pth`` files, which took half of a run's
start where an editable install's finder sat there) in its own session (process
group), with:

- ``RLIMIT_CPU`` (CPU seconds, rounded up to whole seconds), ``RLIMIT_AS`` (address
  space: a bigger allocation raises ``MemoryError``), ``RLIMIT_FSIZE`` (largest file it
  may write), ``RLIMIT_CORE`` 0; ``RLIMIT_NPROC`` 0 when ``allow_subprocesses`` is off
  (no fork and no threads -- the kernel does not apply it to root);
- a wall-clock limit: at ``wall_s`` the whole process group is killed;
- output capped: past ``max_output_bytes`` on stdout or stderr the group is killed and the
  output truncated there;
- the temporary directory as working directory, ``HOME`` and ``TMPDIR``, removed after
  the run; an environment of a few fixed variables (nothing of the caller's);
- where the platform allows it (Linux, as root or with ``CAP_SYS_ADMIN``), namespaces
  made by ``unshare``: a new, empty network namespace (no network, not even loopback),
  a new PID namespace (the code cannot signal the caller's processes, and every
  process it starts dies when it ends, even one that left the process group) and a new
  mount namespace with a ``/proc`` of that PID namespace mounted (the code cannot list
  the caller's processes nor read ``/proc/<pid>/environ``, where the caller's
  environment variables are). Where that is refused, the code runs with the caller's
  network, process table and ``/proc``; ``SandboxResult.network_isolated``,
  ``pid_namespace`` and ``proc_isolated`` say which happened.

What it does not protect against is in docs/agents.md ("The Python sandbox"): it is a
guard against runaway and careless code, not a security boundary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

__all__ = ["SandboxLimits", "SandboxResult", "run_python", "isolation", "REASONS"]

# SandboxResult.reason values; None: the program ended on its own (any exit code).
REASONS = ("timeout", "cpu", "memory", "output", "error")


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run. ``cpu_s`` is rounded up to whole seconds (RLIMIT_CPU's
    unit); ``memory_mb`` caps the address space, which is larger than resident memory
    (the interpreter alone maps ~30 MB, numpy ~100 MB more; sympy and scipy fit in
    512 MB, torch does not)."""

    cpu_s: float = 5
    memory_mb: int = 512
    wall_s: float = 10
    max_output_bytes: int = 16384
    file_mb: int = 16  # largest file the code may write (RLIMIT_FSIZE)
    allow_subprocesses: bool = False  # False: RLIMIT_NPROC 0 (not enforced for root)

    def problems(self) -> list[str]:
        """Each limit that cannot work, named with its value and the fix."""
        out = []
        for name in ("cpu_s", "memory_mb", "wall_s", "max_output_bytes", "file_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                out.append(f"SandboxLimits.{name}={value!r}: must be a positive number")
        if not out and self.memory_mb < 64:
            out.append(
                f"SandboxLimits.memory_mb={self.memory_mb}: the interpreter alone needs "
                "~30 MB of address space; give at least 64"
            )
        return out


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run printed and how it ended.

    ``exit_code``: the program's exit status, or None when a signal ended it (a limit, or
    a crash). ``reason``: None when the program ended on its own (whatever its exit
    code), else which limit stopped it -- "timeout" (wall clock), "cpu", "memory",
    "output" (past ``max_output_bytes``; the output is truncated there) -- or "error" (it
    could not start, or a signal no limit explains ended it). ``network_isolated``: the
    code ran in an empty network namespace; ``pid_namespace``: in its own PID namespace,
    so every process it started was killed when it ended; ``proc_isolated``: its
    ``/proc`` was that namespace's (its own mount namespace), so it could not list the
    caller's processes nor read their environment or command lines there."""

    stdout: str
    stderr: str
    exit_code: int | None
    reason: str | None
    network_isolated: bool = False
    pid_namespace: bool = False
    seconds: float = 0.0
    proc_isolated: bool = False


# Runs first in the child, before the user's code: namespaces, limits, then main.py as
# __main__. Status for the parent goes to a pipe as JSON lines. Kept in the child (no
# preexec_fn: run_python is called from tool threads, and preexec_fn is unsafe in a
# threaded parent). With a PID namespace the chain is: this process (outside it) ->
# the namespace's init (pid 1, reports how the program ended) -> the program (pid 2);
# when init ends, the kernel kills every process left in the namespace.
_BOOTSTRAP = r"""
import os, resource, sys
# argv: cpu memory file subprocesses status_fd, then the site-packages directories (no
# json and no traceback imported before the code runs: together a third of the start)
cpu, memory, file, subprocesses, status_fd = map(int, sys.argv[1:6])
limits = {"cpu": cpu, "memory": memory, "file": file, "subprocesses": subprocesses}
sys.path.extend(sys.argv[6:])  # -S: no site module; exit() and quit() as it sets them
import _sitebuiltins, builtins
builtins.exit = _sitebuiltins.Quitter("exit", "Ctrl-D (i.e. EOF)")
builtins.quit = _sitebuiltins.Quitter("quit", "Ctrl-D (i.e. EOF)")
status = os.fdopen(status_fd, "w", buffering=1)
def tell(**kw):  # one JSON object a line: ints and booleans only
    items = ('"%s": %s' % (k, str(v).lower() if isinstance(v, bool) else int(v)) for k, v in kw.items())
    try:
        status.write("{" + ", ".join(items) + "}\n")
    except OSError:
        pass
def cap(which, soft, hard):
    try:
        resource.setrlimit(which, (soft, hard))
    except (ValueError, OSError):
        pass
def run():
    if not limits["subprocesses"]:
        cap(resource.RLIMIT_NPROC, 0, 0)
    sys.argv = ["main.py"]
    try:
        with open("main.py") as f:
            code = compile(f.read(), "main.py", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except MemoryError:
        tell(memory=True)
        sys.stderr.write(
            "MemoryError: the program went over its memory limit of %d MB\n"
            % (limits["memory"] >> 20)
        )
        sys.exit(1)
    except SystemExit:
        raise
    except BaseException as e:
        import traceback
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.exit(1)
try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    net = libc.unshare(0x40000000) == 0  # CLONE_NEWNET
    pids = libc.unshare(0x20000000) == 0  # CLONE_NEWPID: applies to the next child
    # CLONE_NEWNS, then every mount private (MS_REC | MS_PRIVATE): the /proc mounted
    # below must not propagate to the host's mount namespace.
    mounts = pids and libc.unshare(0x20000) == 0
    mounts = mounts and libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) == 0
except (OSError, AttributeError):
    net = pids = mounts = False
tell(network_isolated=net, pid_namespace=pids)
cap(resource.RLIMIT_CPU, limits["cpu"], limits["cpu"] + 1)
cap(resource.RLIMIT_AS, limits["memory"], limits["memory"])
cap(resource.RLIMIT_FSIZE, limits["file"], limits["file"])
cap(resource.RLIMIT_CORE, 0, 0)
if not pids:
    run()
    sys.exit(0)
init = os.fork()
if init:
    os.waitpid(init, 0)
    os._exit(0)
libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: init dies with the process above it
if mounts:
    # A /proc of this PID namespace (its processes only), the host's detached first
    # (MNT_DETACH) so that unmounting the new one cannot show it again.
    libc.umount2(b"/proc", 2)
    proc = libc.mount(b"proc", b"/proc", b"proc", 2 | 4 | 8, None) == 0  # nosuid,nodev,noexec
    tell(proc_isolated=proc)
program = os.fork()
if program == 0:
    run()
    sys.exit(0)
ended = os.waitpid(program, 0)[1]
try:
    os.kill(-1, 9)  # from a namespace's init: every other process in it
except OSError:
    pass
tell(wait_status=ended)
os._exit(0)
"""

# Variables the child sees; nothing else of the caller's environment passes.
_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_CHUNK = 65536
_DRAIN_S = 1.0  # after a kill, how long to read what is left in the pipes
_STATUS_BYTES = 65536  # the status pipe holds a few short lines


def _environment(workdir: str) -> dict[str, str]:
    # One BLAS thread: a pool of threads per core reserves address space that a 512 MB
    # RLIMIT_AS cannot hold on a many-core host (and threads need RLIMIT_NPROC).
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir}
    env.update({"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"})
    env.update(dict.fromkeys(_THREAD_VARS, "1"))
    return env


@functools.cache
def _site_packages() -> list[str]:
    """The directories ``site`` puts on an isolated interpreter's path (this one's
    site-packages; no user site), for the sandbox's interpreter started without it."""
    import site

    return [p for p in site.getsitepackages() if os.path.isdir(p)]


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _remove(path: str) -> None:
    """rmtree that also removes what the code made read-only."""

    def retry(func, p, _exc):
        os.chmod(os.path.dirname(p), stat.S_IRWXU)
        if os.path.isdir(p) and not os.path.islink(p):
            os.chmod(p, stat.S_IRWXU)
        func(p)

    # Python 3.12 renamed the hook (same arguments but the last: an exception, not exc_info).
    hook = {"onexc" if sys.version_info >= (3, 12) else "onerror": retry}
    try:
        shutil.rmtree(path, **hook)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:  # noqa: B008 (frozen)
    """Run ``code`` as ``__main__`` in a fresh sandboxed interpreter; see the module
    docstring for the limits. Never raises for the code's faults; limits that cannot
    work (``limits.problems()``) raise ValueError."""
    problems = limits.problems()
    if problems:
        raise ValueError("run_python: " + "; ".join(problems))
    start = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="polyrl-sandbox-")
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        return _run(workdir, limits, start)
    finally:
        _remove(workdir)


@functools.cache
def isolation() -> dict[str, bool]:
    """Which namespaces a sandboxed run gets on this machine (one probe run, cached):
    ``{"network": ..., "pids": ..., "proc": ...}``."""
    probe = run_python("pass")
    return {
        "network": probe.network_isolated,
        "pids": probe.pid_namespace,
        "proc": probe.proc_isolated,
    }


def _run(workdir: str, limits: SandboxLimits, start: float) -> SandboxResult:
    status_r, status_w = os.pipe()
    spec = {
        "cpu": max(1, math.ceil(limits.cpu_s)),
        "memory": int(limits.memory_mb) << 20,
        "file": int(limits.file_mb) << 20,
        "subprocesses": int(limits.allow_subprocesses),
        "status_fd": status_w,
    }
    argv = [sys.executable, "-I", "-S", "-u", "-X", "utf8", "-c", _BOOTSTRAP]
    try:
        proc = subprocess.Popen(
            [*argv, *map(str, spec.values()), *_site_packages()],
            cwd=workdir,
            env=_environment(workdir),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_w,),
            start_new_session=True,
        )
    except OSError as e:
        os.close(status_r)
        return SandboxResult("", f"sandbox could not start: {e}", None, "error")
    finally:
        os.close(status_w)
    out, stopped = _collect(proc, status_r, limits, start + limits.wall_s)
    wait_status, cpu_s, late = _reap(proc, start + limits.wall_s)
    if stopped is None and late:
        stopped = "timeout"  # it closed its output and kept running
    status = {}
    for line in out["status"].splitlines():
        with contextlib.suppress(ValueError, TypeError):  # the code wrote to the pipe itself
            status.update(json.loads(line))
    # In a PID namespace the program is a grandchild; its init reports how it ended.
    wait_status = status.get("wait_status", wait_status)
    signaled = os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else None
    code = None if signaled is not None else os.WEXITSTATUS(wait_status)
    if stopped is not None:
        reason = stopped
    elif status.get("memory"):
        reason = "memory"
    elif signaled == signal.SIGXCPU or (signaled == signal.SIGKILL and cpu_s >= spec["cpu"]):
        # The kernel sends SIGXCPU at the soft limit, SIGKILL at the hard one (soft + 1 s)
        # if the code ignored SIGXCPU. rusage is not the clock RLIMIT_CPU counts with: it
        # read 0.93-1.04 s at a 1 s SIGXCPU on a loaded machine, so it only tells a
        # hard-limit SIGKILL (a second later) from another one.
        reason = "cpu"
    elif signaled is not None:
        reason = "error"
    else:
        reason = None
    return SandboxResult(
        stdout=_text(out["stdout"], limits.max_output_bytes),
        stderr=_text(out["stderr"], limits.max_output_bytes),
        exit_code=code,
        reason=reason,
        network_isolated=bool(status.get("network_isolated")),
        pid_namespace=bool(status.get("pid_namespace")),
        proc_isolated=bool(status.get("proc_isolated")),
        seconds=time.monotonic() - start,
    )


def _text(data: bytes, cap: int) -> str:
    # errors="replace": the cap may cut a multi-byte character in two.
    return data[:cap].decode("utf-8", errors="replace")


def _collect(proc, status_r: int, limits: SandboxLimits, deadline: float):
    """Read stdout, stderr and the status pipe until all close; kill the group at the
    wall-clock deadline or when an output passes the cap. Returns (bytes per stream,
    "timeout" / "output" / None)."""
    streams = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr", status_r: "status"}
    data = {name: bytearray() for name in streams.values()}
    stopped = None
    sel = selectors.DefaultSelector()
    for fd in streams:
        sel.register(fd, selectors.EVENT_READ)
    try:
        while sel.get_map():
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                if stopped is not None:
                    break  # killed, drained for _DRAIN_S: a process outside the group holds a pipe
                stopped = "timeout"
                _kill_group(proc.pid)
                deadline = time.monotonic() + _DRAIN_S
                continue
            for key, _ in sel.select(timeout):
                chunk = os.read(key.fd, _CHUNK)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buf = data[streams[key.fd]]
                buf += chunk
                if key.fd == status_r and len(buf) > _STATUS_BYTES:
                    del buf[: -_STATUS_BYTES // 2]  # the code flooded it: keep the tail
                if key.fd != status_r and len(buf) > limits.max_output_bytes and stopped is None:
                    stopped = "output"
                    _kill_group(proc.pid)
                    deadline = time.monotonic() + _DRAIN_S
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
        os.close(status_r)
    return {name: bytes(buf) for name, buf in data.items()}, stopped


def _reap(proc, deadline: float) -> tuple[int, float, bool]:
    """Wait for the child, killing its group at ``deadline``: (its wait status, the CPU
    seconds it and its waited-for descendants used, whether the deadline killed it).
    Whatever it left in its process group is killed while it is still a zombie, so its
    id (the group's id) cannot have been reused."""
    pause, killed = 0.001, False
    while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if not killed and time.monotonic() >= deadline:
            _kill_group(proc.pid)
            killed = True
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    _kill_group(proc.pid)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return status, usage.ru_utime + usage.ru_stime, killed
