"""The neutral ParallelConfig turned into JAX objects: Mesh, PartitionSpec, NamedSharding.

Mesh axes are ``("data", "fsdp", "tensor")`` (``polyrl.config.MESH_AXES``). Logical axes
name array dimensions; ``ParallelConfig.rules`` map each to mesh axes
(``DEFAULT_LOGICAL_RULES``: ``batch -> (data, fsdp)``, ``embed -> fsdp``,
``mlp/heads/kv_heads/vocab -> tensor``). Resolution (``logical_to_spec``) drops a mesh
axis that an earlier dimension already uses, and drops the mapping of a dimension whose
size the mesh axes do not divide (it is then replicated), so every rule set gives a
valid sharding; sharding changes speed and memory, never results.

Parameters get logical axes from their HF-style path (``PARAM_AXES``); activations are
constrained inside the model through :class:`ActivationSharding`; the batch is sharded
over ``batch`` on its first axis.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from polyrl.config import MESH_AXES, ParallelConfig

__all__ = [
    "PARAM_AXES",
    "make_mesh",
    "logical_to_spec",
    "param_axes",
    "param_shardings",
    "batch_sharding",
    "replicated",
    "ActivationSharding",
]

log = logging.getLogger(__name__)

Rules = Sequence[tuple[str, tuple[str, ...]]]

# Parameter path pattern (NNX path = HF name, see models.py) -> logical axes of its
# dimensions; the first pattern of the parameter's rank that matches wins. Linear weights
# are [out, in] (HF's layout). Norm weights and biases of replicated dims stay replicated.
PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"\.embed_tokens\.weight$", ("vocab", "embed")),
    (r"\.q_proj\.weight$", ("heads", "embed")),
    (r"\.[kv]_proj\.weight$", ("kv_heads", "embed")),
    (r"\.q_proj\.bias$", ("heads",)),
    (r"\.[kv]_proj\.bias$", ("kv_heads",)),
    (r"\.o_proj\.weight$", ("embed", "heads")),
    (r"\.(gate|up)_proj\.weight$", ("mlp", "embed")),
    (r"\.(gate|up)_proj\.bias$", ("mlp",)),
    (r"\.down_proj\.weight$", ("embed", "mlp")),
    (r"^lm_head\.weight$", ("vocab", "embed")),
    (r"^score\.weight$", (None, "embed")),
    (r"norm\.weight$|\.(o_proj|down_proj)\.bias$", (None,)),
    # LoRA adapters (lora.py): A [rank, in] shares W's input axis, B [out, rank] its output.
    (r"\.(q|k|v|gate|up)_proj\.lora_A\.weight$", (None, "embed")),
    (r"\.o_proj\.lora_A\.weight$", (None, "heads")),
    (r"\.down_proj\.lora_A\.weight$", (None, "mlp")),
    (r"\.q_proj\.lora_B\.weight$", ("heads", None)),
    (r"\.[kv]_proj\.lora_B\.weight$", ("kv_heads", None)),
    (r"\.(gate|up)_proj\.lora_B\.weight$", ("mlp", None)),
    (r"\.(o|down)_proj\.lora_B\.weight$", ("embed", None)),
)


def make_mesh(parallel: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``Mesh`` of shape (data, fsdp, tensor) over ``devices`` (default: all).

    The product of the mesh sizes must equal the device count
    (``ParallelConfig.check_devices`` raises with the arithmetic otherwise).
    """
    devices = list(jax.devices() if devices is None else devices)
    parallel.check_devices(len(devices), where="ParallelConfig.mesh (jax_pjit backend)")
    shape = tuple(parallel.mesh[a] for a in MESH_AXES)
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES)


def logical_to_spec(
    axes: Sequence[str | None], rules: Rules, mesh: Mesh, shape: Sequence[int] | None = None
) -> PartitionSpec:
    """Logical axes of an array -> ``PartitionSpec`` over ``mesh``.

    Unknown logical names and ``None`` are replicated. Mesh axes of size 1, axes already
    used by an earlier dimension and (with ``shape``) mappings whose total size does not
    divide the dimension are dropped.
    """
    table = dict(rules)
    used: set[str] = set()
    spec: list[tuple[str, ...] | None] = []
    for i, name in enumerate(axes):
        mesh_axes = tuple(
            a
            for a in table.get(name, ())
            if name is not None and a not in used and mesh.shape[a] > 1
        )
        size = int(np.prod([mesh.shape[a] for a in mesh_axes])) if mesh_axes else 1
        if shape is not None and shape[i] % size:
            log.info(
                "dimension %d (%s, size %d) not divisible by mesh axes %s: replicated",
                i,
                name,
                shape[i],
                mesh_axes,
            )
            mesh_axes = ()
        used.update(mesh_axes)
        spec.append(mesh_axes or None)
    return PartitionSpec(*spec)


def param_axes(path: str, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of the parameter at NNX path ``path`` (unknown paths: replicated)."""
    for pattern, axes in PARAM_AXES:
        if re.search(pattern, path) and len(axes) == ndim:
            return axes
    return (None,) * ndim


def param_shardings(
    shapes: Mapping[str, Sequence[int]], mesh: Mesh, rules: Rules
) -> dict[str, NamedSharding]:
    """``{path: NamedSharding}`` for a flat ``{path: shape}`` parameter dict."""
    return {
        path: NamedSharding(mesh, logical_to_spec(param_axes(path, len(shape)), rules, mesh, shape))
        for path, shape in shapes.items()
    }


def batch_sharding(mesh: Mesh, rules: Rules, ndim: int) -> NamedSharding:
    """Sharding of a per-sample array of rank ``ndim``: first axis over ``batch``."""
    return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules, mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


class ActivationSharding:
    """``(x, logical_axes) -> with_sharding_constraint(x, ...)``: the models' hook for
    activation layouts (batch over data+fsdp, MLP/heads over tensor)."""

    def __init__(self, mesh: Mesh, rules: Rules):
        self.mesh, self.rules = mesh, tuple(rules)

    def __call__(self, x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
        spec = logical_to_spec(axes, self.rules, self.mesh, x.shape)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))
