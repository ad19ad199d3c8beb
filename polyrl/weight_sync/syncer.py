"""WeightSyncer: one push of weight buckets to every rollout server, through a transport.

Buckets are streamed: the next bucket is packed while servers load the previous one, so
besides retained buckets at most two are alive at a time. What differs between
transports is the :class:`~polyrl.weight_sync.base.Transport` the syncer holds
(``polyrl.weight_sync.registry``); this module never asks which one it is.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence
from typing import Any

from polyrl.backends.buckets import TensorMeta
from polyrl.weight_sync.base import OutsideUpdateError
from polyrl.weight_sync.registry import get_transport

__all__ = ["SyncStats", "WeightSyncer"]


@dataclasses.dataclass
class SyncStats:
    """One push: what moved and how fast (``gbps`` = bytes / seconds / 1e9)."""

    version: int
    transport: str
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    seconds: float = 0.0
    servers: int = 0
    # Where ``seconds`` went in this process: packing and sending buckets (copies into the
    # flat buffers, host payloads, calls; a CUDA IPC push does not wait for its copies
    # here) and waiting for the servers' acknowledgements; ``started_at``: the push's start, wall clock (time.time()).
    pack_seconds: float = 0.0
    wait_seconds: float = 0.0
    started_at: float = 0.0
    # Object-store transport with retain=True: [(payload ref, metas)] per bucket, what
    # WeightSyncer.replay needs to re-sync a restarted server.
    retained: list[tuple[Any, list[TensorMeta]]] | None = None
    # Indices of servers that died during the push (object store): the push completed on
    # the others; RolloutPool.commit re-syncs these once Ray has restarted them.
    lost: list[int] = dataclasses.field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("nan")

    @classmethod
    def merge(cls, parts: Sequence[SyncStats]) -> SyncStats:
        """One push made by several trainer ranks at once (CUDA IPC: each to the servers
        on its own GPU): bytes, tensors, buckets and servers add up, time is the slowest's."""
        first = parts[0]
        return cls(
            version=first.version,
            transport=first.transport,
            bytes=sum(p.bytes for p in parts),
            tensors=sum(p.tensors for p in parts),
            buckets=sum(p.buckets for p in parts),
            seconds=max(p.seconds for p in parts),
            servers=sum(p.servers for p in parts),
            pack_seconds=max(p.pack_seconds for p in parts),
            wait_seconds=max(p.wait_seconds for p in parts),
            started_at=min(p.started_at for p in parts),
            retained=first.retained,
            lost=sorted({i for p in parts for i in p.lost}),
        )

    def summary(self) -> dict[str, float | int | str]:
        return {
            "version": self.version,
            "transport": self.transport,
            "bytes": self.bytes,
            "tensors": self.tensors,
            "buckets": self.buckets,
            "seconds": self.seconds,
            "pack_seconds": self.pack_seconds,
            "wait_seconds": self.wait_seconds,
            "servers": self.servers,
            "gbps": self.gbps,
        }


class WeightSyncer:
    """Pushes buckets to rollout servers (Ray actor handles of ``RolloutServer``).

    Picklable, so the controller can build it (``RolloutPool.weight_syncer``) and send
    it to the trainer worker that holds the exported tensors; it must run in that
    process for ``cuda_ipc`` (the handles are of its GPU memory) and ``nccl`` (it is
    rank 0 of the broadcast group).

    transport: a name in ``polyrl.weight_sync.registry.TRANSPORTS``; the syncer holds
      its :class:`~polyrl.weight_sync.base.Transport` as ``strategy``.
    retain: keep object-store buckets for :meth:`replay` (costs one host copy of the
      model in Ray's object store; needed to re-sync restarted servers without the
      trainer).
    devices: each server's (first) GPU UUID (``RolloutServer.info()["device_uuid"]``), so
      that with CUDA IPC each trainer rank pushes to the servers on its own GPU
      (:meth:`for_rank`).
    group_timeout_s: transport "nccl": how long one bucket's broadcast may take, on the
      trainer and on the servers, before the group counts as broken (a member died; NCCL
      would otherwise wait for it forever) and the push re-forms it (``Nccl.recover``).
    """

    def __init__(
        self,
        servers: Sequence[Any],
        transport: str = "object_store",
        *,
        retain: bool = True,
        timeout_s: float = 600.0,
        devices: Sequence[str | None] | None = None,
        group_timeout_s: float = 120.0,
    ) -> None:
        self.strategy = get_transport(transport, "WeightSyncer: transport")
        self.servers = list(servers)
        self.devices = list(devices) if devices is not None else [None] * len(self.servers)
        self.transport = transport
        self.retain = retain and self.strategy.retains
        self.timeout_s, self.group_timeout_s = timeout_s, group_timeout_s

    def for_rank(self, rank: int) -> WeightSyncer | None:
        """The syncer trainer worker ``rank`` pushes with (None: it only takes part in the
        export's gathers): with CUDA IPC every worker, to the servers on its own GPUs;
        otherwise worker 0, to every server."""
        return self.strategy.pusher(self, rank)

    # ------------------------------------------------------------- push
    def push(self, buckets: Iterable[Sequence[tuple[str, Any]]], version: int) -> SyncStats:
        """Stream ``buckets`` to every server; returns when all loaded them and set
        their weight version to ``version``. A server that dies during the push is left
        out of it (``SyncStats.lost``; :meth:`RolloutPool.commit` re-syncs it once Ray
        has restarted it) and the push completes on the others — with the broadcast
        group ("nccl") too: see ``Nccl.recover``."""
        stats = SyncStats(
            version=version,
            transport=self.transport,
            servers=len(self.servers),
            retained=[] if self.retain else None,
        )
        start, stats.started_at = time.perf_counter(), time.time()
        everyone = self.servers
        self.strategy.begin()
        try:
            # Not waited for on its own: a call without arguments starts when it arrives,
            # so each server begins before bucket 0 (whose bucket it fetches first) loads,
            # and its answer comes with bucket 0's.
            pending: list[tuple[Any, Any]] = self._on_live("begin_weight_update")
            keep: Any = None  # the previous bucket's device buffer, alive until loaded
            for bucket in buckets:
                try:
                    refs, buf = self._send(bucket, stats)
                    sent = list(zip(self.servers, refs))
                    self._get_live(pending, stats)  # servers load bucket i-1 while we pack i
                except Exception as error:  # e.g. a member of the broadcast group died
                    self.strategy.recover(self, error)
                    sent, buf = [], None
                pending, keep = sent, buf
            self.strategy.drain(self, pending, stats)  # the last bucket lands before finish
            self._get_live(self._on_live("finish_weight_update", version), stats)
            del keep
        finally:
            alive = {id(s) for s in self.servers}
            stats.lost = [i for i, s in enumerate(everyone) if id(s) not in alive]
            self.servers = everyone
        stats.seconds = time.perf_counter() - start
        return stats

    def _on_live(self, method: str, *args: Any) -> list[tuple[Any, Any]]:
        return [(s, getattr(s, method).remote(*args)) for s in self.servers]

    def _get_live(self, sent: list[tuple[Any, Any]], stats: SyncStats | None = None) -> None:
        """Wait for each (server, ref) of a server still in the push. A server that died,
        or that Ray restarted since the push began (its bucket found no update open:
        ``OutsideUpdateError``), goes to the transport's ``lost`` (the object store drops
        it from the rest of the push, ``SyncStats.lost``, and ``RolloutPool.commit``
        re-syncs it; the others fail, and the broadcast group's failure goes to its
        ``recover``). The wait counts in ``stats.wait_seconds``."""
        start = time.perf_counter()
        try:
            self._wait_each(sent)
        finally:
            if stats is not None:
                stats.wait_seconds += time.perf_counter() - start

    def _wait_each(self, sent: list[tuple[Any, Any]]) -> None:
        import ray

        for server, ref in sent:
            if all(s is not server for s in self.servers):
                continue  # out of the push already (e.g. its begin failed): its loads too
            try:
                self._get([ref])
            except (ray.exceptions.RayActorError, OutsideUpdateError) as error:
                self.strategy.lost(self, server, error)  # died, or restarted mid-push
            else:
                self.strategy.acknowledge(ref)

    def replay(
        self,
        retained: Sequence[tuple[Any, list[TensorMeta]]],
        version: int,
        servers: Sequence[Any] | None = None,
    ) -> None:
        """Re-send retained object-store buckets (``SyncStats.retained``) to ``servers``
        (default: all), e.g. a server Ray just restarted."""
        targets = self.servers if servers is None else list(servers)
        self._get([s.begin_weight_update.remote() for s in targets])
        for ref, metas in retained:
            self._get([s.load_bucket.remote(ref, metas) for s in targets])
        self._get([s.finish_weight_update.remote(version) for s in targets])

    def _send(self, bucket: Sequence[tuple[str, Any]], stats: SyncStats) -> tuple[list[Any], Any]:
        """Start loading one bucket on every server; returns (ack refs, buffer to keep)."""
        start = time.perf_counter()
        refs, buf, metas = self.strategy.send(self, bucket, stats)
        stats.buckets += 1
        stats.tensors += len(metas)
        stats.bytes += sum(m[4] for m in metas)
        stats.pack_seconds += time.perf_counter() - start
        return refs, buf

    # ------------------------------------------------ the transport's group
    def ensure_group(self, form: Any = None) -> bool:
        """On the controller, before a push: form the transport's group where it needs a
        new one (``"nccl"``: none yet, or a server restarted since). ``form(self)`` must
        run :meth:`init_group` in the process that pushes (the trainer's rank 0; default:
        this process). Returns whether a group was formed."""
        return self.strategy.ensure_group(self, form)

    def init_group(self, host: str | None = None, port: int | None = None) -> int:
        """Join the transport's group as rank 0 (this process) with every worker of every
        server after it; the rendezvous listens on ``host:port`` (default: this node's IP
        and a free port). Returns the group size."""
        return self.strategy.join(self, host, port)

    def _get(self, refs: list[Any]) -> list[Any]:
        import ray

        if not refs:
            return []
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise TimeoutError(
                f"weight sync ({self.transport}): servers did not answer within "
                f"{self.timeout_s:.0f} s; raise WeightSyncer(timeout_s=...) for large models"
            ) from e
