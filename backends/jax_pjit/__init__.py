"""JAX training backend: ``engine.JaxPjitEngine`` (registered as "jax_pjit").

GPU memory is the backend's choice, not a user knob (docs/backends.md "GPU memory"):
importing this package sets :data:`GPU_ENV` in the process environment, where a value
is not already set (a user's own setting wins), before JAX creates its GPU client. JAX
would otherwise take 75% of the GPU at start-up and keep every freed buffer in its own
pool, while the roles it shares the GPU with (vLLM, other engines) need that memory
between its phases.
"""

import os

# XLA_PYTHON_CLIENT_PREALLOCATE=false: allocate on demand, no 75% grab at start-up.
# XLA_PYTHON_CLIENT_ALLOCATOR=platform: cudaMalloc/cudaFree per buffer, so memory freed
# (offload, the end of a step) goes back to the GPU for colocated roles instead of
# staying in JAX's pool at its peak. A jitted step allocates a few large buffers per
# call, so the cost is small next to the step; "bfc" keeps the pool (faster when a role
# has its GPUs to itself).
GPU_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}

for _name, _value in GPU_ENV.items():
    os.environ.setdefault(_name, _value)
