"""Fixtures for the algos tests: one helper per array backend (numpy, torch, jax).

Every test runs in float64. JAX's 64-bit mode is switched on *per test* with the
``jax.enable_x64`` context (not the process-wide ``jax.config.update``), so other test
directories that run in the same pytest process keep JAX's float32 default.
"""

from __future__ import annotations

import numpy as np
import pytest

BACKENDS = ("numpy", "torch", "jax")


@pytest.fixture(autouse=True)
def _jax_x64():
    import jax

    with jax.enable_x64(True):
        yield


class Backend:
    """Turn numpy test data into one framework's arrays and back, and take gradients."""

    def __init__(self, name: str):
        self.name = name
        self._jitted: dict = {}

    def __repr__(self) -> str:
        return self.name

    def asarray(self, a, dtype=None):
        a = np.asarray(a)
        if dtype is None:
            dtype = np.float64 if a.dtype.kind == "f" else a.dtype
        a = a.astype(dtype)
        if self.name == "numpy":
            return a
        if self.name == "torch":
            import torch

            return torch.from_numpy(a.copy())
        import jax.numpy as jnp

        return jnp.asarray(a)

    def numpy(self, x) -> np.ndarray:
        if self.name == "torch":
            return x.detach().cpu().numpy()
        return np.asarray(x)

    def is_native(self, x) -> bool:
        """``x`` is an array of this backend (the function returned the same kind)."""
        if self.name == "numpy":
            return isinstance(x, np.ndarray | np.generic)
        if self.name == "torch":
            import torch

            return isinstance(x, torch.Tensor)
        import jax

        return isinstance(x, jax.Array)

    def call(self, fn, *arrays):
        """``fn(*arrays)``; for jax under ``jax.jit``, as the JAX backend runs a loss.

        jit is also what keeps this suite fast: eager jax compiles every primitive for every
        new shape (~1 s of CPU per loss per shape), one jit compile is ~0.3 s.
        """
        if self.name == "jax":
            import jax

            if fn not in self._jitted:  # reuse the jitted function (and its compilations)
                self._jitted[fn] = jax.jit(fn)
            return self._jitted[fn](*arrays)
        return fn(*arrays)

    def grad(self, fn, *args) -> list[np.ndarray]:
        """Gradients of the scalar ``fn(*arrays)`` w.r.t. every argument (torch autograd;
        ``jax.jit(jax.grad(fn))``)."""
        if self.name == "torch":
            import torch

            ts = [
                torch.from_numpy(np.asarray(a, dtype=np.float64).copy()).requires_grad_(True)
                for a in args
            ]
            fn(*ts).backward()
            return [t.grad.numpy() if t.grad is not None else np.zeros(t.shape) for t in ts]
        if self.name == "jax":
            import jax
            import jax.numpy as jnp

            js = [jnp.asarray(np.asarray(a, dtype=np.float64)) for a in args]
            grad = jax.jit(jax.grad(fn, argnums=tuple(range(len(js)))))
            return [np.asarray(g) for g in grad(*js)]
        raise ValueError("numpy has no autograd")


@pytest.fixture(params=BACKENDS)
def bk(request) -> Backend:
    """Each backend in turn."""
    return Backend(request.param)


@pytest.fixture(params=("torch", "jax"))
def gbk(request) -> Backend:
    """The backends with autograd."""
    return Backend(request.param)


@pytest.fixture
def backends() -> dict[str, Backend]:
    return {name: Backend(name) for name in BACKENDS}


class Ctx:
    """Stand-in for ``polyrl.backends.base.LossContext`` (algos tests do not import backends)."""

    def __init__(self, global_tokens, global_seqs, temperature=1.0):
        self.global_tokens = global_tokens
        self.global_seqs = global_seqs
        self.temperature = temperature


@pytest.fixture
def make_ctx():
    return Ctx
