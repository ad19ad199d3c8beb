"""Activation checkpointing (``ModelConfig.gradient_checkpointing``) per decoder layer:
the ``jax.checkpoint`` policy of each ``checkpoint_policy``.

``"full"``: nothing inside a layer is saveable, so the backward pass reruns the whole
layer from its input. ``"budget"``: the first ``round((1 - budget) * L)`` of the ``L``
layers as "full", the others keep everything (no checkpoint), so about ``budget`` of the
activations stay (torch's compiler chooses per operation instead; JAX's checkpoint
policies name what to save, not how much). ``"selective"``: the outputs of dots without batch dimensions (the
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

__all__ = ["ATTENTION_OUT", "remat_policy", "layer_remat"]

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


def layer_remat(
    checkpoint_policy: str | None, budget: float, index: int, layers: int
) -> tuple[bool, Callable | None]:
    """Whether decoder layer ``index`` of ``layers`` is checkpointed, and its
    :func:`remat_policy`: every layer under "full" and "selective", the first
    ``round((1 - budget) * layers)`` under "budget"; none without a policy."""
    if checkpoint_policy is None:
        return False, None
    if checkpoint_policy == "budget":
        return index < round((1 - budget) * layers), None
    return True, remat_policy(checkpoint_policy)
