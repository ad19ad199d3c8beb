"""The JAX backend picks its GPU allocator itself (docs/backends.md "GPU memory"), and a
value the user set in the environment wins."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = (
    "import os, polyrl.backends.jax_pjit; "
    "print(os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'], os.environ['XLA_PYTHON_CLIENT_ALLOCATOR'])"
)


def _probe(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PYTHON_CLIENT_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_backend_sets_allocator_defaults_and_user_value_wins():
    assert _probe() == "false cuda_async"
    assert _probe(XLA_PYTHON_CLIENT_ALLOCATOR="bfc") == "false bfc"
