"""JAX training backend: ``engine.JaxPjitEngine`` (registered as "jax_pjit").

GPU memory is the backend's choice, not a user knob (docs/backends.md "GPU memory"):
importing this package sets :data:`GPU_ENV` in the process environment, where a value
is not already set (a user's own setting wins), before JAX creates its GPU client. JAX
would otherwise take 75% of the GPU at start-up into a pool it never gives back, while the
roles it shares the GPU with (vLLM, other engines) need that memory when this engine
offloads (``gpu_memory.py``).
"""

import os

# XLA_PYTHON_CLIENT_PREALLOCATE=false: allocate on demand, no 75% grab at start-up.
# XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async: CUDA's stream-ordered allocator. Frees need no
# device-wide synchronisation (``platform``'s cudaFree does: it cost the 1.5B training
# step 29%), and its pool, unlike ``bfc``'s, can hand memory back: the engine keeps the
# pool while resident and trims it when it offloads (gpu_memory.py).
GPU_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async"}

for _name, _value in GPU_ENV.items():
    os.environ.setdefault(_name, _value)
