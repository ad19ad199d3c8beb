"""polyrl: RL post-training of LLMs on a PyTorch FSDP2 or a JAX backend, one algorithm code path.

See docs/design.md for the map. This package never imports torch or jax at module level.
"""

__version__ = "0.1.0"
