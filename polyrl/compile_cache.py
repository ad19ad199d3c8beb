"""Compile caches kept across runs (``RunConfig.cache_dir``).

The first step of a run compiles: torch.compile's Inductor graphs and Triton kernels on
the torch backend, XLA executables on the JAX backend, vLLM's own torch.compile graphs
on a GPU rollout server. Each framework can keep what it compiled on disk and reuse it in
a later process that compiles the same program; this module points all of them at one
directory, in the driver and (through the Ray ``runtime_env``) in every worker:

  ``<cache_dir>/torch/inductor``  TORCHINDUCTOR_CACHE_DIR (FX graph and AOTAutograd caches)
  ``<cache_dir>/triton``          TRITON_CACHE_DIR (compiled GPU kernels)
  ``<cache_dir>/jax``             JAX_COMPILATION_CACHE_DIR (JAX's persistent cache)
  ``<cache_dir>/vllm``            VLLM_CACHE_ROOT (vLLM's compile cache)

Concurrent runs may share the directory: every one of these caches writes an entry to a
temporary file and renames it into place, so a reader sees a whole entry or none, and two
runs compiling the same program both write the same entry. A variable already set in the
environment wins over the directory (a cluster's own cache location stays).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_VARS", "cache_env", "use_cache"]

# Environment variable -> its directory under RunConfig.cache_dir.
CACHE_VARS = {
    "TORCHINDUCTOR_CACHE_DIR": "torch/inductor",
    "TRITON_CACHE_DIR": "triton",
    "JAX_COMPILATION_CACHE_DIR": "jax",
    "VLLM_CACHE_ROOT": "vllm",
}


def cache_env(cache_dir: str | None) -> dict[str, str]:
    """The cache variables for ``cache_dir`` (``~`` expanded; None or "": none), each
    taken from the environment where it is set there already."""
    if not cache_dir:
        return {}
    root = Path(cache_dir).expanduser().absolute()
    return {var: os.environ.get(var) or str(root / sub) for var, sub in CACHE_VARS.items()}


def use_cache(cache_dir: str | None) -> dict[str, str]:
    """Set the cache variables in this process (so a driver-side compile uses them too)
    and return them for the workers' ``runtime_env``."""
    env = cache_env(cache_dir)
    os.environ.update(env)
    return env
