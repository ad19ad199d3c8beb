"""``validate-config --mode cluster`` and ``doctor`` against a real multi-node Ray cluster
started on this machine: a head and worker nodes (``ray start``), each with its own
custom resources, one of them started in an environment whose polyrl reports another
version. The cluster uses free ports and its own short temp dir, and is stopped at the
end by killing exactly the processes that run under that temp dir (never ``ray stop``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from polyrl.cli import main

RAY = str(Path(sys.executable).with_name("ray"))
POLYRL = str(Path(sys.executable).with_name("polyrl"))
GRPO = "gin/experiments/tiny_grpo.gin"
FAKE_POLYRL = "9.9.9"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ports(*flags: str) -> list[str]:
    return [a for flag in flags for a in (flag, str(_free_port()))]


class LocalCluster:
    """Ray nodes started with ``ray start`` on this machine, under one temp dir."""

    def __init__(self):
        self.temp = tempfile.mkdtemp(prefix="pg", dir="/tmp")  # short: unix socket paths
        self.port = _free_port()
        self._start(["--head", f"--port={self.port}", f"--temp-dir={self.temp}"], {"accel": 2})
        # The address the head advertises (its node IP may not be 127.0.0.1).
        self.address = Path(self.temp, "ray_current_cluster").read_text().strip()

    def _start(self, args: list[str], resources: dict, env: dict | None = None) -> None:
        import json

        cmd = [
            RAY, "start", *args, "--num-cpus=1", "--num-gpus=0",
            f"--resources={json.dumps(resources)}",
            "--disable-usage-stats",
            *_ports("--node-manager-port", "--object-manager-port", "--metrics-export-port",
                    "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                    "--runtime-env-agent-port"),
        ]  # fmt: skip
        if "--head" in args:
            cmd += ["--include-dashboard=false", *_ports("--ray-client-server-port")]
        run_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | (env or {})
        # A new head turns Ray's token authentication on by default; every node and
        # driver of this cluster must then ask for it too (the token: ~/.ray/auth_token).
        run_env["RAY_AUTH_MODE"] = "token"
        out = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stdout + out.stderr

    def add_node(self, resources: dict, env: dict | None = None) -> None:
        self._start([f"--address={self.address}"], resources, env)

    def wait_for(self, n_nodes: int, timeout_s: float = 120.0) -> None:
        """Block until ``n_nodes`` nodes are alive (a separate driver: no state here)."""
        code = (
            "import ray, sys, time\n"
            f"ray.init(address={self.address!r}, logging_level='ERROR')\n"
            f"t = time.time() + {timeout_s}\n"
            f"while len([n for n in ray.nodes() if n['Alive']]) < {n_nodes}:\n"
            "    assert time.time() < t, ray.nodes()\n"
            "    time.sleep(0.5)\n"
        )
        env = os.environ | {"RAY_AUTH_MODE": "token"}
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=timeout_s + 60)

    def stop(self) -> None:
        import psutil

        mine = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                if any(self.temp in part for part in proc.info["cmdline"] or ()):
                    mine.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        for proc in mine:
            with _gone():
                proc.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(mine, timeout=15)
        for proc in alive:
            with _gone():
                proc.kill()
        shutil.rmtree(self.temp, ignore_errors=True)


def _gone():
    import contextlib

    import psutil

    return contextlib.suppress(psutil.NoSuchProcess)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Head (accel=2) + one worker node (accel=1), both on this machine's versions."""
    c = LocalCluster()
    try:
        c.add_node({"accel": 1})
        c.wait_for(2)
        yield c
    finally:
        c.stop()


def _validate(capsys, *params: str) -> tuple[int, str, str]:
    argv = ["validate-config", "--gin_file", GRPO, "--mode", "cluster"]
    for p in params:
        argv += ["--gin_param", p]
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _cli(address: str, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``polyrl ARGV`` as a user runs it against the token-auth cluster (Ray reads
    RAY_AUTH_MODE once per process, so the driver is a fresh process)."""
    run_env = os.environ | {"RAY_ADDRESS": address, "RAY_AUTH_MODE": "token"} | (env or {})
    return subprocess.run([POLYRL, *argv], env=run_env, capture_output=True, text=True, timeout=300)


def _cluster_validate(address: str, tmp_path, pools: str, env: dict | None = None):
    argv = ["validate-config", "--gin_file", GRPO, "--mode", "cluster"]
    for p in (_run_dir(tmp_path), pools):
        argv += ["--gin_param", p]
    return _cli(address, *argv, env=env)


def _run_dir(tmp_path) -> str:
    return f"polyrl.RunConfig.run_dir = {str(tmp_path)!r}"


def test_unreachable_address_is_named_quickly(tmp_path, monkeypatch, capsys):
    port = _free_port()  # nothing listens there
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    t0 = time.perf_counter()
    code, _, err = _validate(capsys, _run_dir(tmp_path))
    assert code == 1
    assert (
        f"RAY_ADDRESS='127.0.0.1:{port}': cannot connect to 127.0.0.1:{port} (Connection refused"
        in err
    ), err
    assert f"`ray start --head --port={port}`" in err
    assert time.perf_counter() - t0 < 30  # not the 35-40 s of a hanging ray.init
    assert main(["doctor", "--skip-vllm"]) == 1
    assert f"ray cluster   FAILED: RAY_ADDRESS='127.0.0.1:{port}'" in capsys.readouterr().out
    monkeypatch.delenv("RAY_ADDRESS")
    code, _, err = _validate(capsys, _run_dir(tmp_path))
    assert (
        code == 1 and "RAY_ADDRESS is not set: --mode cluster checks a running Ray cluster" in err
    )


@pytest.mark.slow  # 59 s on the 2-core machine (a two-node cluster); the default tier has the
# checks' own cases above and a two-node run in tests/trainer/test_multinode.py
def test_cluster_checks_resources_versions_and_env(cluster, tmp_path):
    # POLYRL_GUARDS_PROBE is set on the driver only: the nodes were started without it.
    probe = {"POLYRL_GUARDS_PROBE": "1"}
    pools = "polyrl.RunConfig.pools = {'shared': {'CPU': 2, 'accel': 3}}"
    run = _cluster_validate(cluster.address, tmp_path, pools, env=probe)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"cluster {cluster.address}: 2 node(s)" in run.stdout
    assert run.stdout.count("polyrl ") >= 2, run.stdout
    assert "WARNING POLYRL_GUARDS_PROBE='1' is set on the driver" in run.stdout

    # Ask for more of the custom resource than the nodes have in all, and a GPU pool.
    too_much = "polyrl.RunConfig.pools = {'shared': {'CPU': 2, 'accel': 4}}"
    run = _cluster_validate(cluster.address, tmp_path, too_much)
    assert run.returncode == 1
    assert (
        "RunConfig.pools['shared'] asks for accel=4 x 1 node(s) but the cluster has 3 in all"
        in run.stderr
    ), run.stderr
    assert "accel=2" in run.stderr and "accel=1" in run.stderr  # every node's resources
    gpu = "polyrl.RunConfig.pools = {'shared': {'CPU': 1, 'GPU': 1}}"
    run = _cluster_validate(cluster.address, tmp_path, gpu)
    assert run.returncode == 1
    assert (
        "RunConfig.pools['shared']={'CPU': 1, 'GPU': 1} needs 1 node(s) with CPU=1, GPU=1"
        in run.stderr
    ), run.stderr

    # doctor lists the nodes and their resources.
    run = _cli(cluster.address, "doctor", "--skip-vllm")
    assert run.returncode == 0, run.stdout
    assert f"ray cluster   {cluster.address}: 2 node(s)" in run.stdout and "accel=2" in run.stdout
    assert "gpu topology  no GPU (CPU only)" in run.stdout

    # A driver without the cluster's auth mode gets a named error, not a traceback.
    run = _cli(cluster.address, "doctor", "--skip-vllm", env={"RAY_AUTH_MODE": "disabled"})
    assert "ray cluster   FAILED" in run.stdout and "RAY_AUTH_MODE=token" in run.stdout

    # A third node whose environment reports another polyrl version.
    fake = tmp_path / "fake_site"
    meta = fake / f"polyrl-{FAKE_POLYRL}.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: polyrl\nVersion: {FAKE_POLYRL}\n")
    path = os.pathsep.join(filter(None, [str(fake), os.environ.get("PYTHONPATH")]))
    cluster.add_node({"accel": 1}, env={"PYTHONPATH": path})
    cluster.wait_for(3)
    run = _cluster_validate(cluster.address, tmp_path, pools)
    assert run.returncode == 1
    from polyrl.cluster.doctor import versions

    mismatch = f"has polyrl {FAKE_POLYRL} but the driver has {versions()['polyrl']}"
    assert run.stderr.count(mismatch) == 1, run.stderr  # only the faked node
    assert "install the same versions on every node" in run.stderr
    assert "has torch" not in run.stderr and "has ray" not in run.stderr
    assert "Traceback" not in run.stderr
