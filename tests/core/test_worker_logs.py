"""Which worker lines reach the terminal (polyrl.cluster.ray_session._WorkerLogs): all of them
go to the run's logs/, only the ones that matter to the terminal."""

from __future__ import annotations

from polyrl.cluster.ray_session import _WorkerLogs

WEAKSET = [
    "Exception ignored in: <function WeakSet.__init__.<locals>._remove at 0x7f3a2c1e8ae0>",
    "Traceback (most recent call last):",
    '  File "/usr/lib/python3.11/_weakrefset.py", line 39, in _remove',
    "TypeError: 'NoneType' object is not callable",
]


def test_interpreter_shutdown_noise_stays_in_the_logs(tmp_path, capsys):
    """Issue 34: a sweep's terminal showed 'Exception ignored in: <function WeakSet ...>'
    and 'Traceback' lines from Tune's trial actors exiting."""
    lines = [
        ":actor_name:ImplicitFunc",
        "2026-12-03 WARNING trial 01 is slow",
        *WEAKSET,
        "ValueError: a real error after it",
        *WEAKSET,
    ]
    logs, out = tmp_path / "ray", tmp_path / "run_logs"
    logs.mkdir()
    out.mkdir()
    path = logs / "worker-5f2e-01000000-4242.err"
    path.write_text("\n".join(lines) + "\n")
    _WorkerLogs(logs, "01000000", out).poll()
    assert capsys.readouterr().err.splitlines() == [
        "(ImplicitFunc pid=4242) 2026-12-03 WARNING trial 01 is slow",
        "(ImplicitFunc pid=4242) ValueError: a real error after it",
    ]
    assert (out / path.name).read_text() == path.read_text()  # the full log is kept


def test_the_cpu_servers_chunked_prefill_notice_is_benign():
    """polyrl turns chunked prefill off on CPU (docs/rollout.md); vLLM warns at start."""
    from polyrl.cluster.ray_session import worker_line_matters

    notice = (
        "(MainProcess pid=30088) WARNING 12-03 09:15:21 [arg_utils.py:3005] This model does "
        "not officially support disabling chunked prefill. Disabling this manually may cause "
        "the engine to crash or produce incorrect outputs."
    )
    assert not worker_line_matters(notice)
    assert worker_line_matters("(MainProcess pid=1) WARNING 12-03 09:15:21 KV cache is full")
