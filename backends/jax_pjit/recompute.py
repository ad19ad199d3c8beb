"""Activation checkpointing (``ModelConfig.gradient_checkpointing``) per decoder layer:
the ``jax.checkpoint`` policy of each ``checkpoint_policy``.

``"full"``: nothing inside a layer is saveable, so the backward pass reruns the whole
layer from its input. ``"selective"``: the outputs of dots without batch dimensions (the
q/k/v/o and MLP projections: ``[B, T, E] x [F, E]`` contracts ``E`` only) and the
attention output (named :data:`ATTENTION_OUT` where ``models.Attention`` produces it)
are saved; the elementwise work (norms, rotary, activation, residual adds) and the
attention's batched score/probability dots run again, so no ``[B, H, T, T]`` tensor is
kept.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from polyrl.config import CHECKPOINT_POLICIES

__all__ = ["ATTENTION_OUT", "remat_policy"]

ATTENTION_OUT = "attention_out"


def remat_policy(checkpoint_policy: str) -> Callable | None:
    """The ``nnx.remat`` / ``jax.checkpoint`` policy of ``ModelConfig.checkpoint_policy``
    (None: save nothing, recompute everything)."""
    if checkpoint_policy == "full":
        return None
    if checkpoint_policy == "selective":
        policies = jax.checkpoint_policies
        return policies.save_from_both_policies(
            policies.dots_with_no_batch_dims_saveable,
            policies.save_only_these_names(ATTENTION_OUT),
        )
    raise ValueError(
        f"ModelConfig.checkpoint_policy={checkpoint_policy!r} is not one of "
        f"{list(CHECKPOINT_POLICIES)}"
    )
