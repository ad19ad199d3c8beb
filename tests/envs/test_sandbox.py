"""The Python sandbox, on real subprocesses: each limit stops what it should and says so."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from polyrl.envs.sandbox import SandboxLimits, isolation, run_python

# Small limits keep the tier fast; each test states which one it exercises. The wall
# clock is long (60 s) so that a loaded machine never turns another limit into a timeout:
# the tests that use these limits end well before it (the infinite loop at 1 CPU second).
FAST = SandboxLimits(cpu_s=1, memory_mb=256, wall_s=60, max_output_bytes=4096)


def _may_make_namespaces() -> bool:
    """Whether this process holds CAP_SYS_ADMIN (root, as in CI here, has it), which is
    what unshare needs for the network, PID and mount namespaces on Linux."""
    try:
        with open("/proc/self/status") as f:
            caps = next(line for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caps.split()[1], 16) >> 21 & 1)  # CAP_SYS_ADMIN is bit 21


def _require_namespaces() -> None:
    """Skip only where the kernel may refuse the namespaces (no CAP_SYS_ADMIN): where it
    may not refuse (root, CI), a sandbox that ran without them fails the test instead of
    skipping it."""
    if not _may_make_namespaces():
        pytest.skip(
            "no CAP_SYS_ADMIN here (not root, or a container that drops it): the sandbox "
            "runs without namespaces, as docs/agents.md says"
        )
    assert isolation() == {"network": True, "pids": True, "proc": True}, isolation()


def test_prints_and_exits():
    result = run_python("print(6 * 7)\nimport sys; sys.exit(3)", FAST)
    assert (result.stdout, result.stderr, result.exit_code, result.reason) == ("42\n", "", 3, None)


def test_the_installed_packages_and_exit_are_there_without_the_site_module():
    """The interpreter starts with -S (no ``site``: its .pth files took half the start):
    the caller's site-packages are still on the path, and exit() and quit(), which
    ``site`` defines, still end the program."""
    result = run_python(
        "import numpy, sys\nprint(numpy.__name__, sys.flags.no_site)\nexit(4)", FAST
    )
    assert (result.stdout, result.stderr, result.exit_code) == ("numpy 1\n", "", 4)
    assert run_python("quit()", FAST).exit_code == 0


def test_exception_shows_the_programs_traceback_only():
    result = run_python("def f():\n    raise ValueError('boom')\nf()", FAST)
    assert (result.exit_code, result.reason) == (1, None)
    assert result.stderr.startswith('Traceback (most recent call last):\n  File "main.py", line 3')
    assert result.stderr.endswith("ValueError: boom\n")
    assert "<string>" not in result.stderr  # no frame of the sandbox's own start-up code


def test_infinite_loop_is_cut():
    # cpu_s=1: RLIMIT_CPU sends SIGXCPU after one CPU second; on a loaded machine the
    # wall clock (10 s) may come first, which is also a correct stop.
    result = run_python("while True:\n    pass", FAST)
    assert result.reason in ("cpu", "timeout") and result.exit_code is None


def test_sleeping_program_is_cut_at_the_wall_clock_and_keeps_its_output(tmp_path):
    """What it printed before the kill comes back. A loaded machine may not even start
    the program within the limit; the marker file, written after the print (unbuffered:
    the text is in the pipe by then), says whether it got that far."""
    marker = tmp_path / "printed"
    code = f"import time\nprint('start')\nopen({str(marker)!r}, 'w').close()\ntime.sleep(60)"
    result = run_python(code, SandboxLimits(wall_s=1))
    assert (result.reason, result.exit_code) == ("timeout", None)
    assert result.stdout == ("start\n" if marker.exists() else "")


def test_program_that_closes_its_output_is_still_cut():
    code = "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)"
    assert run_python(code, SandboxLimits(wall_s=0.5)).reason == "timeout"


def test_memory_bomb_is_cut():
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(10 * 2**20))"
    result = run_python(code, FAST)
    assert (result.reason, result.exit_code) == ("memory", 1)
    assert "memory limit of 256 MB" in result.stderr


def test_one_huge_allocation_is_cut():
    result = run_python("x = bytearray(4 * 2**30)\nprint('allocated')", FAST)
    assert (result.reason, result.stdout) == ("memory", "")


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_huge_output_is_truncated_and_stopped(stream):
    code = f"import sys\nwhile True:\n    sys.{stream}.write('x' * 1000 + '\\n')"
    result = run_python(code, FAST)
    assert (result.reason, result.exit_code) == ("output", None)
    assert getattr(result, stream) == ("x" * 1000 + "\n") * 4 + "x" * (4096 - 4 * 1001)


def test_files_go_to_a_temporary_directory_removed_afterwards():
    code = textwrap.dedent(
        """
        import os, tempfile
        with open("out.txt", "w") as f:
            f.write("data")
        os.mkdir("sub")
        open("sub/ro.txt", "w").close()
        os.chmod("sub/ro.txt", 0o400)
        os.chmod("sub", 0o500)  # read-only: cleaning up must still remove it
        print(os.getcwd())
        print(os.path.abspath("out.txt"))
        print(tempfile.gettempdir())
        print(os.path.expanduser("~"))
        """
    )
    result = run_python(code, FAST)
    assert result.exit_code == 0, result.stderr
    workdir, written, tmp, home = result.stdout.split()
    assert os.path.dirname(workdir) == tempfile.gettempdir()
    assert os.path.basename(workdir).startswith("polyrl-sandbox-")
    assert written == os.path.join(workdir, "out.txt") and tmp == home == workdir
    assert workdir != os.getcwd()
    assert not os.path.exists(workdir)


def test_file_size_is_limited():
    code = "open('big', 'wb').write(b'x' * (2 * 2**20))"
    result = run_python(code, SandboxLimits(file_mb=1))
    assert result.exit_code == 1 and "File too large" in result.stderr


def test_environment_is_stripped(monkeypatch):
    monkeypatch.setenv("POLYRL_SANDBOX_SECRET", "s3cret")
    monkeypatch.setenv("PYTHONPATH", "/nowhere")
    code = "import os, sys\nprint(sorted(os.environ))\nprint(sys.flags.isolated, '/nowhere' in sys.path)"
    result = run_python(code, FAST)
    keys, flags = result.stdout.splitlines()
    assert keys == str(
        sorted(
            [
                "HOME",
                "LANG",
                "LC_ALL",
                "MKL_NUM_THREADS",
                "OMP_NUM_THREADS",
                "OPENBLAS_NUM_THREADS",
                "PATH",
                "TMPDIR",
            ]
        )
    )
    assert flags == "1 False"


def test_the_callers_environment_cannot_be_read_through_proc():
    """Issue 47: the program got none of the caller's variables, yet read them from
    /proc/<pid>/environ of the env worker that called the sandbox (an HF_TOKEN). Here the
    caller is a process started with a secret in its environment, as an env worker is;
    the program walks /proc/*/environ for it. With a PID namespace the program gets a
    /proc of that namespace, where no process of the caller's is."""
    _require_namespaces()
    secret = "polyrl-sandbox-secret-4711"
    code = textwrap.dedent(
        f"""
        import os
        found = []
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{{pid}}/environ", "rb") as f:
                    if {secret!r}.encode() in f.read():
                        found.append(pid)
            except OSError:
                pass
        print("found in", found if found else "none")
        """
    )
    caller = textwrap.dedent(
        f"""
        from polyrl.envs.sandbox import run_python
        result = run_python({code!r})
        print(repr((result.stdout, result.stderr, result.proc_isolated)))
        """
    )
    env = {**os.environ, "POLYRL_TEST_SECRET": secret}
    # The same walk outside the sandbox finds the caller: the check can fail.
    outside = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert outside.stdout.startswith("found in ['"), outside.stdout + outside.stderr
    inside = subprocess.run(
        [sys.executable, "-c", caller], env=env, capture_output=True, text=True, timeout=120
    )
    assert inside.returncode == 0, inside.stderr
    assert inside.stdout == repr(("found in none\n", "", True)) + "\n", (
        inside.stdout + inside.stderr
    )


def _connect_code(port: int) -> str:
    return textwrap.dedent(
        f"""
        import socket
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
            print("connected")
        except OSError as e:
            print("refused", e.errno)
        """
    )


def test_network_is_unreachable_where_unshare_works():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        code = _connect_code(server.getsockname()[1])
        # The same program outside the sandbox reaches the server: the check can fail.
        outside = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=30
        )
        assert outside.stdout == "connected\n", outside.stderr
        _require_namespaces()
        result = run_python(code, FAST)
    assert result.network_isolated
    assert result.stdout.startswith("refused"), result.stdout + result.stderr


def test_processes_it_leaves_behind_die_with_it(tmp_path):
    """A child that leaves the process group (setsid) and sleeps: in a PID namespace it
    dies when the program ends, and does not hold the output pipes open until the wall
    clock. Its /proc is its namespace's, so it names itself (the process name, which the
    host's /proc shows too) for the test to find it there."""
    _require_namespaces()
    name_file = tmp_path / "name"
    name = f"sbx-orphan-{os.getpid() % 10000}"
    code = textwrap.dedent(
        f"""
        import ctypes, os, time
        if os.fork() == 0:
            os.setsid()
            ctypes.CDLL(None).prctl(15, {name.encode()!r}, 0, 0, 0)  # PR_SET_NAME
            with open({str(name_file)!r}, "w") as f:
                f.write(open("/proc/self/comm").read().strip())
            time.sleep(60)
            os._exit(0)  # never the parent's code below, had it outlived the run
        while not os.path.exists({str(name_file)!r}):
            time.sleep(0.01)
        print("parent done")
        """
    )
    result = run_python(code, SandboxLimits(wall_s=60, allow_subprocesses=True))
    assert result.pid_namespace
    assert (result.stdout, result.exit_code, result.reason) == ("parent done\n", 0, None)
    assert name_file.read_text() == name
    for _ in range(500):  # the kernel kills it at once; give the kill 5 s to show
        if not _named(name):
            break
        time.sleep(0.01)
    assert _named(name) == []


def _named(name: str) -> list[int]:
    """Host pids of running (not zombie) processes called ``name``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == name and _alive(int(pid)):
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _alive(pid: int) -> bool:
    """Running, not a zombie (the host's init reaps orphans; one that does not leaves them)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_callers_processes_cannot_be_signalled():
    # Signal 0 only probes: outside a PID namespace it would reach this process.
    _require_namespaces()
    code = f"import os\ntry:\n    os.kill({os.getpid()}, 0)\n    print('reached')\nexcept ProcessLookupError:\n    print('no such process')"
    assert run_python(code, FAST).stdout == "no such process\n"


def test_runs_from_several_threads_at_once():
    # Tools run on threads; each run has its own process, pipes and directory.
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run_python(f"print({i} * {i})", FAST), range(8)))
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(8)]


def test_bad_limits_are_named():
    assert SandboxLimits(cpu_s=0, memory_mb=32).problems() == [
        "SandboxLimits.cpu_s=0: must be a positive number"
    ]
    assert SandboxLimits(memory_mb=32).problems() == [
        "SandboxLimits.memory_mb=32: the interpreter alone needs ~30 MB of address space; "
        "give at least 64"
    ]
    assert SandboxLimits().problems() == []
    with pytest.raises(ValueError, match="run_python: SandboxLimits.wall_s=-1"):
        run_python("print(1)", SandboxLimits(wall_s=-1))
