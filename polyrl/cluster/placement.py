"""Resource pools -> Ray placement groups, and each role's share of them.

A pool (``RunConfig.pools``, see ``polyrl.cluster.roles``) is a set of nodes, each giving the
pool the same Ray resources (``CPU``, ``GPU``, custom ones). Roles mapped to the same
pool (``RoleConfig.pool``, ``RolloutConfig.pool``) are *colocated*: they take turns on the same devices,
each worker asking for ``1/k`` of its devices when ``k`` roles share them (so Ray packs
them together), and the trainer offloads/sleeps the idle ones. Roles in different pools
get disjoint devices.

A pool with GPUs, more than one node or custom resources is one placement group with
one bundle per node (the node's whole share), reserved up front: ``STRICT_PACK`` for one
node, ``STRICT_SPREAD`` (one bundle per distinct node) for several; a role can never
spill onto another pool's devices. A worker of node ``i`` is scheduled into bundle
``i``. With several GPUs per node, polyrl maps devices itself: it asks Ray which GPUs a
bundle holds and gives each worker ``CUDA_VISIBLE_DEVICES`` = its own ones (a torch rank
one GPU, a JAX host worker every GPU of its share of the mesh, a rollout server its
tensor-parallel GPUs), since Ray's fractional GPU accounting alone could put two ranks
of one role on the same GPU.

On CPU the pool's per-node CPUs are split evenly over the workers placed on a node
(fractional CPUs: Ray only counts them, they do not pin cores). Reward and env workers
are in no pool (:meth:`Placement.light_options`).

A sweep trial's run reserves no group of its own: the trial's placement group
(``reserved``), laid out by :func:`pool_bundles`, already holds every pool it uses.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from polyrl.cluster import session
from polyrl.cluster.roles import RoleSpec, pool_shape

__all__ = [
    "RoleShare",
    "plan_shares",
    "fit_problems",
    "pool_bundles",
    "Placement",
    "TRIAL_PG_ENV",
    "trial_placement",
]

# A sweep trial's placement group id (hex) and the bundle its pools start at, for its run
# (set by polyrl.configure.sweep for the trial's ``polyrl train``; read by trial_placement).
TRIAL_PG_ENV = "POLYRL_TRIAL_PLACEMENT_GROUP"


@dataclasses.dataclass(frozen=True)
class RoleShare:
    """What each worker of a role asks Ray for."""

    pool: str
    num_cpus: float
    num_gpus: float
    colocated_with: tuple[str, ...]


def _gpu_request(devices: int, k: int) -> float:
    # Ray takes fractions below one GPU or whole GPUs; the bundle reserves the node's
    # GPUs for the pool either way, so rounding down only loosens Ray's bookkeeping.
    share = devices / k
    return share if share <= 1 else float(math.floor(share))


def plan_shares(
    pools: Mapping[str, Mapping[str, float]], roles: Mapping[str, RoleSpec]
) -> dict[str, RoleShare]:
    """Per-worker resources of every role: an equal part of a node's CPUs for each
    worker placed on that node, and ``local_devices / k`` GPUs (``k`` roles in the pool)."""
    out = {}
    for name, role in roles.items():
        members = sorted(r for r in roles if roles[r].pool == role.pool)
        shape = pool_shape(pools[role.pool])
        on_node = sum(roles[r].per_node for r in members)
        gpus = _gpu_request(role.local_devices, len(members)) if shape.gpus else 0.0
        out[name] = RoleShare(role.pool, shape.cpus / on_node, gpus, tuple(members))
    return out


def _needs_group(res: Mapping[str, float]) -> bool:
    shape = pool_shape(res)
    custom = set(shape.per_node) - {"CPU", "GPU"}
    return bool(shape.gpus or shape.nodes > 1 or custom)


def fit_problems(
    pools: Mapping[str, Mapping[str, float]], nodes: list[Mapping[str, float]]
) -> list[str]:
    """Pools that no set of distinct ``nodes`` (each a Ray node's total resources) can
    hold: every pool needs ``nodes`` different nodes with its per-node resources."""
    out = []
    for name, res in pools.items():
        shape = pool_shape(res)
        fits = [n for n in nodes if all(n.get(k, 0) >= v for k, v in shape.per_node.items())]
        if len(fits) < shape.nodes:
            out.append(
                f"RunConfig.pools[{name!r}] = {dict(res)} needs {shape.nodes} node(s) with "
                f"{dict(shape.per_node)} each, but only {len(fits)} of the cluster's "
                f"{len(nodes)} node(s) have that much (nodes: "
                f"{[{k: v for k, v in n.items() if '.' not in k} for n in nodes]}); "
                f"lower the pool's per-node resources or its 'nodes', or add nodes"
            )
    return out


def pool_bundles(
    pools: Mapping[str, Mapping[str, float]], used: set[str]
) -> tuple[list[dict[str, float]], dict[str, int]]:
    """Placement-group bundles that hold the ``used`` pools, one per node of each (the
    node's share, as :class:`Placement` reserves them), and pool -> its first bundle."""
    bundles: list[dict[str, float]] = []
    first = {}
    for name, res in pools.items():
        if name in used:
            shape = pool_shape(res)
            first[name] = len(bundles)
            bundles += [dict(shape.per_node)] * shape.nodes
    return bundles, first


def _bundle_gpu_ids(pg: Any, bundles: range, gpus: float) -> list[list[str]]:
    """The GPU ids each bundle of ``pg`` holds, asked of Ray by a probe task that takes
    the whole bundle (before any worker is placed in it)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0)
    def probe() -> list[str]:
        return [str(i) for i in ray.get_gpu_ids()]

    refs = [
        probe.options(
            num_gpus=gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i
            ),
        ).remote()
        for i in bundles
    ]
    return ray.get(refs)


class Placement:
    """Creates the pools' Ray placement groups and hands out each worker's actor options.

    reserved: ``(placement group, offset)`` of a group that already holds the pools
    (bundles from :func:`pool_bundles`, from bundle ``offset`` on): a sweep trial's.
    """

    def __init__(
        self,
        pools: Mapping[str, Mapping[str, float]],
        roles: Mapping[str, RoleSpec],
        timeout_s: float = 120.0,
        reserved: tuple[Any, int] | None = None,
    ):
        import ray
        from ray.util.placement_group import get_placement_group, placement_group

        self.roles = dict(roles)
        self.shares = plan_shares(pools, self.roles)
        used = {
            name: res for name, res in pools.items() if any(r.pool == name for r in roles.values())
        }
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        problems = fit_problems({k: v for k, v in used.items() if _needs_group(v)}, nodes)
        if problems:
            raise RuntimeError("cannot place the run's pools:\n  " + "\n  ".join(problems))
        self.groups: dict[str, Any] = {}
        self.first: dict[str, int] = {}  # pool -> its first bundle in its group
        self.gpu_ids: dict[str, list[list[str]]] = {}
        self._owned: list[Any] = []  # groups this placement reserved (not a sweep trial's)
        _, firsts = pool_bundles(used, set(used))
        mode = session.current()  # a warm session's groups are named; an attached run's
        for name, res in used.items():  # workers already run in them (polyrl.cluster.session)
            if reserved is None and not _needs_group(res):
                continue
            shape = pool_shape(res)
            if reserved is not None:
                pg, first = reserved[0], reserved[1] + firsts[name]
            elif mode == "attach":
                self.groups[name], self.first[name] = get_placement_group(f"pool:{name}"), 0
                continue  # (their GPUs are mapped: the workers are not started again)
            else:
                strategy = "STRICT_PACK" if shape.nodes == 1 else "STRICT_SPREAD"
                named = {"name": f"pool:{name}"} if mode == "serve" else {}
                pg = placement_group(
                    pool_bundles({name: res}, {name})[0], strategy=strategy, **named
                )
                first = 0
                if not pg.wait(timeout_seconds=timeout_s):
                    raise TimeoutError(
                        f"RunConfig.pools[{name!r}] = {dict(res)} could not be reserved within "
                        f"{timeout_s:.0f} s; Ray has {ray.available_resources()}. Shrink the "
                        f"pool or free the devices"
                    )
            self.groups[name], self.first[name] = pg, first
            if reserved is None:
                self._owned.append(pg)
            if shape.gpus > 1:
                bundles = range(first, first + shape.nodes)
                self.gpu_ids[name] = _bundle_gpu_ids(pg, bundles, shape.gpus)

    def options(self, role: str, rank: int = 0, split: int = 1) -> dict[str, Any]:
        """``ray.remote(...).options(**placement.options(role, rank))`` for one worker;
        ``runtime_env`` carries the worker's GPUs when polyrl maps them. ``split``: the
        role's share is split over that many groups of its workers on the same devices
        (the Tinker service's training clients), each asking for ``1/split`` of it."""
        share, spec = self.shares[role], self.roles[role]
        opts: dict[str, Any] = {
            "num_cpus": share.num_cpus / split,
            "num_gpus": _gpu_request(share.num_gpus, split) if share.num_gpus else 0.0,
        }
        pg = self.groups.get(share.pool)
        if pg is None:
            return opts
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        node, local, _ = spec.slot(rank)
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=self.first[share.pool] + node
        )
        ids = self.gpu_ids.get(share.pool)
        if ids:
            n = spec.local_devices
            mine = [ids[node][(local * n + i) % len(ids[node])] for i in range(n)]
            opts["runtime_env"] = {
                "env_vars": {
                    "CUDA_VISIBLE_DEVICES": ",".join(mine),
                    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
                }
            }
        return opts

    @staticmethod
    def light_options(rank: int = 0) -> dict[str, Any]:
        """Ray options of a light worker (reward and env workers: user code with no device):
        no CPU reserved, in no pool — their work is light, and the logical CPUs belong to
        the roles and to user tasks."""
        return {"num_cpus": 0}

    def release(self) -> None:
        """Give back the placement groups this placement reserved (after its workers
        stopped), so a later run in the same Ray session can reserve them again."""
        from ray.util import remove_placement_group

        for pg in self._owned:
            remove_placement_group(pg)
        self._owned = []


def trial_placement() -> tuple[Any, int] | None:
    """In a trial's run: the trial's placement group and the bundle its pools start at."""
    value = os.environ.get(TRIAL_PG_ENV)
    if not value:
        return None
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup

    hex_id, offset = value.split(":")
    return PlacementGroup(PlacementGroupID(bytes.fromhex(hex_id))), int(offset)
