"""tests/backends fixtures: a per-session JAX compilation cache, and the 2-rank torch run
that the contract suite (world size) and torch_fsdp/test_distributed.py (its checkpoint)
share, so it runs once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# torch_fsdp_helpers, for the contract suite here, jax_pjit's tests (assert_same_calls) and
# the spawned ranks (spawn hands its children the parent's sys.path).
sys.path.insert(0, str(Path(__file__).parent / "torch_fsdp"))


@pytest.fixture(scope="session", autouse=True)
def jax_compile_cache(tmp_path_factory):
    """Engines built in different tests (the contract suite's and jax_pjit/'s) compile the
    same programs (same model, shapes and mesh); XLA's CPU compiler takes seconds per
    training program, so a persistent cache keeps these suites fast. It changes compile
    time only, never results."""
    try:
        import jax
    except ImportError:
        return
    jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="session")
def torch_two_ranks(tiny_model_dir, tmp_path_factory):
    """``two_rank_worker``'s results ({mesh name: {"metrics", "weights"}}) and the
    directory that holds its fsdp=2 checkpoint (``ckpt``)."""
    torch = pytest.importorskip("torch")
    from torch_fsdp_helpers import spawn, two_rank_worker

    out = tmp_path_factory.mktemp("dist")
    spawn(two_rank_worker, 2, str(tiny_model_dir), str(out))
    return torch.load(out / "results.pt", weights_only=False), out
