"""GPU ids with several GPUs per node, on a real Ray cluster that declares GPUs this
machine does not have (a head and two worker nodes, each `ray start --num-gpus 2`; Ray
hands out GPU ids and CUDA_VISIBLE_DEVICES all the same). gpu_map_driver.py builds each
layout's role table and Placement as `polyrl train` does and starts every role worker
(never its engine: nothing touches CUDA) and a stand-in for every rollout server with the
Ray options polyrl computes; this test checks what each one sees:

- colocated: actor rank r, reference rank r and rollout server r share one GPU, the
  ranks of a role have distinct GPUs, a JAX host worker sees every GPU of its node's
  share of the mesh and is pinned to JAX_PLATFORMS=cuda although the nodes were started
  with JAX_PLATFORMS=cpu (the driver's environment, as with a local Ray start);
- disaggregated pools on one node get disjoint GPUs;
- pools over two nodes map each node's ranks onto that node's GPUs;
- the CUDA IPC peer matching (``polyrl.weight_sync.ipc_peers``) gives every server
  exactly one pushing trainer worker, on the server's own GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from polyrl.weight_sync import ipc_peers

pytestmark = pytest.mark.slow  # a 3-node cluster and ~26 Ray workers: about a minute
HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from local_cluster import cluster_env, local_cluster  # noqa: E402

COLOCATED = [
    "polyrl.RunConfig.pools = {'gpu': {'CPU': 2, 'GPU': 2, 'node_a': 1}}",
    "actor/polyrl.RoleConfig.pool = 'gpu'",
    "reference/polyrl.RoleConfig.pool = 'gpu'",
    "polyrl.RolloutConfig.pool = 'gpu'",
    "polyrl.RunConfig.weight_transport = 'cuda_ipc'",
    "actor/polyrl.ParallelConfig.mesh = {'fsdp': 2}",
    "reference/polyrl.ParallelConfig.mesh = {'fsdp': 2}",
    "polyrl.RolloutConfig.num_servers = 2",
]
TWO_NODES = [
    "polyrl.RunConfig.pools = {'gpu': {'CPU': 2, 'GPU': 2, 'nodes': 2}}",
    "actor/polyrl.RoleConfig.pool = 'gpu'",
    "reference/polyrl.RoleConfig.pool = 'gpu'",
    "polyrl.RolloutConfig.pool = 'gpu'",
    "actor/polyrl.ParallelConfig.mesh = {'data': 2, 'fsdp': 2}",
    "polyrl.RolloutConfig.num_servers = 2",
    "polyrl.RolloutConfig.tensor_parallel_size = 2",
]
LAYOUTS = {
    "torch_colocated": ["polyrl.RunConfig.backend = 'torch_fsdp'", *COLOCATED],
    "jax_colocated": ["polyrl.RunConfig.backend = 'jax_pjit'", *COLOCATED],
    "disaggregated": [
        "polyrl.RunConfig.backend = 'torch_fsdp'",
        "polyrl.RunConfig.pools = {'train': {'CPU': 1, 'GPU': 1, 'node_a': 0.5}, "
        "'gen': {'CPU': 1, 'GPU': 1, 'node_a': 0.5}}",
        "actor/polyrl.RoleConfig.pool = 'train'",
        "reference/polyrl.RoleConfig.pool = 'train'",
        "polyrl.RolloutConfig.pool = 'gen'",
        "polyrl.RunConfig.weight_transport = 'nccl'",
    ],
    "torch_two_nodes": ["polyrl.RunConfig.backend = 'torch_fsdp'", *TWO_NODES],
    "jax_two_nodes": ["polyrl.RunConfig.backend = 'jax_pjit'", *TWO_NODES],
}


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gpu_map")
    nodes = [{"CPU": 2, "GPU": 2, name: 1} for name in ("node_a", "node_b")]
    with local_cluster({"CPU": 1}, nodes) as address:
        cmd = [sys.executable, str(HERE / "gpu_map_driver.py"), str(run_dir), json.dumps(LAYOUTS)]
        env = {**cluster_env(address), "JAX_PLATFORMS": "cpu"}
        out = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=600, cwd=HERE.parents[1]
        )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gpus(workers: list[dict]) -> list[list[str]]:
    """Each worker's GPUs as (node, id) names: GPU ids repeat on every node."""
    return [[f"{w['node']}/{g}" for g in w["gpus"].split(",")] for w in workers]


def _pushers(trainer: list[dict], servers: list[dict]) -> list[list[int]]:
    """For each server, the trainer workers whose CUDA IPC peers include it (a GPU's
    (node, id) stands in for its UUID; a server reports its first GPU)."""
    first = [g[0] for g in _gpus(servers)]
    peers = [ipc_peers(first, mine) for mine in _gpus(trainer)]
    return [
        [r for r, p in enumerate(peers) if any(s in v for v in p.values())]
        for s in range(len(servers))
    ]


def test_colocated_torch_ranks_share_a_gpu_with_their_server(placed):
    got = placed["torch_colocated"]
    actor, ref, rollout = _gpus(got["actor"]), _gpus(got["reference"]), _gpus(got["rollout"])
    assert sorted(actor) == [["node_a/0"], ["node_a/1"]], got
    assert ref == actor and rollout == actor, got
    assert _pushers(got["actor"], got["rollout"]) == [[0], [1]]
    # three roles share each GPU: each asks Ray for a third of one
    asked = [w["num_gpus"] for role in got.values() for w in role]
    assert asked == pytest.approx([1 / 3] * 6)


def test_colocated_jax_worker_drives_both_gpus_pinned_to_cuda(placed):
    got = placed["jax_colocated"]
    (actor,) = got["actor"]
    assert sorted(actor["gpus"].split(",")) == ["0", "1"], got
    assert actor["jax"] == "cuda" and {w["jax"] for w in got["reference"]} == {"cuda"}, got
    # the nodes' own environment says cpu (the servers inherit it): the pin is polyrl's
    assert {w["jax"] for w in got["rollout"]} == {"cpu"}, got
    servers = _gpus(got["rollout"])
    assert sorted(servers) == [["node_a/0"], ["node_a/1"]], got
    assert _pushers(got["actor"], got["rollout"]) == [[0], [0]]  # one worker feeds both


def test_disaggregated_pools_get_disjoint_gpus(placed):
    got = placed["disaggregated"]
    train = {g for role in ("actor", "reference") for w in _gpus(got[role]) for g in w}
    gen = {g for w in _gpus(got["rollout"]) for g in w}
    assert len(train) == 1 and len(gen) == 1 and not train & gen, got
    assert train | gen == {"node_a/0", "node_a/1"}


def test_pools_over_two_nodes_map_each_nodes_gpus(placed):
    torch_, jax_ = placed["torch_two_nodes"], placed["jax_two_nodes"]
    # torch HSDP (data=2 x fsdp=2): ranks 0-1 on one node, 2-3 on the other, one GPU each
    ranks = _gpus(torch_["actor"])
    nodes = [w["node"] for w in torch_["actor"]]  # Ray picks which node is the first
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3], torch_
    assert sorted(g for r in ranks for g in r) == ["node_a/0", "node_a/1", "node_b/0", "node_b/1"]
    # JAX: one host worker per node, each on both of its node's GPUs, pinned to cuda
    hosts = jax_["actor"]
    assert sorted(h["node"] for h in hosts) == ["node_a", "node_b"], jax_
    assert all(sorted(h["gpus"].split(",")) == ["0", "1"] and h["jax"] == "cuda" for h in hosts)
    for got in (torch_, jax_):
        # a tensor-parallel-2 server per node, on both of its node's GPUs
        assert sorted(_gpus(got["rollout"])) == [
            ["node_a/0", "node_a/1"],
            ["node_b/0", "node_b/1"],
        ], got
    assert _pushers(hosts, jax_["rollout"]) == [[0], [1]]
