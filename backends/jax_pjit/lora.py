"""LoRA on the JAX backend: adapters of our own (``ModelConfig.lora``; docs/backends.md
"LoRA").

The models put ``lora_A.weight`` [rank, in] and ``lora_B.weight`` [out, rank] under each
target projection (``models.Linear``): the HF name scheme PEFT uses, without PEFT's
adapter name, so adapters move between the backends by renaming alone. They are sharded
by the projection's own logical axes (``sharding.PARAM_AXES``: ``A`` shares the input
axis of ``W``, ``B`` its output axis; the rank axis is replicated).

:func:`init_adapters` gives the torch backend's initial adapters (``A`` from
``LoraConfig.initial_a``, ``B`` zero);
:func:`merged` yields the weights the rollout servers and HF exports get:
``W + scale * B @ A`` under the base names, one target at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from polyrl.config import LoraConfig

__all__ = ["A", "B", "is_adapter", "init_adapters", "merged", "split"]

A, B = ".lora_A.weight", ".lora_B.weight"


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA adapter matrix."""
    return name.endswith((A, B))


def split(shapes: Mapping[str, Sequence[int]]) -> tuple[dict, dict]:
    """``(base, adapters)``: the ``{name: shape}`` of the frozen and the trained params."""
    base = {k: v for k, v in shapes.items() if not is_adapter(k)}
    return base, {k: v for k, v in shapes.items() if is_adapter(k)}


def init_adapters(shapes: Mapping[str, Sequence[int]], cfg: LoraConfig) -> dict[str, np.ndarray]:
    """fp32 initial adapters, as the torch backend's: ``A`` from ``cfg.initial_a`` (PEFT's
    Kaiming-uniform, seeded by the target's name), ``B`` = 0, so the adapted model starts
    as the base model."""
    return {
        name: cfg.initial_a(name.removesuffix(A), tuple(shape))
        if name.endswith(A)
        else np.zeros(tuple(shape), np.float32)
        for name, shape in shapes.items()
    }


@functools.cache
def _merge(scale: float):
    """One jitted ``W + scale * B @ A`` in fp32 (compiled once per target shape)."""
    f32 = jnp.float32
    return jax.jit(lambda w, a, b: w.astype(f32) + scale * (b.astype(f32) @ a.astype(f32)))


def merged(params: Mapping[str, jax.Array], scale: float) -> Iterator[tuple[str, jax.Array]]:
    """``(hf_name, array)`` without adapters: each adapted ``<m>.weight`` replaced by
    ``W + scale * B @ A`` (fp32), made when the consumer reaches it."""
    for name, x in params.items():
        if is_adapter(name):
            continue
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and prefix + A in params:
            yield name, _merge(scale)(x, params[prefix + A], params[prefix + B])
        else:
            yield name, x
