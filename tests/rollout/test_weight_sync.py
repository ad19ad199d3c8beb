"""weight_sync without servers: conversions and packing (a flat buffer, host arrays, a
shared file) are bit-exact for torch, jax and numpy sources (checked against numpy's own
view of the bytes), bucketing respects its size, and the syncer rejects bad setups with
messages that name the fix."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch

from polyrl import weight_sync as ws
from polyrl.backends.jax_pjit import bridge as jax_bridge
from polyrl.weight_sync import packing as ws_packing
from polyrl.weight_sync.cuda_ipc import CudaIpc


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

    with ws.shared_file(bucket) as (path, metas, nbytes):
        pairs = ws.map_shared(path, metas, nbytes)
    assert not os.path.exists(path)  # deleted on exit; the mapping made before stays
    for name, t in pairs:
        assert (_bits(t), t.dtype, tuple(t.shape)) == want[name]


def test_a_shared_file_goes_where_there_is_room_and_says_so_where_none_is(monkeypatch, tmp_path):
    """A bucket's shared file is reserved before it is written: where /dev/shm has no room
    it goes to the temp dir (a full tmpfs would kill the writer with SIGBUS mid-copy),
    and where neither has, the error names the size and the fix; nothing is left behind."""
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir(), tmp.mkdir()
    monkeypatch.setattr(ws_packing, "SHM_DIR", str(shm))
    monkeypatch.setattr(ws_packing.tempfile, "gettempdir", lambda: str(tmp))
    full = {str(shm)}
    reserve = os.posix_fallocate

    def fallocate(fd, offset, length):
        if os.path.dirname(os.readlink(f"/proc/self/fd/{fd}")) in full:
            raise OSError(errno.ENOSPC, "No space left on device")
        reserve(fd, offset, length)

    monkeypatch.setattr(ws_packing.os, "posix_fallocate", fallocate)
    bucket = [("w", torch.arange(3 << 18, dtype=torch.float32))]  # 3 MiB
    with ws.shared_file(bucket) as (path, metas, nbytes):
        assert os.path.dirname(path) == str(tmp) and not list(shm.iterdir())
        pairs = ws.map_shared(path, metas, nbytes)
        assert torch.equal(dict(pairs)["w"], bucket[0][1])
    full.add(str(tmp))
    with (
        pytest.raises(OSError, match=r"no room for a 3 MiB weight bucket.*weight_bucket_mb"),
        ws.shared_file(bucket),
    ):
        pass
    assert not list(shm.iterdir()) and not list(tmp.iterdir())


def test_to_torch_is_zero_copy_for_torch_and_single_device_jax():
    import jax.numpy as jnp

    t = torch.ones(4)
    assert ws.to_torch(t) is t
    j = jnp.arange(6, dtype=jnp.float32)
    assert ws.to_torch(j).data_ptr() == j.unsafe_buffer_pointer()


@pytest.fixture
def device_arrays(monkeypatch):
    """Forbids weight_sync's numpy path and records the arrays that jax.device_put (the
    on-device gather) and the jitted packer return, so a test can check a torch tensor
    aliases one of them: zero-copy from a device buffer, no host round trip."""
    import jax

    made = []

    def host(*args, **kwargs):
        raise AssertionError("a jax array was materialised with numpy")

    def device_put(*args, **kwargs):
        made.append(put(*args, **kwargs))
        return made[-1]

    def packer(*key):
        def run(*arrays):
            made.append(jitted(*key)(*arrays))
            return made[-1]

        return run

    put, jitted = jax.device_put, jax_bridge._packer
    monkeypatch.setattr(ws_packing, "_numpy_to_torch", host)
    monkeypatch.setattr(jax, "device_put", device_put)
    monkeypatch.setattr(jax_bridge, "_packer", packer)
    return made


def _aliases(t: torch.Tensor, arrays) -> bool:
    return any(t.data_ptr() == a.unsafe_buffer_pointer() for a in arrays)


def _sharded():
    """A [8, 4] float32 sharded over 4 CPU devices by rows, one replicated, one bf16
    sharded by columns, and the numpy values they hold."""
    import jax
    import ml_dtypes
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    a = np.arange(32, dtype=np.float32).reshape(8, 4)
    r = np.linspace(-1, 1, 6, dtype=np.float32)
    b = (np.arange(16).reshape(2, 8) / 3).astype(ml_dtypes.bfloat16)
    arrays = [
        ("rows", jax.device_put(a, NamedSharding(mesh, PartitionSpec("d")))),
        ("replicated", jax.device_put(r, NamedSharding(mesh, PartitionSpec()))),
        ("cols.bf16", jax.device_put(b, NamedSharding(mesh, PartitionSpec(None, "d")))),
    ]
    return arrays, {"rows": a, "replicated": r, "cols.bf16": b}


def test_to_torch_gathers_sharded_arrays_on_device(device_arrays):
    arrays, want = _sharded()
    device_arrays.clear()  # _sharded's own device_puts
    assert all(len(x.sharding.device_set) == 4 for _, x in arrays)
    for name, x in arrays:
        t = ws.to_torch(x)
        assert _bits(t) == want[name].tobytes() and tuple(t.shape) == want[name].shape
        # the replicated array's local shard is used as is; the others are gathered
        local = [x.addressable_shards[0].data] if name == "replicated" else device_arrays
        assert _aliases(t, local)
    assert len(device_arrays) == 2


def test_jax_buckets_pack_on_device_like_torch_buckets(device_arrays):
    """pack_flat of sharded jax arrays (XLA packs into a torch buffer it gets by DLPack)
    gives the metadata pack_flat gives for torch tensors of the same values, and views
    with their bytes."""
    arrays, want = _sharded()
    device_arrays.clear()
    flat, metas = ws.pack_flat(arrays)
    assert len(device_arrays) == 3  # two gathers on device, then the packer: no numpy
    as_torch = {
        "rows": torch.from_numpy(want["rows"]),
        "replicated": torch.from_numpy(want["replicated"]),
        "cols.bf16": torch.from_numpy(want["cols.bf16"].view(np.uint16)).view(torch.bfloat16),
    }
    assert metas == ws.pack_flat(list(as_torch.items()))[1]
    for name, t in ws.unpack_flat(flat, metas):
        assert _bits(t) == want[name].tobytes() and t.dtype == as_torch[name].dtype
    buffer = torch.full((len(flat) + 512,), 7, dtype=torch.uint8)
    own = ws.pack_flat(arrays, alloc=lambda n, device: buffer)[0]
    assert own.data_ptr() == buffer.data_ptr() and len(own) == len(flat)
    assert [_bits(t) for _, t in ws.unpack_flat(own, metas)] == [
        _bits(t) for _, t in ws.unpack_flat(flat, metas)
    ]
    assert (buffer[len(flat) :] == 7).all()


@pytest.mark.gpu
def test_jax_pack_writes_straight_into_the_torch_buffer_on_gpu(device_arrays):
    """On GPU, XLA's pack program writes a JAX bucket into the torch buffer it donates
    (a CUDA IPC slot, say): its output is that buffer, no copy follows, and the bytes
    are the arrays' (cast to bf16 where asked)."""
    import jax
    import ml_dtypes

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus or not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU visible to JAX (JAX_PLATFORMS=cuda,cpu) and torch")
    rng = np.random.default_rng(3)
    a = rng.standard_normal((300, 7)).astype(np.float32)
    b = rng.standard_normal((5,)).astype(np.float32)
    bucket = [("a", jax.device_put(a, gpus[0])), ("b", jax.device_put(b, gpus[0]))]
    buffer = torch.full((16384,), 7, dtype=torch.uint8, device="cuda:0")
    packed = []
    for dtype, want in [(None, [a, b]), (np.dtype(ml_dtypes.bfloat16), None)]:
        device_arrays.clear()
        names, arrays = ["a", "b"], [x for _, x in bucket]
        flat, metas = jax_bridge.pack_arrays(names, arrays, dtype, alloc=lambda n, device: buffer)
        assert flat.data_ptr() == buffer.data_ptr()
        assert device_arrays[-1].unsafe_buffer_pointer() == buffer.data_ptr()  # in place
        want = want or [x.astype(ml_dtypes.bfloat16) for x in (a, b)]
        got = [_bits(t.cpu()) for _, t in ws.unpack_flat(flat, metas)]
        assert got == [x.tobytes() for x in want]
        packed.append(len(flat))
    assert packed[0] == 8704 and (buffer[packed[0] :] == 7).all()  # the fp32 pack, the longer


def test_packing_into_a_kept_buffer_writes_each_push_and_layout():
    """pack_flat into a buffer that stays (a CUDA IPC slot) reuses its views of each layout:
    every push must still land its own values, a transposed (non-contiguous) tensor
    row-major, and a second layout or a second buffer its own bytes."""
    import ml_dtypes

    rng = np.random.default_rng(1)
    buffers = [torch.zeros(4096, dtype=torch.uint8) for _ in range(2)]
    for step in range(3):
        a = rng.standard_normal((6, 4)).astype(np.float32)
        b = rng.standard_normal((5,)).astype(np.float32)
        layouts = {
            "one": [("a", torch.from_numpy(a).T), ("b", torch.from_numpy(b).bfloat16())],
            "two": [("b", torch.from_numpy(b))],
        }
        want = {
            "one": {
                "a": np.ascontiguousarray(a.T).tobytes(),
                "b": b.astype(ml_dtypes.bfloat16).tobytes(),
            },
            "two": {"b": b.tobytes()},
        }
        for buffer in buffers:
            for name, bucket in layouts.items():
                flat, metas = ws.pack_flat(bucket, alloc=lambda n, device, b=buffer: b)
                assert flat.data_ptr() == buffer.data_ptr()
                got = {n: _bits(t) for n, t in ws.unpack_flat(flat, metas)}
                assert got == want[name], (step, name)


def test_iter_buckets_groups_by_size_and_keeps_order():
    named = [(f"w{i}", np.zeros(n, dtype=np.float32)) for i, n in enumerate([10, 10, 30, 5, 5])]
    buckets = list(ws.iter_buckets(named, bucket_bytes=80))  # 80 bytes = 20 floats
    assert [[n for n, _ in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3", "w4"]]
    with pytest.raises(ValueError, match="bucket_bytes=0 must be > 0"):
        list(ws.iter_buckets(named, 0))


def test_bucket_size_is_the_transports_unless_bound():
    """RunConfig.weight_bucket_mb=None: CUDA IPC takes 1 GiB buckets (a 1.5B model's
    3.1 GB in 3 Ray calls per server), the host and broadcast paths 64 MiB; a bound size
    wins for every transport."""
    assert ws.bucket_bytes("cuda_ipc") == 1 << 30
    assert ws.bucket_bytes("object_store") == ws.bucket_bytes("nccl") == 64 << 20
    for transport in ws.TRANSPORTS:
        assert ws.bucket_bytes(transport, 0.5) == 1 << 19


def test_syncer_errors_name_the_fix():
    with pytest.raises(
        ValueError, match=r"transport='shm' is not one of \['object_store', 'cuda_ipc', 'nccl'\]"
    ):
        ws.WeightSyncer([], "shm")
    with pytest.raises(
        ValueError, match="CUDA IPC needs CUDA tensors; use transport='object_store'"
    ):
        CudaIpc().send(ws.WeightSyncer([], "cuda_ipc"), [("a", torch.ones(2))], ws.SyncStats(0, ""))
    with pytest.raises(RuntimeError, match=r"not joined the broadcast group; call ensure_group"):
        syncer = ws.WeightSyncer([], "nccl")
        syncer.strategy.send(syncer, [("a", torch.ones(2))], ws.SyncStats(0, ""))
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


def test_a_worker_lets_go_of_the_ipc_buffers_a_new_key_replaces():
    """A worker keeps each CUDA IPC buffer it opened until the sender replaces it: a new
    buffer of the same parity (the old one was too small), or a new sender process (the
    trainer worker restarted). The other parity's buffer of the same sender stays open."""
    opened = ["100-0-aaaa", "100-1-bbbb"]
    assert ws.replaced_ipc_buffers(opened, "100-0-cccc") == ["100-0-aaaa"]
    assert ws.replaced_ipc_buffers(opened, "100-1-dddd") == ["100-1-bbbb"]
    assert ws.replaced_ipc_buffers(opened, "200-0-eeee") == opened
    # pid 1000 is another process than pid 100, though "1000-" starts with "100"
    assert ws.replaced_ipc_buffers(["1000-0-ffff", "100-1-bbbb"], "100-0-cccc") == ["1000-0-ffff"]
    assert ws.replaced_ipc_buffers([], "100-0-cccc") == []


def test_each_transport_picks_its_pushing_ranks():
    """Object store and NCCL: trainer rank 0 pushes to every server, the other ranks only
    join the gathers. CUDA IPC: every rank pushes, to the servers on its own GPUs; a
    process that sees no GPU (this one) has none of them."""
    servers = ["s0", "s1"]
    for transport in ("object_store", "nccl"):
        syncer = ws.WeightSyncer(servers, transport)
        assert syncer.for_rank(0) is syncer and syncer.for_rank(1) is None
    ipc = ws.WeightSyncer(servers, "cuda_ipc", devices=["GPU-a", "GPU-b"])
    for rank in (0, 1):
        mine = ipc.for_rank(rank)
        assert mine is not ipc and mine.servers == [] and mine.devices == []
    assert ipc.servers == servers  # the controller's syncer keeps them all


def test_the_registry_names_the_binding_and_each_transports_defaults():
    assert list(ws.TRANSPORTS) == ["object_store", "cuda_ipc", "nccl"]
    with pytest.raises(ValueError, match=r"^RunConfig.weight_transport='ipc' is not one of"):
        ws.get_transport("ipc", "RunConfig.weight_transport")
    (msg,) = ws.transport_problems("ipc", "a", "a", {"a": {"CPU": 1}})
    assert msg.startswith("RunConfig.weight_transport='ipc' is not one of ['object_store'")
    # only the object store keeps its buckets for a restarted server's replay
    assert [ws.WeightSyncer([], t).retain for t in ws.TRANSPORTS] == [True, False, False]
