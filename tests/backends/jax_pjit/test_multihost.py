"""JAX multi-controller (docs/design.md "Placement"): two processes joined by
jax.distributed over CPU gloo collectives, each feeding its half of the batch, give the
same outputs, losses and weights as one process driving both devices; and a checkpoint
saved by either (orbax, one file set for the whole global mesh) loads into the other, and
into one process with one device (a run resumed on a different number of hosts), while
offload/reload on both hosts changes nothing."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from polyrl.backends.jax_pjit.engine import JaxPjitEngine  # noqa: E402
from polyrl.config import ModelConfig, OptimConfig, ParallelConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from multihost_host import rl_batch, run, step, weights  # noqa: E402

HOST = Path(__file__).with_name("multihost_host.py")
# The two runs execute the same jitted programs on the same mesh shape; only the
# all-reduces differ (gloo across processes vs XLA's in-process reduction), which may
# reorder fp32 sums: a few ulps of the O(1) losses, and Adam turns that into at most 1%
# of the learning rate (1e-2) on a weight (as in test_jax_engine.py).
TOL = 2e-5
TOL_WEIGHTS = 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(model_dir: Path, devices: int) -> JaxPjitEngine:
    engine = JaxPjitEngine(devices=jax.devices()[:devices])
    engine.init(
        ModelConfig(str(model_dir)),
        OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=0.5),
        ParallelConfig(mesh={"data": devices}, micro_batch_size=2),
    )
    return engine


def _hosts(model_dir: Path, tmp: Path) -> list[dict[str, np.ndarray]]:
    """Run the two hosts of multihost_host.py; each one's arrays."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
            "POLYRL_JAX_COORDINATOR": f"127.0.0.1:{port}",
            "POLYRL_JAX_NUM_PROCESSES": "2",
            "POLYRL_JAX_PROCESS_ID": str(rank),
            # the fresh engines compile the first one's programs again: share the cache
            "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        }
        cmd = [sys.executable, str(HOST), str(model_dir), str(tmp / f"host{rank}.npz")]
        cmd += [str(tmp / "ckpt_one"), str(tmp / "ckpt_two")]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    try:
        logs = [p.communicate(timeout=600)[0].decode()[-3000:] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], logs
    return [dict(np.load(tmp / f"host{r}.npz")) for r in range(2)]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """One process (2 devices): two steps, save ``ckpt_one``, a third step. Then the two
    hosts (see multihost_host.py). Then one process loads the hosts' ``ckpt_two`` on 2
    devices and on 1 device, and takes the third step from it."""
    tmp = tmp_path_factory.mktemp("multihost")
    batch = rl_batch()
    engine = _engine(tiny_model_dir, 2)
    one = run(engine, batch)
    engine.save(str(tmp / "ckpt_one"))
    one.update(step(engine, batch, "next/"))
    hosts = _hosts(tiny_model_dir, tmp)
    loaded = {}
    for devices, fresh in ((2, engine), (1, _engine(tiny_model_dir, 1))):
        fresh.load(str(tmp / "ckpt_two"))
        loaded[devices] = {**weights(fresh), **step(fresh, batch, "next/")}
    return one, hosts, loaded


def _weights(arrays: dict[str, np.ndarray], prefix: str = "w/") -> dict[str, np.ndarray]:
    return {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}


def test_two_processes_equal_one(runs):
    one, hosts, _ = runs
    # Each host gets its own rows back; together they are the single process's.
    both = np.concatenate([h["log_probs"] for h in hosts])
    np.testing.assert_allclose(both, one["log_probs"], atol=TOL)
    for h in hosts:
        np.testing.assert_allclose(h["loss"], one["loss"], atol=TOL)
        np.testing.assert_allclose(h["grad_norm"], one["grad_norm"], atol=TOL)
        weights = _weights(h)
        assert weights.keys() == _weights(one).keys()
        for k, w in weights.items():
            np.testing.assert_allclose(w, one[f"w/{k}"], atol=TOL_WEIGHTS, err_msg=k)
    assert one["loss"][0] != one["loss"][1]  # the second step saw the first's update


def _same(found: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    assert found.keys() == want.keys() and found, what
    for k in want:
        np.testing.assert_array_equal(found[k], want[k], err_msg=f"{what}: {k}")


def test_checkpoints_move_between_process_counts(runs):
    one, hosts, loaded = runs
    for rank, h in enumerate(hosts):
        where = f"host {rank}"
        # offload + reload on both hosts, and a fresh pair of engines loading the hosts'
        # checkpoint, take the very same third step (bit for bit: same programs, same
        # collectives), so the checkpoint holds the weights, optimizer state and step.
        _same(_weights(h, "loaded/w/"), _weights(h), f"{where}: weights loaded from ckpt_two")
        assert h["reloaded/loss"] == h["resumed/loss"], where
        _same(_weights(h, "resumed/w/"), _weights(h, "reloaded/w/"), f"{where}: third step")
        # The single process's checkpoint loads into the two hosts exactly, and its
        # third step is the single process's third step (up to the all-reduce order).
        assert int(h["from_one/step"]) == 2
        _same(_weights(h, "from_one/w/"), _weights(one), f"{where}: weights from ckpt_one")
        np.testing.assert_allclose(h["from_one/next/loss"], one["next/loss"], atol=TOL)
        np.testing.assert_allclose(h["resumed/loss"], one["next/loss"], atol=TOL)
        assert h["resumed/loss"] != h["loss"][1]  # the third step is a new step
    # The hosts' checkpoint loads into one process on 2 devices and on 1 (fewer hosts,
    # a smaller mesh) exactly, and the step from it is the hosts' third step.
    for devices, got in loaded.items():
        _same(_weights(got), _weights(hosts[0]), f"ckpt_two on 1 process x {devices} devices")
        np.testing.assert_allclose(got["next/loss"], hosts[0]["resumed/loss"], atol=TOL)
        for k, w in _weights(got, "next/w/").items():
            np.testing.assert_allclose(w, hosts[0][f"resumed/w/{k}"], atol=TOL_WEIGHTS, err_msg=k)
