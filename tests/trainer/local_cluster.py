"""A real multi-node Ray cluster on this machine: a head and worker nodes, each its own
``ray start`` with its own CPUs, custom resources, free ports and a short temp dir.

Every process it starts is stopped at the end: each ``ray start --block`` runs in its own
process group (killed as a group), and any process left whose command line names the
cluster's temp dir is killed by pid. Never a global ``ray stop``: other Ray instances on
the machine are not ours.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _node_cmd(
    temp_dir: str,
    res: Mapping[str, float],
    head_port: int,
    head: bool,
    dashboard_port: int | None = None,
) -> list[str]:
    ports = _free_ports(6)
    custom = {k: v for k, v in res.items() if k not in ("CPU", "GPU")}
    cmd = [RAY, "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1"]
    cmd += [f"--num-cpus={int(res.get('CPU', 0))}", f"--num-gpus={int(res.get('GPU', 0))}"]
    cmd += [f"--resources={json.dumps(custom)}"]
    cmd += [
        f"--object-manager-port={ports[0]}",
        f"--node-manager-port={ports[1]}",
        f"--dashboard-agent-listen-port={ports[2]}",
        f"--dashboard-agent-grpc-port={ports[3]}",
        f"--runtime-env-agent-port={ports[4]}",
        f"--metrics-export-port={ports[5]}",
        "--object-store-memory=200000000",
    ]
    if head:
        cmd += ["--head", f"--port={head_port}", f"--temp-dir={temp_dir}"]
        if dashboard_port is None:
            cmd += ["--include-dashboard=false"]
        else:
            cmd += ["--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}"]
    else:
        cmd += [f"--address=127.0.0.1:{head_port}"]
    return cmd


def _ours(temp_dir: str) -> list[int]:
    """Pids of live processes whose command line names ``temp_dir``."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if temp_dir.encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
    return pids


def cluster_env(address: str, token: str | None = None) -> dict[str, str]:
    """Environment of a process of (or joining) the test cluster, RAY_ADDRESS =
    ``address``. Token authentication: off without ``token`` (Ray turns it on when
    ~/.ray/auth_token exists; a driver with an explicit address would then need the token
    too); with it, on (RAY_AUTH_MODE=token) with that token (RAY_AUTH_TOKEN, which Ray
    reads before any token file)."""
    env = {**os.environ, "RAY_ADDRESS": address, "RAY_AUTH_MODE": "disabled"}
    if token is not None:
        env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
        env.pop("RAY_AUTH_TOKEN_PATH", None)
    return env


def _alive_nodes(address: str, token: str | None) -> int:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import ray; ray.init(address={address!r}, logging_level='ERROR'); "
            "print(sum(n['Alive'] for n in ray.nodes()))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=cluster_env("", token),
    )
    return int(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else 0


@contextlib.contextmanager
def local_cluster(
    head: Mapping[str, float],
    workers: Sequence[Mapping[str, float]],
    timeout_s: float = 300.0,
    token: str | None = None,
    dashboard_port: int | None = None,
) -> Iterator[str]:
    """Start the cluster, yield its address (``127.0.0.1:port``), stop every process.

    head / workers: each node's resources: ``CPU``, ``GPU`` (declared: Ray hands out GPU
    ids and ``CUDA_VISIBLE_DEVICES`` on a machine without any) and custom ones (e.g.
    ``{"CPU": 1, "node_a": 1}``). token: Ray token authentication on, with this token
    (see :func:`cluster_env`). dashboard_port: the head runs the dashboard on 127.0.0.1
    there (default: no dashboard)."""
    temp_dir = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # unix sockets: keep it short
    (port,) = _free_ports(1)
    address = f"127.0.0.1:{port}"
    procs: list[subprocess.Popen] = []
    env = cluster_env("", token)

    def start(res: Mapping[str, float], is_head: bool) -> None:
        cmd = _node_cmd(temp_dir, res, port, is_head, dashboard_port if is_head else None)
        log = open(Path(temp_dir, f"node{len(procs)}.log"), "w")  # noqa: SIM115 (closed with the dir)
        procs.append(
            subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        )

    try:
        start(head, True)
        deadline = time.monotonic() + timeout_s
        while _alive_nodes(address, token) < 1:
            if time.monotonic() > deadline or procs[0].poll() is not None:
                raise RuntimeError(
                    f"ray head did not start: {Path(temp_dir, 'node0.log').read_text()[-2000:]}"
                )
            time.sleep(1)
        # One node at a time: a raylet must register with the GCS within 30 s, which
        # several starting together on a busy 2-core machine can miss; retry such a node.
        for joined, res in enumerate(workers, start=2):
            for _attempt in range(3):
                start(res, False)
                while _alive_nodes(address, token) < joined and procs[-1].poll() is None:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(1)
                if procs[-1].poll() is None:
                    break
            if _alive_nodes(address, token) < joined:
                logs = [
                    Path(temp_dir, f"node{i}.log").read_text()[-1500:] for i in range(1, len(procs))
                ]
                raise RuntimeError(
                    f"ray workers did not join within {timeout_s:.0f} s:\n" + "\n".join(logs)
                )
        yield address
    finally:
        for p in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5  # then SIGKILL: nothing of the cluster is kept
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        for _ in range(2):  # stragglers that left the groups (Ray workers, agents)
            for pid in _ours(temp_dir):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)
