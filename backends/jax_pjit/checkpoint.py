"""orbax checkpoints of one JAX engine: parameters, optimizer state and step
(the models have no dropout: there is no RNG state to keep).

Layout of a checkpoint directory::

    <dir>/state/       orbax StandardCheckpointer tree: {"params", "opt_state", "step"}
    <dir>/polyrl.json  step, role, model shape and mesh (checked before loading)

Restoring takes an *abstract* target (``jax.ShapeDtypeStruct`` with shardings), so each
array is read straight into its shards on the current mesh: a checkpoint written on one
mesh restores on another.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from polyrl.backends import exchange

__all__ = [
    "save_state",
    "restore_state",
    "read_info",
    "abstract_like",
    "export_exchange",
    "opt_state_from_exchange",
]


def _ocp():
    import orbax.checkpoint as ocp  # heavy import, only when a checkpoint is touched

    return ocp


def save_state(path: str | os.PathLike, state: dict[str, Any], info: dict[str, Any]) -> None:
    """Write ``state`` (a pytree of jax arrays) and the JSON-able ``info`` under ``path``.

    An existing checkpoint at ``path`` is replaced.
    """
    root = Path(path).absolute()
    root.mkdir(parents=True, exist_ok=True)
    ckptr = _ocp().StandardCheckpointer()
    ckptr.save(root / "state", state, force=True)
    ckptr.wait_until_finished()
    (root / "polyrl.json").write_text(json.dumps(info, indent=1, sort_keys=True))


def abstract_like(state: Any) -> Any:
    """``jax.ShapeDtypeStruct`` (with sharding) for every array leaf of ``state``."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )


def restore_state(path: str | os.PathLike, target: Any) -> tuple[Any, dict[str, Any]]:
    """Read the tree :func:`save_state` wrote into ``target``'s shapes and shardings.

    Returns ``(state, info)``. A missing checkpoint, or one whose linear layers are in
    the layout of polyrl before HF's [out, in] (``.kernel`` [in, out]), raises naming the
    path.
    """
    info = read_info(path)
    root = Path(path).absolute() / "state"
    ckptr = _ocp().StandardCheckpointer()
    kernels = [k for k in ckptr.metadata(root).item_metadata["params"] if k.endswith(".kernel")]
    if kernels:
        raise ValueError(
            f"checkpoint {root.parent} stores linear layers as [in, out] `.kernel` arrays "
            f"(e.g. {kernels[0]}), the layout of polyrl before its JAX backend kept Hugging "
            "Face's [out, in] `.weight`; this version cannot restore it. Resume it with the "
            "polyrl version that wrote it, or start afresh from an HF model (a new "
            "polyrl.RunConfig.run_dir)"
        )
    return ckptr.restore(root, target), info


def read_info(path: str | os.PathLike) -> dict[str, Any]:
    """The ``info`` of the checkpoint at ``path``; a missing one raises naming the path."""
    root = Path(path).absolute()
    if not (root / "state").exists() or not (root / "polyrl.json").exists():
        raise FileNotFoundError(
            f"{root} is not a jax_pjit checkpoint (no state/ or polyrl.json); pass the "
            "directory given to JaxPjitEngine.save"
        )
    return json.loads((root / "polyrl.json").read_text())


def _adam_leaf(path: Any) -> tuple[str, str | None]:
    """(field, parameter name) of an optax AdamW state leaf: ``("count", None)``,
    ``("mu", name)`` or ``("nu", name)``, from its tree path (a NamedTuple's attribute or
    orbax's restored dict key, then the parameter's dict key)."""
    keys = [getattr(k, "name", getattr(k, "key", None)) for k in path]
    field = next(k for k in keys if k in ("count", "mu", "nu"))
    return field, (keys[-1] if field != "count" else None)


# optax's names of Adam's moments -> the exchange's (torch.optim.AdamW's).
_MOMENTS = {"mu": "exp_avg", "nu": "exp_avg_sq"}


def export_exchange(path: str | os.PathLike) -> exchange.Exchange:
    """The checkpoint at ``path`` as full fp32 numpy arrays under HF names, read on one
    CPU device (whatever mesh wrote it)."""
    info = read_info(path)
    root = Path(path).absolute() / "state"
    ckptr = _ocp().StandardCheckpointer()
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    target = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=cpu),
        ckptr.metadata(root).item_metadata.tree,
    )
    state = ckptr.restore(root, target)
    params = {k: np.asarray(v, np.float32) for k, v in state["params"].items()}
    moments: dict[str, dict[str, np.ndarray]] = {}
    adam_step = 0
    for leaf_path, leaf in jax.tree_util.tree_flatten_with_path(state.get("opt_state"))[0]:
        field, name = _adam_leaf(leaf_path)
        if field == "count":
            adam_step = int(leaf)
        else:
            moments.setdefault(_MOMENTS[field], {})[name] = np.asarray(leaf, np.float32)
    out = {k: info[k] for k in ("step", "role", "model")}
    return exchange.Exchange(params, moments, {**out, "adam_step": adam_step})


def opt_state_from_exchange(opt_state: Any, state: exchange.Exchange) -> Any:
    """``opt_state``'s tree (optax AdamW) with the exchange's moments and step count."""

    def fill(leaf_path, leaf):
        field, name = _adam_leaf(leaf_path)
        if field == "count":
            return np.asarray(state.adam_step, leaf.dtype)
        return state.moments[_MOMENTS[field]][name]

    return jax.tree_util.tree_map_with_path(fill, opt_state)
