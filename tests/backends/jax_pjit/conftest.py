"""JAX test settings: a per-session persistent compilation cache.

Engines built in different tests compile the same programs (same model, shapes and mesh);
XLA's CPU compiler takes seconds per training program, so the cache keeps this directory's
suite fast. It changes compile time only, never results.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def jax_compile_cache(tmp_path_factory):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
