"""Full weights out of a sharded model, under Hugging Face names.

:func:`iter_buckets` gathers one parameter at a time (``DTensor.full_tensor()``, a
collective every rank joins in the same order; on a one-rank mesh the local tensor is
already whole) and groups the full tensors into buckets of about ``bucket_bytes``, so no
rank holds more than one bucket of gathered weights.
Names are exactly the keys ``save_pretrained`` writes: ``named_parameters()`` yields a
tied parameter once, under its first name (``model.embed_tokens.weight``; the tied
``lm_head.weight`` is left out, as HF does), plus persistent buffers (non-persistent
ones such as rotary ``inv_freq`` are not checkpoint state).

:func:`save_hf` writes those buckets with ``polyrl.backends.hf_dir.write_hf`` (the one HF
writer of both backends), with the config of a value model where there is one.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from polyrl.backends.buckets import iter_buckets as group_buckets
from polyrl.backends.hf_dir import value_head_config, write_hf
from polyrl.backends.torch_fsdp import lora

__all__ = ["hf_named_tensors", "full", "iter_buckets", "save_hf"]


def hf_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, local tensor or DTensor shard) in ``save_pretrained``'s key set."""
    yield from model.named_parameters()
    persistent = set(model.state_dict(keep_vars=True))
    for name, buf in model.named_buffers():
        if name in persistent:
            yield name, buf


def full(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The whole tensor on ``device`` (an all-gather for a DTensor shard; a DTensor on a
    mesh of one rank, or replicated, already holds it whole: no collective, no copy)."""
    if isinstance(t, DTensor):
        local = t.to_local()
        if t.device_mesh.size() == 1 or all(p.is_replicate() for p in t.placements):
            return local.to(device)
        if local.device != device:  # CPU-offloaded shard on a GPU world: gather on device
            t = DTensor.from_local(
                local.to(device), t.device_mesh, t.placements, shape=t.shape, stride=t.stride()
            )
        return t.full_tensor()
    return t.detach().to(device)


def iter_buckets(
    model: nn.Module,
    bucket_bytes: int,
    dtype: torch.dtype,
    device: torch.device,
    lora_scale: float | None = None,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets ``[(hf_name, full tensor in dtype)]`` of at most ``bucket_bytes`` each (a
    single tensor larger than that gets a bucket of its own). Every rank must consume
    the whole iterator: each tensor is a collective. ``lora_scale``: the model carries
    LoRA adapters, exported merged into the base weights (``lora.merged``); ``keep``:
    only the tensors it accepts (by name; the others are never gathered)."""
    named = hf_named_tensors(model)
    if keep is not None:
        named = ((n, t) for n, t in named if keep(n))
    pairs = ((name, full(shard.detach(), device)) for name, shard in named)
    if lora_scale is not None:
        pairs = lora.merged(pairs, lora_scale)
    cast = ((n, t.to(dtype) if t.is_floating_point() else t) for n, t in pairs)
    yield from group_buckets(cast, bucket_bytes)


def _hf_config(hf_config, dtype: torch.dtype, value_head: nn.Linear | None) -> dict:
    """The config to save, with ``dtype``: the model's own, or for a value model its
    classifier's (``polyrl.backends.hf_dir.value_head_config``)."""
    config = copy.deepcopy(hf_config)
    config.dtype = dtype  # what config.json records as the weights' dtype
    out = json.loads(config.to_json_string())
    return out if value_head is None else value_head_config(out, value_head.bias is not None)


def save_hf(
    model: nn.Module,
    hf_config,
    src_path: str,
    out_dir: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    is_main: bool,
    value_head: nn.Linear | None = None,
    max_shard_bytes: int = 5 << 30,
    lora_scale: float | None = None,
) -> None:
    """Write ``model`` as an HF directory at ``out_dir`` (rank 0 writes; every rank must
    call it, the gather is collective): safetensors in ``dtype``, ``config.json`` and the
    tokenizer/generation files copied from ``src_path`` (``polyrl.backends.hf_dir.write_hf``)."""
    config = _hf_config(hf_config, dtype, value_head)
    buckets = iter_buckets(model, min(max_shard_bytes, 1 << 30), dtype, device, lora_scale)
    write_hf(
        buckets,
        src_path,
        out_dir,
        write=is_main,
        config=config,
        max_shard_bytes=max_shard_bytes,
    )
