"""Transport ``"object_store"``: each bucket is ``ray.put`` once (host shared memory, one
copy; Ray moves it between nodes) and every server reads it zero-copy. Works on CPU and
across nodes, on any placement. The pushed buckets can be *retained* (kept as object
refs) so a server that Ray restarts is re-synced from them (``WeightSyncer.replay``),
and a server that dies during a push is left out of it (``SyncStats.lost``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from polyrl.weight_sync.base import SyncPlacement, Transport
from polyrl.weight_sync.packing import host_payload

__all__ = ["ObjectStore"]


class ObjectStore(Transport):
    name = "object_store"
    # Each bucket is copied through host memory: small ones stream.
    bucket_mb = 64.0
    retains = True

    def send(self, syncer: Any, bucket: Sequence[tuple[str, Any]], stats: Any):
        import ray

        arrays, metas = host_payload(bucket)
        ref = ray.put(arrays)
        if stats.retained is not None:
            stats.retained.append((ref, metas))
        return [s.load_bucket.remote(ref, metas) for s in syncer.servers], None, metas

    def lost(self, syncer: Any, server: Any, error: Exception) -> None:
        syncer.servers = [s for s in syncer.servers if s is not server]

    def problems(self, placement: SyncPlacement) -> list[str]:
        return []
