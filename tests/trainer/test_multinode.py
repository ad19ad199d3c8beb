"""Multi-node placement on a real Ray cluster (a head and two worker nodes, each its own
``ray start`` on this machine, with its own CPUs and custom resources): polyrl joins it
through RAY_ADDRESS, the actor spreads over both worker nodes (torch: a rank per node;
JAX: a host per node joined by jax.distributed) and the tiny GRPO runs two steps, its
weights synced to the server on the head by the object store (and, slow, the "nccl"
broadcast group on gloo); torch HSDP over the two nodes (shard inside a node, replicate
across) equals one rank; (slow) a JAX run on two hosts resumes on one.

The driver runs in its own process (multinode_driver.py): a fresh Ray client, whatever
Ray session this test process had before."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from run_checks import KEYS, assert_same_steps

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from local_cluster import cluster_env, local_cluster  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    # Head: the rollout pool ("head"). Workers: the training pool ("trainer"), and a name
    # each so the test can tell where the actor's workers ran.
    workers = [{"CPU": 2, "trainer": 1, name: 1} for name in ("node_a", "node_b")]
    with local_cluster({"CPU": 2, "head": 1}, workers) as address:
        yield address


def _drive(cluster: str, mode: str, run_dir: Path) -> dict:
    """Run multinode_driver.py MODE against the cluster; its JSON line."""
    cmd = [sys.executable, str(HERE / "multinode_driver.py"), mode, str(run_dir)]
    out = subprocess.run(
        cmd,
        env=cluster_env(cluster),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=HERE.parents[1],
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "backend",
    [
        # 46 s on the 2-core machine; the default tier has the two-node HSDP case below
        pytest.param("torch_fsdp", marks=pytest.mark.slow),
        pytest.param("jax_pjit", marks=pytest.mark.slow),  # the same placement, other backend
        # the broadcast group (gloo on CPU) from the actor's rank 0 on a worker node to
        # the server on the head
        pytest.param("torch_fsdp:nccl", marks=pytest.mark.slow),
        pytest.param("jax_pjit:nccl", marks=pytest.mark.slow),
    ],
)
def test_grpo_actor_spans_both_worker_nodes(cluster, tmp_path, backend):
    result = _drive(cluster, backend, tmp_path / "run")
    # Joined the cluster (its GCS port; Ray reports the node's own IP), did not start one.
    assert result["gcs"].rsplit(":", 1)[1] == cluster.rsplit(":", 1)[1]
    assert sorted(result["actor_nodes"]) == ["node_a", "node_b"]
    last = result["last"]
    assert last["step"] == 2 and math.isfinite(last["actor/loss"]) and "reward/mean" in last
    # step 2 was sampled after step 1's update: the server holds the updated weights
    # (rollout and trainer log-probs agree to fp32 kernel noise, docs/rollout.md)
    assert last["rollout/log_prob_diff_max"] < 1e-4, last


def test_torch_hsdp_over_two_nodes_equals_one_rank(cluster, tmp_path):
    out = _drive(cluster, "hsdp", tmp_path)
    hsdp, one = out["hsdp"], out["one"]
    # Ranks 0-1 (one fsdp group) on one node, ranks 2-3 on the other.
    assert hsdp["nodes"][0] == hsdp["nodes"][1] != hsdp["nodes"][2] == hsdp["nodes"][3]
    # fp32 sums in another order (shards, all-reduce over ranks): a few ulps of O(1)
    # values; after the step, Adam with eps=1e-4 bounds the weight difference at ~1e-7,
    # so the log-probs agree to 1e-5 (tests/backends/torch_fsdp does the same on one node).
    assert hsdp["loss"] == pytest.approx(one["loss"], abs=1e-5)
    assert hsdp["grad_norm"] == pytest.approx(one["grad_norm"], abs=1e-5)
    np.testing.assert_allclose(hsdp["log_probs"], one["log_probs"], atol=1e-5)
    assert one["loss"] > 0


@pytest.mark.slow
def test_jax_run_on_two_hosts_resumes_on_one(cluster, tmp_path):
    """A user changes the node count between runs: the JAX actor's checkpoint written by
    two hosts (jax.distributed, each its own shards) resumes with the actor on one host,
    and step 3 is the uninterrupted run's step 3."""
    out = _drive(cluster, "resume", tmp_path / "run")
    full, resumed = out["full"], out["resumed"]
    assert [r["step"] for r in full] == [r["step"] for r in resumed] == [1, 2, 3]
    assert resumed[:2] == full[:2]  # rows up to the checkpoint are kept as written
    # The same rollouts (weights loaded bit for bit, same seeds); the step's fp32
    # all-reduce runs in another order on one host than over gloo: a few ulps.
    keys = (*KEYS[:3], "rollout/log_prob_diff_max")
    assert_same_steps(resumed[2:], full[2:], keys, rel=1e-5, abs=1e-6)
