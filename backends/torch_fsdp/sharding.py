"""From the neutral ``ParallelConfig`` to torch.distributed objects (parallelism is
data: docs/design.md "TrainEngine").

* :func:`init_distributed` joins (or creates) the default process group from the
  environment torchrun, ``mp.spawn`` helpers and the Ray workers set (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); with none of them
  set it makes a world of one in-process, so a plain script or test needs no launcher.
  A Ray group's worker 0 serves the group's store on the socket it has kept listening
  since the rendezvous. gloo on CPU, NCCL on GPU.
* :func:`build_plan` checks the mesh against the world and the logical-axis rules and
  returns a :class:`ShardingPlan`: the DeviceMesh over the axes larger than one, in the
  order ``(data, fsdp, tensor)`` (``fsdp`` always present): ``(fsdp,)`` = FSDP,
  ``(data, fsdp)`` = HSDP (replicate over ``data``, shard over ``fsdp``), with a trailing
  ``tensor`` axis for tensor parallelism (consecutive ranks, so a group sits on one
  node); and the ``fully_shard`` keyword arguments over the data-parallel sub-mesh
  (mixed precision, CPU offload).
* :func:`shard_model` splits each decoder layer over the ``tensor`` axis
  (``tensor_parallel``), applies FSDP2 ``fully_shard`` to each decoder layer, then the
  root, and makes gradient reduction a SUM (see there).
* :func:`clip_grad_norm` is the global pre-clip gradient norm over DTensor shards.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from polyrl.backends.base import take_listener
from polyrl.backends.torch_fsdp import tensor_parallel
from polyrl.config import ParallelConfig

__all__ = [
    "DistEnv",
    "ShardingPlan",
    "init_distributed",
    "build_plan",
    "shard_model",
    "clip_grad_norm",
    "all_reduce_sum",
]


_ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """This process's place in the world and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _device_for(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed() -> DistEnv:
    """Join the default process group (creating it if needed) and pick this rank's device.

    If a group already exists (a second engine in the same process, e.g. actor and
    reference colocated), it is reused. With ``WORLD_SIZE`` etc. in the environment the
    group is created with ``init_method="env://"``; with none of them, or ``WORLD_SIZE=1``,
    a world of one on an in-memory store (it listens on no port). A Ray group's rank 0
    serves the group's store on the socket it has kept listening on ``MASTER_PORT`` since
    the rendezvous (:func:`_store_on_held_port`). A partial environment is an error: it is
    almost always a launcher bug, and guessing would hang at the first collective.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _device_for(local_rank)
    if not dist.is_initialized():
        present = [k for k in _ENV_KEYS if k in os.environ]
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not present or os.environ.get("WORLD_SIZE") == "1":
            # a world of one meets no one: no TCP store, so no port that another process
            # could take between the rendezvous and this listen (EADDRINUSE at start)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        elif len(present) < len(_ENV_KEYS):
            missing = sorted(set(_ENV_KEYS) - set(present))
            raise RuntimeError(
                f"torch.distributed environment is incomplete: {present} are set but {missing} "
                "are not; set all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun does) "
                "or none of them for a single process"
            )
        else:
            held = _store_on_held_port()
            dist.init_process_group(backend, init_method="env://")
            del held  # env://'s store shares its server now
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device)


def _store_on_held_port() -> dist.TCPStore | None:
    """Worker 0 of a polyrl group keeps ``MASTER_PORT`` listening since the rendezvous
    (``polyrl.backends.base.listen_for_group``): a store served on that socket, which
    ``env://``'s store on the same port then shares (``multi_tenant``), so the port is
    never free between the rendezvous and this listen (another process took it so:
    EADDRINUSE at start). None where this process keeps no socket (torchrun, rank > 0)."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    fd = take_listener(port)
    if fd is None:
        return None
    return dist.TCPStore(
        addr, port, is_master=True, wait_for_workers=False, multi_tenant=True, master_listen_fd=fd
    )


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """What :func:`shard_model` needs: the mesh, ``fully_shard`` keyword arguments (over
    the data-parallel sub-mesh) and the tensor-parallel sub-mesh (None: no TP)."""

    mesh: DeviceMesh
    fsdp_kwargs: dict[str, Any]
    tp_mesh: DeviceMesh | None = None


def _check_rules(parallel: ParallelConfig) -> None:
    """FSDP2 shards every parameter over the ``fsdp`` axis and splits the batch over
    ``(data, fsdp)``; rules asking for something else cannot be honoured here."""
    rules = dict(parallel.rules)
    batch = tuple(rules.get("batch", ("data", "fsdp")))
    if set(batch) != {"data", "fsdp"} and parallel.dp_size > 1:
        raise ValueError(
            f"ParallelConfig.rules maps 'batch' to {batch}; the torch_fsdp backend splits the "
            "batch over ('data', 'fsdp'); use ('batch', ('data', 'fsdp'))"
        )
    embed = tuple(rules.get("embed", ("fsdp",)))
    if parallel.mesh["fsdp"] > 1 and embed != ("fsdp",):
        raise ValueError(
            f"ParallelConfig.rules maps 'embed' to {embed}; FSDP2 shards parameters over the "
            "'fsdp' axis only; use ('embed', ('fsdp',)) or set mesh fsdp=1 (replicate)"
        )
    if parallel.mesh["tensor"] > 1:
        # Tensor parallelism splits heads, key/value heads and the MLP over 'tensor'
        # (tensor_parallel); the embedding and LM head ('vocab') stay replicated.
        for logical in ("heads", "kv_heads", "mlp"):
            axes = tuple(rules.get(logical, ("tensor",)))
            if axes != ("tensor",):
                raise ValueError(
                    f"ParallelConfig.rules maps {logical!r} to {axes}; with mesh tensor="
                    f"{parallel.mesh['tensor']} the torch_fsdp backend splits it over "
                    f"'tensor'; use ({logical!r}, ('tensor',)) or set tensor=1"
                )


def build_plan(parallel: ParallelConfig, env: DistEnv, param_dtype: torch.dtype) -> ShardingPlan:
    """Mesh + fully_shard kwargs for ``parallel`` on this world.

    Mixed precision: when ``param_dtype`` is not fp32, parameters are all-gathered and
    computed in ``param_dtype`` while gradients are reduced in fp32 (sharded master
    weights stay fp32: they are what the optimizer updates).
    """
    _check_rules(parallel)
    parallel.check_devices(env.world_size, where="ParallelConfig.mesh (torch_fsdp world size)")
    names = tuple(a for a in ("data", "fsdp", "tensor") if a == "fsdp" or parallel.mesh[a] > 1)
    mesh = init_device_mesh(
        env.device.type, tuple(parallel.mesh[a] for a in names), mesh_dim_names=names
    )
    tp_mesh = mesh["tensor"] if "tensor" in names else None
    if tp_mesh is not None and len(names) > 1:
        # A flattened view of the whole mesh lets DTensor reduce a value partial over every
        # axis (the gradient norm) in one all-reduce instead of one per axis.
        mesh._flatten("_".join(names))
    dp_mesh = mesh if tp_mesh is None else mesh[tuple(a for a in names if a != "tensor")]
    kwargs: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": True}
    if param_dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32
        )
    if parallel.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=env.device.type == "cuda")
    return ShardingPlan(mesh, kwargs, tp_mesh)


def _decoder_layers(model: nn.Module, layer_names: set[str]) -> list[nn.Module]:
    layers = [m for m in model.modules() if type(m).__name__ in layer_names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no module of the classes {sorted(layer_names)} "
            "(its _no_split_modules); FSDP2 would shard the whole model as one unit"
        )
    return layers


def shard_model(model: nn.Module, plan: ShardingPlan, layer_names: set[str]) -> nn.Module:
    """Split each decoder layer (classes ``layer_names``) over the tensor-parallel mesh
    (if any), then ``fully_shard`` each layer and the root over the data-parallel mesh.

    Gradients are reduced with a SUM over ranks (divide factor 1): the loss contract
    (backends/base.py) already divides by global counts, so FSDP's default mean over
    ranks would shrink every gradient by the data-parallel size. Plain SUM collectives
    are forced because gloo has no PREMUL_SUM (which a custom factor uses by default;
    older torch without the switch only runs it on NCCL, which has PREMUL_SUM).
    """
    layers = _decoder_layers(model, layer_names)
    if plan.tp_mesh is not None:
        tensor_parallel.parallelize_layers(layers, plan.tp_mesh)
    for layer in layers:
        fully_shard(layer, **plan.fsdp_kwargs)
    fully_shard(model, **plan.fsdp_kwargs)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):  # torch >= 2.9
                module.set_force_sum_reduction_for_comms(True)
    return model


def clip_grad_norm(params: list[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """Global L2 norm of the gradients (before clipping) and clip them in place to
    ``max_norm`` (None: only measure). Gradients are DTensor shards: the per-shard
    norm is a partial value, ``full_tensor()`` reduces it over the mesh. With tensor
    parallelism the split layers' gradients live on the (data-parallel x tensor) mesh
    and the rest on the data-parallel mesh; DTensor cannot combine the two, so each
    mesh's norm is reduced on its own and the squares are summed."""
    by_mesh: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(mesh, []).append(p)
    if not by_mesh:
        return torch.zeros(())
    squares = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2)
    total = torch.stack(squares).sum().sqrt()
    if max_norm is not None and torch.isfinite(total):
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` over all ranks (a new tensor; the world-of-one case is a copy)."""
    out = values.clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out
