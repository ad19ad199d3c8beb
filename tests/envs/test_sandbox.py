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


def test_prints_and_exits():
    result = run_python("print(6 * 7)\nimport sys; sys.exit(3)", FAST)
    assert (result.stdout, result.stderr, result.exit_code, result.reason) == ("42\n", "", 3, None)


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
        result = run_python(code, FAST)
    assert result.network_isolated == isolation()["network"]
    if not result.network_isolated:
        pytest.skip(
            "unshare(CLONE_NEWNET) is refused here (not root, no CAP_SYS_ADMIN, or not "
            "Linux): the sandbox runs with the network, as docs/agents.md says"
        )
    assert result.stdout.startswith("refused"), result.stdout + result.stderr


def test_processes_it_leaves_behind_die_with_it(tmp_path):
    """A child that leaves the process group (setsid) and sleeps: in a PID namespace it
    dies when the program ends, and does not hold the output pipes open until the wall
    clock. /proc is the host's, so /proc/self names its host pid."""
    pid_file = tmp_path / "pid"
    code = textwrap.dedent(
        f"""
        import os, time
        if os.fork() == 0:
            os.setsid()
            with open({str(pid_file)!r}, "w") as f:
                f.write(os.readlink("/proc/self"))
            time.sleep(60)
            os._exit(0)  # never the parent's code below, had it outlived the run
        while not os.path.exists({str(pid_file)!r}):
            time.sleep(0.01)
        print("parent done")
        """
    )
    if not isolation()["pids"]:
        # Without it the child would outlive the run (docs/agents.md says so): not tried.
        pytest.skip(
            "unshare(CLONE_NEWPID) is refused here (not root, no CAP_SYS_ADMIN, or not Linux)"
        )
    result = run_python(code, SandboxLimits(wall_s=60, allow_subprocesses=True))
    assert result.pid_namespace
    assert (result.stdout, result.exit_code, result.reason) == ("parent done\n", 0, None)
    pid = int(pid_file.read_text())
    for _ in range(500):  # the kernel kills it at once; give the kill 5 s to show
        if not _alive(pid):
            break
        time.sleep(0.01)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    """Running, not a zombie (the host's init reaps orphans; one that does not leaves them)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_callers_processes_cannot_be_signalled():
    # Signal 0 only probes: outside a PID namespace it would reach this process.
    if not isolation()["pids"]:
        pytest.skip(
            "unshare(CLONE_NEWPID) is refused here (not root, no CAP_SYS_ADMIN, or not Linux)"
        )
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
