"""The run's roles: every role's engine, pool and process layout, built once.

``build_roles(cfg, spec)`` turns a RunConfig and an AlgorithmSpec into one
:class:`RoleSpec` per role the run starts (actor, rollout, reference, critic,
reward_model, judge, shadow), from the role vocabulary and its facts (``polyrl.role_table``:
which roles train, carry a value head, where their settings live). Validation (:func:`role_problems`), placement (``polyrl.cluster.placement``), the
workers (``polyrl.cluster.workers``) and the trainer all read this table, so none of them
decides again which roles exist or how a backend lays its processes out: that comes
from the backend's registry entry (``polyrl.backends.base.ENGINES[...].process``).

Pools (``RunConfig.pools``; a role's is its ``RoleConfig.pool``, the rollout's
``RolloutConfig.pool``, a judge's ``JudgeConfig.pool``): ``{"name": {"CPU": c, "GPU": g, "nodes": n, <custom>: x}}``.
``CPU``, ``GPU`` and custom Ray resources (``ray start --resources``) are *per node*;
``nodes`` (default 1) is how many nodes the pool spans. A role spreads its workers
evenly over ``min(nodes, workers)`` of them, node-major: ranks ``0..k-1`` on the first
node, the next ``k`` on the second, and so on.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from polyrl.config import ModelConfig, OptimConfig, ParallelConfig, RunConfig
from polyrl.role_table import ROLE_TABLE, Role, role_names

__all__ = [
    "RoleSpec",
    "PoolShape",
    "pool_shape",
    "build_roles",
    "role_problems",
]

# Keys of a pool entry that are not Ray resources.
POOL_KEYS = ("nodes",)


@dataclasses.dataclass(frozen=True)
class PoolShape:
    """A pool's nodes and the Ray resources it reserves on each (``GPU``, ``CPU``, custom)."""

    nodes: int
    per_node: Mapping[str, float]

    @property
    def gpus(self) -> float:
        return float(self.per_node.get("GPU", 0))

    @property
    def cpus(self) -> float:
        return float(self.per_node.get("CPU", 0))


def pool_shape(res: Mapping[str, float]) -> PoolShape:
    nodes = int(res.get("nodes", 1))
    per_node = {k: float(v) for k, v in res.items() if k not in POOL_KEYS and float(v)}
    return PoolShape(nodes, per_node)


@dataclasses.dataclass(frozen=True)
class RoleSpec:
    """One role of the run.

    name / pool: the role and the ``RunConfig.pools`` entry it runs in.
    num_workers: Ray workers it starts (torch: one per device; JAX: one per host;
      rollout and judge: servers). hosts: nodes its workers spread over. local_devices: devices
      each worker drives (torch 1, JAX its host's share of the mesh, rollout its
      tensor-parallel size).
    backend / model / optim / parallel: the engine of a training role (None for the
      rollout role); ``optim`` None is a frozen role.
    """

    name: str
    pool: str
    num_workers: int
    hosts: int
    local_devices: int
    backend: str | None = None
    model: ModelConfig | None = None
    optim: OptimConfig | None = None
    parallel: ParallelConfig | None = None

    @property
    def process(self) -> Any:
        """The backend's ProcessModel (``polyrl.backends.base``)."""
        from polyrl.backends.base import get_backend

        return get_backend(self.backend).process

    @property
    def per_node(self) -> int:
        """Workers on each of the role's nodes (the last may hold fewer)."""
        return math.ceil(self.num_workers / self.hosts)

    def slot(self, rank: int) -> tuple[int, int, int]:
        """``(node, local_rank, local_world)`` of worker ``rank``; node in pool order."""
        node, local = divmod(rank, self.per_node)
        local_world = min(self.per_node, self.num_workers - node * self.per_node)
        return node, local, local_world


def _engine_role(cfg: RunConfig, name: str) -> RoleSpec:
    from polyrl.backends.base import get_backend, other_backend

    own, facts = cfg.role_config(name), ROLE_TABLE[Role(name)]
    parallel = own.parallel
    shape = pool_shape(cfg.pools.get(own.pool, {}))
    devices = parallel.world_size
    hosts = max(1, min(shape.nodes, devices))
    backend = other_backend(cfg.backend) if facts.other_backend else cfg.backend
    process = get_backend(backend).process
    model = ModelConfig(
        path=str(own.model_path if facts.own_model else cfg.model_path),
        role=name,
        dtype=cfg.model_dtype,
        gradient_checkpointing=cfg.gradient_checkpointing,
        checkpoint_policy=cfg.checkpoint_policy,
        activation_memory_budget=cfg.activation_memory_budget,
        attn_implementation=cfg.attn_implementation,
        compile=cfg.compile,
        lora=cfg.lora if name == Role.ACTOR else None,
    )
    return RoleSpec(
        name=name,
        pool=own.pool,
        num_workers=process.num_workers(devices, hosts),
        hosts=hosts,
        local_devices=process.devices_per_worker(devices, hosts),
        backend=backend,
        model=model,
        optim=own.optim,
        parallel=parallel,
    )


def build_roles(cfg: RunConfig, spec: Any) -> dict[str, RoleSpec]:
    """The run's role table (see module docstring); ``cfg.backend`` must be registered."""
    roles = {}
    for name in role_names(cfg, spec):
        if ROLE_TABLE[name].kind == "rollout":  # the rollout's or a judge's vLLM servers
            own = cfg.role_config(name)
            shape = pool_shape(cfg.pools.get(own.pool, {}))
            servers = own.num_servers
            roles[name] = RoleSpec(
                name,
                own.pool,
                num_workers=servers,
                hosts=max(1, min(shape.nodes, servers)),
                local_devices=own.tensor_parallel_size,
            )
        else:
            roles[name] = _engine_role(cfg, name)
    return roles


def _tensor_problems(name: str, role: RoleSpec, shape: PoolShape) -> list[str]:
    """The role's tensor-parallel group fits in one node and splits its model evenly."""
    from polyrl.backends.base import get_backend, tensor_split_problem
    from polyrl.checkpoints import model_shape

    tensor = role.parallel.mesh["tensor"]
    where = f"{name}/ParallelConfig.mesh"
    out = []
    if shape.gpus and tensor > shape.gpus:
        out.append(
            f"{where} tensor={tensor}: a tensor-parallel group would span nodes, but pool "
            f"{role.pool!r} has {shape.gpus:g} GPUs per node; tensor parallelism stays inside "
            f"a node: set tensor <= {shape.gpus:g} and use fsdp/data across nodes"
        )
    compiled = get_backend(role.backend).compile_problem(role.model.compile, tensor, where)
    out += [compiled] if compiled else []
    adapted = get_backend(role.backend).lora_problem(role.model.lora, tensor, where)
    out += [adapted] if adapted else []
    try:
        problem = tensor_split_problem(model_shape(role.model.path), tensor, where)
    except (OSError, ValueError):  # no readable config.json: reported by preflight
        problem = None
    return out + ([problem] if problem else [])


def role_problems(cfg: RunConfig, roles: Mapping[str, RoleSpec]) -> list[str]:
    """Each role fits its pool: pool known, workers split evenly over the nodes, the
    devices of one node enough for the role's workers there, and every tensor-parallel
    (and torch FSDP) group inside one node."""
    out = []
    for name, res in cfg.pools.items():
        nodes = res.get("nodes", 1)
        if not float(nodes).is_integer() or nodes < 1:
            out.append(
                f"RunConfig.pools[{name!r}]['nodes']={nodes!r}: a pool spans a whole number "
                f"of nodes >= 1; set it to the number of nodes the pool's roles run on"
            )
            return out
    from polyrl.backends.base import get_backend

    for name, role in roles.items():
        if role.model is not None:  # (every role reads the same RunConfig fields: once)
            problem = get_backend(role.backend).checkpoint_problem(role.model, "RunConfig")
            out += [problem] if problem and problem not in out else []
        if role.pool not in cfg.pools:
            continue  # reported by validate's pool check
        shape = pool_shape(cfg.pools[role.pool])
        where = f"{name}/ParallelConfig.mesh {dict(role.parallel.mesh)}" if role.parallel else name
        if role.parallel is not None and role.parallel.mesh["tensor"] > 1:
            out += _tensor_problems(name, role, shape)
        if role.num_workers % role.hosts:
            out.append(
                f"{where}: {role.num_workers} workers do not split evenly over the "
                f"{role.hosts} nodes of pool {role.pool!r} (RunConfig.pools[{role.pool!r}]"
                f"['nodes']={shape.nodes}); make the worker count a multiple of the nodes"
            )
            continue
        node_devices = role.per_node * role.local_devices
        if shape.gpus and node_devices > shape.gpus:
            out.append(
                f"{where} puts {node_devices} devices on each of its {role.hosts} node(s) but "
                f"pool {role.pool!r} has {shape.gpus:g} GPUs per node; shrink the mesh, or grow "
                f"RunConfig.pools[{role.pool!r}]['GPU'] or ['nodes']"
            )
        if role.parallel is None or role.hosts == 1:
            continue
        mesh = role.parallel.mesh
        per_node = role.parallel.world_size // role.hosts
        if per_node % mesh["tensor"]:
            out.append(
                f"{where}: a tensor-parallel group of {mesh['tensor']} devices would span "
                f"nodes ({per_node} devices per node); tensor parallelism stays inside a node: "
                f"make tensor divide {per_node}"
            )
        elif per_node % (mesh["fsdp"] * mesh["tensor"]):
            out.append(
                f"{where}: an fsdp x tensor group of {mesh['fsdp'] * mesh['tensor']} devices "
                f"would span nodes ({per_node} devices per node); shard inside a node and "
                f"replicate across nodes (HSDP): set data={role.hosts} (a multiple of the "
                f"nodes) and fsdp x tensor = {per_node}"
            )
    return out
