"""weight_sync without servers: conversions and packing are bit-exact for torch, jax and
numpy sources (checked against numpy's own view of the bytes), bucketing respects its
size, and the syncer rejects bad setups with messages that name the fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from polyrl import weight_sync as ws


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _sources():
    import jax.numpy as jnp
    import ml_dtypes

    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 7)).astype(np.float32)
    b = rng.standard_normal((3,)).astype(np.float32)
    return {
        "torch": [("a", torch.from_numpy(a)), ("b.bf16", torch.from_numpy(b).bfloat16())],
        "jax": [("a", jnp.asarray(a)), ("b.bf16", jnp.asarray(b, dtype=jnp.bfloat16))],
        "numpy": [("a", a), ("b.bf16", b.astype(ml_dtypes.bfloat16))],
    }, (a, b.astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("source", ["torch", "jax", "numpy"])
def test_to_torch_and_packing_are_bit_exact(source):
    sources, (a, b_bf16) = _sources()
    bucket = sources[source]
    # Independent expectation: numpy's bytes of the same values.
    want = {
        "a": (a.tobytes(), torch.float32, (5, 7)),
        "b.bf16": (b_bf16.tobytes(), torch.bfloat16, (3,)),
    }

    for name, t in ((n, ws.to_torch(x)) for n, x in bucket):
        assert (_bits(t), t.dtype, tuple(t.shape)) == want[name]

    flat, metas = ws.pack_flat(bucket)
    assert flat.dtype == torch.uint8 and all(m[3] % 256 == 0 for m in metas)
    for name, t in ws.unpack_flat(flat, metas):
        assert (_bits(t), t.dtype, tuple(t.shape)) == want[name]

    arrays, metas = ws.host_payload(bucket)
    for name, t in ws.host_unpack(arrays, metas):
        assert (_bits(t), t.dtype, tuple(t.shape)) == want[name]


def test_to_torch_is_zero_copy_for_torch_and_single_device_jax():
    import jax.numpy as jnp

    t = torch.ones(4)
    assert ws.to_torch(t) is t
    j = jnp.arange(6, dtype=jnp.float32)
    assert ws.to_torch(j).data_ptr() == j.unsafe_buffer_pointer()


def test_to_torch_gathers_an_array_sharded_over_devices():
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = np.array(jax.devices()[:4])
    x = jax.device_put(
        np.arange(32, dtype=np.float32).reshape(8, 4),
        NamedSharding(Mesh(devices, ("d",)), PartitionSpec("d")),
    )
    np.testing.assert_array_equal(ws.to_torch(x).numpy(), np.arange(32).reshape(8, 4))


def test_iter_buckets_groups_by_size_and_keeps_order():
    named = [(f"w{i}", np.zeros(n, dtype=np.float32)) for i, n in enumerate([10, 10, 30, 5, 5])]
    buckets = list(ws.iter_buckets(named, bucket_bytes=80))  # 80 bytes = 20 floats
    assert [[n for n, _ in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3", "w4"]]
    with pytest.raises(ValueError, match="bucket_bytes=0 must be > 0"):
        list(ws.iter_buckets(named, 0))


def test_syncer_errors_name_the_fix():
    with pytest.raises(
        ValueError, match=r"transport='shm' is not one of \['object_store', 'cuda_ipc', 'nccl'\]"
    ):
        ws.WeightSyncer([], "shm")
    with pytest.raises(
        ValueError, match="CUDA IPC needs CUDA tensors; use transport='object_store'"
    ):
        ws.WeightSyncer([], "cuda_ipc")._send_ipc([("a", torch.ones(2))])
    with pytest.raises(RuntimeError, match=r"not joined the broadcast group; call ensure_group"):
        ws.WeightSyncer([], "nccl")._send_nccl([("a", torch.ones(2))])
    with pytest.raises(ValueError, match="empty bucket"):
        ws.pack_flat([])


def test_ipc_peers_pick_the_servers_on_this_process_gpus():
    servers = ["GPU-b", "GPU-a", None, "GPU-c", "GPU-a"]  # each server's (first) GPU UUID
    # a torch rank sees one GPU: the servers on it, under CUDA ordinal 0
    assert ws.ipc_peers(servers, ["GPU-a"]) == {0: [1, 4]}
    # a JAX host worker sees several: each server under the ordinal of its own GPU
    assert ws.ipc_peers(servers, ["GPU-a", "GPU-b"]) == {0: [1, 4], 1: [0]}
    assert ws.ipc_peers(servers, ["GPU-d"]) == {} and ws.ipc_peers(servers, []) == {}


def test_stats_report_rate():
    s = ws.SyncStats(version=1, transport="object_store", bytes=2_000_000_000, seconds=2.0)
    assert s.gbps == pytest.approx(1.0) and s.summary()["gbps"] == pytest.approx(1.0)
