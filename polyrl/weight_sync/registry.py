"""Every weight transport by name: the one place that interprets ``RunConfig.weight_transport``
(other modules pass the name to the functions here and never compare it).

A new transport (LoRA adapters, say) is a :class:`~polyrl.weight_sync.base.Transport`
subclass in its own module and one line here.
"""

from __future__ import annotations

from typing import Any

from polyrl.weight_sync.base import SyncPlacement, Transport
from polyrl.weight_sync.cuda_ipc import CudaIpc
from polyrl.weight_sync.nccl import Nccl
from polyrl.weight_sync.object_store import ObjectStore

__all__ = [
    "TRANSPORTS",
    "get_transport",
    "bucket_bytes",
    "transport_problems",
    "stream_transport_problems",
]

TRANSPORTS: dict[str, type[Transport]] = {t.name: t for t in (ObjectStore, CudaIpc, Nccl)}


def get_transport(name: str, binding: str = "transport") -> Transport:
    """A new instance of transport ``name``; an unknown name is a ValueError naming
    ``binding`` and the registered names."""
    if name not in TRANSPORTS:
        raise ValueError(f"{binding}={name!r} is not one of {list(TRANSPORTS)}")
    return TRANSPORTS[name]()


def bucket_bytes(transport: str, mb: float | None = None) -> int:
    """One bucket's bytes: ``mb`` MiB, or the transport's default (``bucket_mb``) if None.
    Each bucket costs a Ray call to every server: CUDA IPC takes 1 GiB, the others 64 MiB
    (docs/performance.md "Weight sync")."""
    return int((TRANSPORTS[transport].bucket_mb if mb is None else mb) * 2**20)


def transport_problems(
    transport: str,
    actor_pool: str,
    rollout_pool: str,
    pools: Any,
    tensor_parallel: int = 1,
) -> list[str]:
    """What ``RunConfig.weight_transport`` cannot do on this placement (validate-config):
    ``pools`` is RunConfig.pools, ``tensor_parallel`` the rollout's tensor_parallel_size
    (see each transport's ``problems``)."""
    try:
        chosen = get_transport(transport, "RunConfig.weight_transport")
    except ValueError as e:
        return [str(e)]
    return chosen.problems(_placement(actor_pool, rollout_pool, pools, tensor_parallel))


def _placement(actor_pool: str, rollout_pool: str, pools: Any, tensor_parallel: int = 1):
    gpus = {p: float(dict(pools.get(p, {})).get("GPU", 0)) > 0 for p in (actor_pool, rollout_pool)}
    return SyncPlacement(actor_pool, rollout_pool, gpus, tensor_parallel)


def stream_transport_problems(
    transport: str, actor_pool: str, rollout_pool: str, pools: Any
) -> list[str]:
    """What ``RunConfig.streaming=True`` needs of ``RunConfig.weight_transport``: with the
    actor and the rollout on separate GPUs every push pauses the stream's rounds, so the
    weights must go GPU to GPU (a transport with ``between_gpus``), not through host
    memory. An unknown name is left to :func:`transport_problems`."""
    where = _placement(actor_pool, rollout_pool, pools)
    chosen = TRANSPORTS.get(transport)
    if chosen is None or chosen.between_gpus or where.colocated or not all(where.gpus.values()):
        return []
    fit = [name for name, t in TRANSPORTS.items() if t.between_gpus]
    return [
        f"RunConfig.streaming=True with the actor (pool {actor_pool!r}) and the rollout (pool "
        f"{rollout_pool!r}) on separate GPUs needs RunConfig.weight_transport={fit[0]!r} (got "
        f"{transport!r}): every push pauses the stream's rounds, and {transport!r} carries "
        f"the weights through host memory"
    ]
