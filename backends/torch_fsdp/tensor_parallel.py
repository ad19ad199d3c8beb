"""Tensor parallelism (DTensor) of the decoder layers, inside one node.

With a ``tensor`` mesh axis of size T > 1, every decoder layer is split Megatron-style
over the T ranks of its tensor-parallel group (``torch.distributed.tensor.parallel``):

* attention: ``q_proj``/``k_proj``/``v_proj`` column-wise (each rank computes
  ``num_attention_heads / T`` query heads and ``num_key_value_heads / T`` key/value
  heads), ``o_proj`` row-wise (its partial sums are all-reduced over the group);
* MLP: ``gate_proj``/``up_proj`` column-wise, ``down_proj`` row-wise;
* Qwen3's per-head ``q_norm``/``k_norm``: replicated weights applied to the local heads
  (:class:`~torch.distributed.tensor.parallel.SequenceParallel` over the head dimension),
  so their gradients are summed over the group.

Everything else (embedding, layer norms, the LM head, a value head) stays replicated over
the group and sees full activations; FSDP2 then shards all parameters over the
data-parallel axes (``sharding.shard_model``). One all-reduce per attention block and
one per MLP block in forward, as many in backward.

Ranks of a group compute on the same rows: :func:`gather_rows` concatenates the
group's shards (each rank receives its own shard, as in pure data parallelism), the
engine runs the group's rows and :func:`own_rows` keeps this rank's part of the outputs
-- verl does the same for Ulysses sequence-parallel groups. So callers split a batch
over *all* ranks, with or without tensor parallelism.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from polyrl.batch import Batch

__all__ = ["layer_plan", "parallelize_layers", "gather_rows", "own_rows"]

# Submodule of a decoder layer (HF Qwen2/Qwen3/Llama/Mistral names) -> how it is split.
_REQUIRED = {
    "self_attn.q_proj": ColwiseParallel,
    "self_attn.k_proj": ColwiseParallel,
    "self_attn.v_proj": ColwiseParallel,
    "self_attn.o_proj": RowwiseParallel,
    "mlp.gate_proj": ColwiseParallel,
    "mlp.up_proj": ColwiseParallel,
    "mlp.down_proj": RowwiseParallel,
}
# Per-head norms (Qwen3) act on [B, L, heads, head_dim] with the heads split over the group.
_OPTIONAL = {"self_attn.q_norm", "self_attn.k_norm"}


def layer_plan(layer: nn.Module) -> dict[str, ParallelStyle]:
    """The parallel style of each split submodule of one decoder layer."""
    names = {name for name, _ in layer.named_modules()}
    missing = sorted(set(_REQUIRED) - names)
    if missing:
        raise ValueError(
            f"{type(layer).__name__} has no {missing}: torch_fsdp tensor parallelism knows the "
            "Qwen2/Qwen3/Llama/Mistral decoder layout (self_attn.{q,k,v,o}_proj, "
            "mlp.{gate,up,down}_proj); set ParallelConfig.mesh tensor=1 for this model"
        )
    plan: dict[str, ParallelStyle] = {name: style() for name, style in _REQUIRED.items()}
    for name in _OPTIONAL & names:
        plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def parallelize_layers(layers: list[nn.Module], tp_mesh: DeviceMesh) -> None:
    """Split each decoder layer over ``tp_mesh`` in place (parameters become DTensors)."""
    for layer in layers:
        parallelize_module(layer, tp_mesh, layer_plan(layer))


def gather_rows(batch: Batch, tp_mesh: DeviceMesh) -> Batch:
    """The tensor columns of every shard of this rank's tensor-parallel group, in group
    rank order (the rows the whole group computes on)."""
    local = Batch(dict(batch.tensors), {}, dict(batch.info))
    parts: list[Batch | None] = [None] * tp_mesh.size()
    dist.all_gather_object(parts, local, group=tp_mesh.get_group())
    return Batch.concat(parts)


def own_rows(tp_mesh: DeviceMesh, rows: int) -> slice:
    """This rank's rows of the group's gathered batch (``rows`` per rank)."""
    start = tp_mesh.get_local_rank() * rows
    return slice(start, start + rows)
