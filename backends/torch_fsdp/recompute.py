"""Activation checkpointing (``ModelConfig.gradient_checkpointing``) per decoder layer.

``checkpoint_policy="full"`` is transformers' own non-reentrant checkpointing
(``models.load_model``): each layer keeps only its input and recomputes everything in the
backward pass. ``"selective"`` is PyTorch's selective activation checkpointing (SAC)
around each decoder layer's ``forward``: the outputs of the matmuls (q/k/v/o and MLP
projections) and of the attention kernel are kept, and only the elementwise work (norms,
rotary, activation, residual adds) runs again in the backward pass.

The wrapper sits on the instance's ``forward``, under ``nn.Module.__call__``, so FSDP2's
hooks stay outside the checkpointed region. Compiled layers (``ModelConfig.compile``) take
no wrapper (``models._wrap_layers``): inductor's partitioner keeps the matmul outputs and
recomputes the pointwise work of each compiled graph by itself. A checkpoint *around* a
compiled layer would see inductor's ``mm.out`` calls, not ``mm.default``, keep only the
attention output and recompute every matmul; one *inside* it is traced into the graph
(same bytes kept as without it, on the tiny model), unless the layer has a graph break
(``polyrl_varlen`` attention), which makes dynamo run the whole checkpointed layer eagerly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from polyrl.backends.torch_fsdp import attention

__all__ = ["saved_ops", "selective", "selective_contexts"]


@functools.cache
def saved_ops() -> frozenset:
    """The ops whose outputs selective checkpointing keeps: matmuls and attention
    kernels (every SDPA backend, and ``polyrl_varlen``'s FlashAttention op)."""
    aten = torch.ops.aten
    ops = {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
    }
    if attention._flash_varlen_fn() is not None:  # imported: its torch_attn op exists
        ops.add(torch.ops.torch_attn._varlen_attn.default)
    return frozenset(ops)


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for selective checkpointing:
    the outputs of :func:`saved_ops` are kept, everything else is recomputed."""
    return create_selective_checkpoint_contexts(_policy)


def selective(forward: Callable) -> Callable:
    """``forward`` under selective activation checkpointing when gradients are recorded
    (a no-grad pass, e.g. scoring, runs it plainly)."""

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(
            forward, *args, use_reentrant=False, context_fn=selective_contexts, **kwargs
        )

    return checkpointed
