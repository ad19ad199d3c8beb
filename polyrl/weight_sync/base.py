"""The transport interface: one way a weight bucket travels to the rollout servers.

:class:`~polyrl.weight_sync.syncer.WeightSyncer` drives every push the same way
(begin on every server, stream the buckets with bucket ``i`` packed while the servers
load ``i - 1``, finish) and asks its :class:`Transport` for each step that differs:

* :meth:`Transport.send` a bucket (start every server's load; the ack refs);
* :meth:`Transport.acknowledge` a load that finished, :meth:`Transport.lost` a server
  that died, :meth:`Transport.recover` from a failure mid-push, :meth:`Transport.drain`
  what must land before the servers finish;
* :meth:`Transport.pusher`: which trainer workers push, to which servers;
* :meth:`Transport.ensure_group` / :meth:`Transport.join`: a collective group formed
  before a push;
* :meth:`Transport.problems`: what validate-config refuses for a placement.

Each transport is one class registered by name in ``polyrl.weight_sync.registry``, the
one place that interprets ``RunConfig.weight_transport``.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from polyrl.backends.buckets import TensorMeta

# The hooks take the WeightSyncer driving the push (``syncer``) and its SyncStats
# (``stats``); typed Any here, as this module sits below polyrl.weight_sync.syncer.
WeightSyncer = SyncStats = Any

__all__ = ["Transport", "SyncPlacement", "OutsideUpdateError"]


class OutsideUpdateError(RuntimeError):
    """A server got a weight bucket with no weight update open: Ray restarted it since the
    push began (its new life never saw ``begin_weight_update``; a push from another
    process can reach the old life with begin and the new one with a bucket), or the
    caller did not begin one. The push counts the server as lost (``Transport.lost``)."""


@dataclasses.dataclass(frozen=True)
class SyncPlacement:
    """Where the actor and the rollout run, as validate-config sees it: their pools,
    whether each pool has GPUs and the rollout's ``tensor_parallel_size``
    (RolloutConfig)."""

    actor_pool: str
    rollout_pool: str
    gpus: Mapping[str, bool]
    tensor_parallel: int = 1

    @property
    def colocated(self) -> bool:
        return self.actor_pool == self.rollout_pool

    @property
    def where(self) -> str:
        def kind(pool: str) -> str:
            return "GPU" if self.gpus[pool] else "CPU"

        return (
            f"actor in pool {self.actor_pool!r} ({kind(self.actor_pool)}), rollout in "
            f"pool {self.rollout_pool!r} ({kind(self.rollout_pool)})"
        )


class Transport(abc.ABC):
    """One weight transport. Its instance travels inside the (picklable) syncer and
    holds the transport's own state across pushes (e.g. the broadcast group)."""

    name: ClassVar[str]
    # A bucket's size (MiB) where RunConfig.weight_bucket_mb is None.
    bucket_mb: ClassVar[float]
    # Whether pushed buckets can be retained for WeightSyncer.replay.
    retains: ClassVar[bool] = False
    # Whether it carries buckets GPU to GPU between the devices of separate pools (no
    # host copy): what a stream's pushes need there (registry.stream_transport_problems).
    between_gpus: ClassVar[bool] = False

    @abc.abstractmethod
    def send(
        self, syncer: WeightSyncer, bucket: Sequence[tuple[str, Any]], stats: SyncStats
    ) -> tuple[list[Any], Any, list[TensorMeta]]:
        """Start loading ``bucket`` (the ``stats.buckets``-th of the push) on every
        server of ``syncer``: (ack refs, a buffer to keep alive until they answer, the
        bucket's metas)."""

    @abc.abstractmethod
    def problems(self, placement: SyncPlacement) -> list[str]:
        """Why this transport cannot run on ``placement`` (validate-config; each message
        names RunConfig.weight_transport and the fix)."""

    def pusher(self, syncer: WeightSyncer, rank: int) -> WeightSyncer | None:
        """The syncer trainer worker ``rank`` pushes with (None: it only takes part in the
        export's gathers). Default: rank 0 pushes to every server."""
        return syncer if rank == 0 else None

    def begin(self) -> None:
        """A push starts: forget the previous push's per-bucket state. Default: none."""
        return None

    def acknowledge(self, ref: Any) -> None:
        """A server's load of a bucket (ack ``ref``) succeeded. Default: nothing to record."""
        return None

    def lost(self, syncer: WeightSyncer, server: Any, error: Exception) -> None:
        """``server`` died during the push (``error``: Ray's actor error, or
        :class:`OutsideUpdateError` where Ray restarted it mid-push). Default: the push
        fails."""
        raise error

    def recover(self, syncer: WeightSyncer, error: Exception) -> None:
        """Sending or acknowledging a bucket failed with ``error``; return to go on with
        the push, raise to fail it. Default: fail."""
        raise error

    def drain(self, syncer: WeightSyncer, pending: list[tuple[Any, Any]], stats: SyncStats) -> None:
        """Wait for the last bucket's (server, ack ref) pairs before the servers are told
        to finish. The finish call must not go out earlier: a server is an asyncio actor,
        where Ray starts a call once its arguments are local, not in the order they were
        sent, so a finish (no arguments) could overtake a load still fetching its bucket
        from another node, and vLLM-CPU would close the reload before the bucket arrived."""
        syncer._get_live(pending, stats)

    def ensure_group(self, syncer: WeightSyncer, form: Any) -> bool:
        """On the controller, before a push: form the transport's collective group where
        it needs a new one; returns whether it formed one. Default: no group."""
        return False

    def join(self, syncer: WeightSyncer, host: str | None, port: int | None) -> int:
        """Join the group as its rank 0 (see WeightSyncer.init_group)."""
        raise ValueError(
            f"WeightSyncer.init_group: needs transport='nccl' and a group key (from "
            f"ensure_group); got transport={self.name!r}, group={getattr(self, 'group', None)!r}"
        )
