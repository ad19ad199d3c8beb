"""Multi-controller JAX: one process per host, joined with ``jax.distributed``.

A JAX role on several hosts runs one process per host (``ENGINES["jax_pjit"].process``
in ``polyrl.backends.base``). Each calls :func:`initialize_from_env` before touching a
device; the hosts then see one global device list, build the same Mesh over it and run
the same jitted programs. The batch is fed per host: each process holds its shard of the
rows (``Batch.split`` over the role's workers) and :func:`global_rows` assembles the
global array from the process-local pieces; :func:`local_rows` gives each process its
own rows of an output back. With one process every function is the plain single-host
operation, so the engine has one code path.

On CPU the hosts' collectives go through gloo (``jax_cpu_collectives_implementation``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from polyrl.backends.base import JAX_COORDINATOR_ENV, JAX_NUM_PROCESSES_ENV, JAX_PROCESS_ID_ENV

__all__ = ["initialize_from_env", "agree", "global_rows", "local_rows", "gather"]


def initialize_from_env() -> None:
    """Join the role's hosts if ``POLYRL_JAX_COORDINATOR`` is set (a no-op for one host
    or when already joined). Must run before the process first uses a JAX device."""
    coordinator = os.environ.get(JAX_COORDINATOR_ENV)
    if coordinator is None or jax.distributed.is_initialized():
        return
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator,
        num_processes=int(os.environ[JAX_NUM_PROCESSES_ENV]),
        process_id=int(os.environ[JAX_PROCESS_ID_ENV]),
    )


def agree(values: Sequence[float], op: str) -> np.ndarray:
    """Elementwise ``"max"`` or ``"sum"`` of ``values`` over all processes."""
    values = np.asarray(values)
    if jax.process_count() == 1:
        return values
    gathered = multihost_utils.process_allgather(values)
    return gathered.max(axis=0) if op == "max" else gathered.sum(axis=0)


def global_rows(sharding: NamedSharding, local: np.ndarray) -> jax.Array:
    """The global array whose rows are every process's ``local`` rows, in process order."""
    return jax.make_array_from_process_local_data(sharding, local)


def local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of a row-sharded global array (the inverse of global_rows)."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    local = multihost_utils.global_array_to_host_local_array(x, x.sharding.mesh, x.sharding.spec)
    return np.asarray(local)


def gather(x: jax.Array, device: jax.Device) -> jax.Array:
    """The full value of ``x`` on this process's ``device`` (an all-gather over hosts
    when ``x`` has shards on other processes)."""
    if x.is_fully_addressable:
        return jax.device_put(x, device)
    return jax.device_put(multihost_utils.process_allgather(x, tiled=True), device)
