"""Bucketed trainer -> rollout weight transfer.

A trainer's ``TrainEngine.export_weights(bucket_bytes)`` yields buckets: lists of
``(hf_name, array)`` with full tensors under Hugging Face names — ``torch.Tensor``
from the torch backend, ``jax.Array`` from the JAX backend. :class:`WeightSyncer`
streams them to every rollout server's vLLM workers, which load them in place
(``polyrl.rollout.worker_ext``); each server then resets its prefix cache and bumps
its weight version.

Modules:

* ``packing``: the bucket forms every transport moves (torch tensors through DLPack,
  one flat uint8 buffer, host arrays, a file in host shared memory). A bucket itself
  (``iter_buckets``, ``LazyPairs``, ``OwnBucket``) is defined in
  ``polyrl.backends.buckets``, which the backends export in.
  A backend whose arrays are not torch tensors packs its own buckets through its
  registry entry's array bridge (``polyrl.backends.base.ArrayBridge``; JAX: one XLA
  program on the device).
* ``base``: the transport interface (send a bucket, acknowledge, recover, the
  placement problems validate-config reports).
* ``object_store``, ``cuda_ipc``, ``nccl``: one transport each (their docstrings say
  when each fits); ``registry``: every transport by name, the one place that interprets
  ``RunConfig.weight_transport`` (others pass the name to its functions).
* ``syncer``: :class:`WeightSyncer`, a push through any transport, and
  :class:`SyncStats`.

Controller core: torch, jax and ray are imported inside functions. Backends import
nothing of it (setup.cfg's import contracts).
"""

from polyrl.backends.buckets import LazyPairs, OwnBucket, TensorMeta, iter_buckets
from polyrl.weight_sync.cuda_ipc import ipc_peers, local_gpu_uuids, replaced_ipc_buffers
from polyrl.weight_sync.nccl import group_broadcast, join_group
from polyrl.weight_sync.packing import (
    host_payload,
    host_unpack,
    map_shared,
    pack_flat,
    shared_file,
    to_torch,
    unpack_flat,
)
from polyrl.weight_sync.registry import (
    TRANSPORTS,
    bucket_bytes,
    get_transport,
    stream_transport_problems,
    transport_problems,
)
from polyrl.weight_sync.syncer import SyncStats, WeightSyncer

__all__ = [
    "TRANSPORTS",
    "bucket_bytes",
    "get_transport",
    "SyncStats",
    "group_broadcast",
    "ipc_peers",
    "join_group",
    "local_gpu_uuids",
    "transport_problems",
    "stream_transport_problems",
    "TensorMeta",
    "WeightSyncer",
    "iter_buckets",
    "pack_flat",
    "replaced_ipc_buffers",
    "to_torch",
    "unpack_flat",
    "host_payload",
    "host_unpack",
    "shared_file",
    "map_shared",
    "LazyPairs",
    "OwnBucket",
]
