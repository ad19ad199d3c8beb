"""Transport ``"cuda_ipc"``: colocated trainer and server on the same GPU.

Each bucket is packed into one flat device buffer whose CUDA IPC handle the workers
open in place (no copy off the GPU). Every trainer rank pushes to the servers on its own
GPU (:meth:`CudaIpc.pusher`). The buffers persist: each pushing process keeps two per
GPU (:func:`_ipc_slot`; bucket ``i`` goes to buffer ``i % 2``, the one the servers
finished with), and each worker keeps what it opened by the buffer's key, so after the
first push a bucket costs the copy into the buffer and the load, with no IPC handle made
or opened. They cost two buckets of device memory in the pushing process for its
lifetime. Each buffer has an interprocess CUDA event, recorded once a bucket's copies
into it are queued: the workers' copies out of it wait for that event on the GPU, so the
pusher sends each bucket without waiting for its copies on the host.

Runs only on GPU: covered by ``gpu``-marked tests (tests/rollout/test_gpu_transports.py,
tests/trainer/test_gpu_sync.py); its placement rules, peer matching and buffer keys are
tested on CPU.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Sequence
from typing import Any

from polyrl.backends.buckets import OwnBucket
from polyrl.weight_sync.base import SyncPlacement, Transport
from polyrl.weight_sync.packing import device_of, pack_flat

__all__ = ["CudaIpc", "ipc_peers", "local_gpu_uuids", "replaced_ipc_buffers"]


class CudaIpc(Transport):
    name = "cuda_ipc"
    # Each bucket is one device copy into a buffer kept for the run (two per GPU), so few
    # large ones: a 1.5B model's 3.1 GB in 3 buckets (docs/performance.md "Weight sync").
    bucket_mb = 1024.0

    def pusher(self, syncer: Any, rank: int) -> Any:
        """Every trainer worker pushes, to the servers on its own GPUs: each shares its
        own device memory (a torch rank has one GPU, a JAX host worker every GPU of its
        share of the mesh)."""
        peers = ipc_peers(syncer.devices, local_gpu_uuids())
        mine = sorted(i for servers in peers.values() for i in servers)
        local = copy.copy(syncer)
        local.servers = [syncer.servers[i] for i in mine]
        local.devices = [syncer.devices[i] for i in mine]
        return local

    def send(self, syncer: Any, bucket: Sequence[tuple[str, Any]], stats: Any):
        import torch

        if isinstance(bucket, OwnBucket):  # (where it sits, without making its pairs)
            devices = [bucket.torch_device]
        else:
            devices = [device_of(a) for _, a in bucket]
        off_gpu = [str(d) for d in devices if d.type != "cuda"]
        if off_gpu:
            raise ValueError(
                f"WeightSyncer(transport='cuda_ipc'): bucket tensors are on {off_gpu[0]}, "
                f"CUDA IPC needs CUDA tensors; use transport='object_store' for host tensors"
            )
        # Bucket ``index`` goes into this process's persistent buffer ``index % 2`` (the
        # servers acknowledged bucket index - 2, its last user, before this one is packed).
        parity = stats.buckets % 2
        flat, metas = pack_flat(bucket, alloc=lambda n, device: _ipc_slot(device, parity, n)[0])
        # One buffer on each of this process's GPUs that holds a server (a JAX host worker
        # drives several; its buckets are gathered onto the first): a device-to-device copy.
        uuids = local_gpu_uuids()
        shared = {flat.device.index: _ipc_slot(flat.device, parity, flat.numel())}
        for ordinal in ipc_peers(syncer.devices, uuids):
            if ordinal not in shared:
                device = torch.device("cuda", ordinal)
                shared[ordinal] = _ipc_slot(device, parity, flat.numel())
                shared[ordinal][0][: flat.numel()].copy_(flat)
        # The workers' reads wait on the GPU for the copies (an IPC event recorded after
        # them), not the host here: the calls below go out while the copies run.
        for buffer, _, _, ready, _ in shared.values():
            ready.record(torch.cuda.current_stream(buffer.device))
        slots = {uuids[o]: (key, handle, ready) for o, (_, key, handle, _, ready) in shared.items()}
        refs = [s.load_bucket_ipc.remote(slots, metas) for s in syncer.servers]
        return refs, None, metas

    def problems(self, placement: SyncPlacement) -> list[str]:
        """Actor and rollout colocated (same pool) on GPUs, servers on one GPU each (a
        pushing worker shares a buffer on the GPUs it drives, and a torch rank drives
        one, while every GPU of a tensor-parallel server needs one), engine core in the
        server's process (vLLM's serializer to an engine-core process refuses the IPC
        handles' rebuild functions, seen on H200 with vLLM 0.26)."""
        if not placement.colocated or not placement.gpus[placement.actor_pool]:
            return [
                f"RunConfig.weight_transport='cuda_ipc' shares GPU memory, so it needs the "
                f"actor and rollout colocated on GPUs (actor/polyrl.RoleConfig.pool = "
                f"polyrl.RolloutConfig.pool, a pool with 'GPU' > 0); placement: {placement.where}. Use 'nccl' for separate GPUs, "
                f"'object_store' otherwise"
            ]
        if placement.tensor_parallel > 1:
            return [
                f"RunConfig.weight_transport='cuda_ipc' with RolloutConfig.tensor_parallel_size="
                f"{placement.tensor_parallel}: CUDA IPC weight sync shares a buffer only with "
                f"servers on one GPU each; set tensor_parallel_size=1, or use 'object_store' "
                f"(or 'nccl' with the rollout in its own pool)"
            ]
        return []


# Each process's persistent CUDA IPC buffers, by (CUDA ordinal, parity): (uint8 buffer, key,
# IPC handle). The key names the buffer to the workers, which keep what they opened under
# it; a buffer too small for a bucket is replaced under a new key.
_IPC_SLOTS: dict[tuple[int, int], tuple[Any, str, Any]] = {}


def replaced_ipc_buffers(opened: Iterable[str], key: str) -> list[str]:
    """The keys of IPC buffers a rollout worker lets go when it first sees buffer ``key``.

    Keys are ``"<sender pid>-<parity>-<id>"`` (:func:`_ipc_slot`): a new key replaces the
    sender's buffer of the same parity (it outgrew it), and a new sender (a restarted
    trainer worker) replaces every buffer of the one before."""
    slot, pid = key.rsplit("-", 1)[0], key.split("-", 1)[0]
    return [k for k in opened if k.rsplit("-", 1)[0] == slot or not k.startswith(f"{pid}-")]


def _ipc_slot(device: Any, parity: int, nbytes: int) -> tuple[Any, str, Any, Any, bytes]:
    """This process's persistent IPC buffer ``parity`` on ``device``, at least
    ``nbytes`` long: (buffer, key, its ``reduce_tensor`` handle, an interprocess CUDA
    event recorded when a bucket is in the buffer, the event's IPC handle), made once."""
    import uuid

    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    device = torch.device(device)
    slot = _IPC_SLOTS.get((device.index, parity))
    if slot is None or slot[0].numel() < nbytes:
        _IPC_SLOTS.pop((device.index, parity), None)  # (freed once no worker maps it)
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        key = f"{os.getpid()}-{parity}-{uuid.uuid4().hex[:12]}"  # (replaced_ipc_buffers)
        ready = torch.cuda.Event(interprocess=True)
        ready.record(torch.cuda.current_stream(device))  # (made on its device by a record)
        slot = (buffer, key, reduce_tensor(buffer), ready, ready.ipc_handle())
        _IPC_SLOTS[(device.index, parity)] = slot
    return slot


def local_gpu_uuids() -> list[str]:
    """The UUIDs of this process's visible GPUs, by CUDA ordinal (none without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def ipc_peers(server_devices: Sequence[str | None], local: Sequence[str]) -> dict[int, list[int]]:
    """CUDA IPC peers: ordinal of each of this process's GPUs (``local``, their UUIDs) ->
    the servers (indices into ``server_devices``, each server's GPU UUID) on that GPU.
    A server on a GPU this process does not see is another trainer worker's peer."""
    peers: dict[int, list[int]] = {}
    for i, device in enumerate(server_devices):
        if device in local:
            peers.setdefault(list(local).index(device), []).append(i)
    return peers
