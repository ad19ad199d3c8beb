"""Resource pools -> Ray placement groups, and each role's share of them.

A pool is a named set of devices (``RunConfig.pools``: ``{"name": {"CPU": c, "GPU": g}}``).
Roles mapped to the same pool (``RunConfig.role_pools``) are *colocated*: they take
turns on the same devices, each worker asking for ``1/k`` of a GPU when ``k`` roles share
it (so Ray packs them together), and the trainer offloads/sleeps the idle ones. Roles in
different pools get disjoint devices: each GPU pool is one placement group with one
bundle per GPU, reserved up front (STRICT_PACK on one node), so a role can never spill
onto another pool's GPUs.

On a CPU-only host the pool's CPUs are split evenly over the workers placed in it
(fractional CPUs: Ray only counts them, they do not pin cores).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["RoleShare", "plan_shares", "Placement"]


@dataclasses.dataclass(frozen=True)
class RoleShare:
    """What each worker of a role asks Ray for."""

    pool: str
    num_cpus: float
    num_gpus: float
    colocated_with: tuple[str, ...]


def plan_shares(
    pools: Mapping[str, Mapping[str, float]],
    role_pools: Mapping[str, str],
    workers: Mapping[str, int],
) -> dict[str, RoleShare]:
    """Per-worker resources of every role in ``workers`` (role -> number of workers).

    GPU pools: a worker gets ``1/k`` GPU (``k`` roles in the pool) and an equal part of
    the pool's CPUs per GPU. CPU pools: the pool's CPUs divided by all its workers.
    """
    out = {}
    for role in workers:
        pool = role_pools[role]
        members = sorted(r for r in workers if role_pools[r] == pool)
        res = pools[pool]
        gpus, cpus = float(res.get("GPU", 0)), float(res.get("CPU", 0))
        if gpus:
            share = RoleShare(pool, cpus / gpus / len(members), 1.0 / len(members), tuple(members))
        else:
            total = sum(workers[r] for r in members)
            share = RoleShare(pool, cpus / total, 0.0, tuple(members))
        out[role] = share
    return out


class Placement:
    """Creates one Ray placement group per GPU pool and hands out actor options."""

    def __init__(
        self,
        pools: Mapping[str, Mapping[str, float]],
        role_pools: Mapping[str, str],
        workers: Mapping[str, int],
        timeout_s: float = 120.0,
    ):
        import ray
        from ray.util.placement_group import placement_group

        self.shares = plan_shares(pools, role_pools, workers)
        self.groups: dict[str, Any] = {}
        for name, res in pools.items():
            gpus = int(res.get("GPU", 0))
            if not gpus or not any(s.pool == name for s in self.shares.values()):
                continue
            per_gpu_cpu = float(res.get("CPU", 0)) / gpus
            pg = placement_group([{"GPU": 1.0, "CPU": per_gpu_cpu}] * gpus, strategy="STRICT_PACK")
            if not pg.wait(timeout_seconds=timeout_s):
                raise TimeoutError(
                    f"RunConfig.pools[{name!r}] = {dict(res)} could not be reserved within "
                    f"{timeout_s:.0f} s; Ray has {ray.available_resources()}. Shrink the pool "
                    f"or free the devices"
                )
            self.groups[name] = pg

    def options(self, role: str, rank: int = 0) -> dict[str, Any]:
        """``ray.remote(...).options(**placement.options(role, rank))`` for one worker."""
        share = self.shares[role]
        opts: dict[str, Any] = {"num_cpus": share.num_cpus, "num_gpus": share.num_gpus}
        pg = self.groups.get(share.pool)
        if pg is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            bundles = len(pg.bundle_specs)
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=rank % bundles
            )
        return opts

    def is_colocated(self, role: str) -> bool:
        return len(self.shares[role].colocated_with) > 1
